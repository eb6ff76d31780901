"""The run's step counter, as one small object with a clear owner.

The Trainer owns it (``Trainer.step`` reads and writes it) and hands it explicitly to the
components that need the step: the Checkpointer saves it and sets it when it loads a
checkpoint (resume, NaN-guard rollback), the FaultMonitor reads it to name the step in its
reports. No component receives the Trainer itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    step: int = 0  # optimizer steps completed
