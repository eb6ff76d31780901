"""Errors every layer may raise (the bottom of the import layers: imports nothing from meshfold).

``ConfigError`` is a configuration problem phrased as one line that names the key to change.
Each section's checks (``models/config.py``, ``layout.py``, ``parallel/config.py``,
``data/config.py``, ``lowcomm/config.py``, ``config.py``) raise it before any process group
starts; the runtime raises it too for input it can only see later (a corpus, a checkpoint).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, phrased as one line that names the key to change."""


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending: the values an error message suggests."""
    return [d for d in range(1, n + 1) if n % d == 0]
