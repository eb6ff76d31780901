"""Errors every layer may raise (the bottom of the import layers: imports nothing from meshfold).

``ConfigError`` is a configuration problem phrased as one line that names the key to change.
Each section's checks (``models/config.py``, ``layout.py``, ``parallel/config.py``,
``data/config.py``, ``lowcomm/config.py``, ``config.py``) raise it before any process group
starts; the runtime raises it too for input it can only see later (a corpus, a checkpoint).
"""

from __future__ import annotations

import difflib
import math


class ConfigError(ValueError):
    """A configuration problem, phrased as one line that names the key to change."""


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending: the values an error message suggests (and the
    planner's search enumerates: pairs up to sqrt(n), it asks thousands of times)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to a mistyped ``word``, or ""."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
