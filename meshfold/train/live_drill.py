"""Fault injection for live recovery's drills (tests/test_live.py, docs/resilience.md): a
replica group's worker kills or stops itself in the middle of a step, after its backward and
before the cross-replica exchange, on its group's first attempt only (a restarted group
trains on). Set in the environment of ``meshfold train --nproc N``:

- ``MESHFOLD_LIVE_KILL=REPLICA:RANK:STEP[,...]``: SIGKILL (a hard crash);
- ``MESHFOLD_LIVE_STOP=REPLICA:RANK:STEP:SECONDS[:UNTIL]``: SIGSTOP (a hung replica: its
  connections stay open, it answers nothing), SIGCONT after SECONDS, or as soon as the run's
  ``metrics.jsonl`` holds step UNTIL (the others trained on without it), whichever is first:
  a drill whose order of events does not depend on how fast the machine is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ENV_KILL = "MESHFOLD_LIVE_KILL"
ENV_STOP = "MESHFOLD_LIVE_STOP"

# The resumer: a process of its own (the stopped one can do nothing), stdlib only.
_RESUME = """
import json, os, signal, sys, time
pid, seconds, path, until = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def reached():
    try:
        return any(json.loads(line).get("step", 0) >= until for line in open(path))
    except (OSError, ValueError):
        return False
end = time.monotonic() + seconds
while time.monotonic() < end and not (until and reached()):
    time.sleep(0.2)
os.kill(pid, signal.SIGCONT)
"""


def _mine(spec: str, replica: int, rank: int) -> bool:
    r, k = (int(x) for x in spec.split(":")[:2])
    return (r, k) == (replica, rank)


class Faults:
    """The faults this process injects (none on a restarted group's attempt)."""

    def __init__(self, replica: int, rank: int, attempt: int, run_dir: str):
        self.kill_at = self.stop_at = None
        self.stop_s, self.until, self.metrics = 0.0, 0, str(Path(run_dir) / "metrics.jsonl")
        if attempt > 0:
            return
        for spec in filter(None, os.environ.get(ENV_KILL, "").split(",")):
            if _mine(spec, replica, rank):
                self.kill_at = int(spec.split(":")[2])
        stop = os.environ.get(ENV_STOP, "")
        if stop and _mine(stop, replica, rank):
            parts = stop.split(":")
            self.stop_at, self.stop_s = int(parts[2]), float(parts[3])
            self.until = int(parts[4]) if len(parts) > 4 else 0

    def at(self, step: int) -> None:
        """In step ``step``, between the backward and the exchange."""
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.stop_at:
            self.stop_at = None
            subprocess.Popen([sys.executable, "-c", _RESUME, str(os.getpid()), str(self.stop_s), self.metrics,
                              str(self.until)])
            os.kill(os.getpid(), signal.SIGSTOP)
