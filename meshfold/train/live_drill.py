"""Fault injection for live recovery's drills (tests/test_live.py, tests/test_live_faults.py,
benchmarks/live_faults.py, docs/resilience.md): a replica group's worker kills or stops itself
at a named point of a step, on one attempt of its group (by default the first: a restarted
group trains on). Set in the environment of ``meshfold train --nproc N``:

- ``MESHFOLD_LIVE_KILL=REPLICA:RANK:STEP[:POINT[:ATTEMPT]][,...]``: SIGKILL (a hard crash) in
  step STEP (``*``: the first time the point is reached) at POINT (``POINTS``, default
  ``exchange``) on the group's attempt ATTEMPT (its restart count, default 0);
- ``MESHFOLD_LIVE_STOP=REPLICA:RANK:STEP:SECONDS[:UNTIL][,...]``: SIGSTOP (a hung replica: its
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
# The named points where live.py calls ``Faults.at``.
POINTS = {
    "exchange": "after the step's backward, before the cross-replica exchange",
    "quorum": "right after the Lighthouse's answer named this replica, before the quorum's group is built",
    "heal": "in the middle of a heal (source, joiner or bystander), after its first tensor",
}

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


def _kill_spec(spec: str) -> tuple[str, str, int]:
    """(step or ``*``, point, attempt) of one ``MESHFOLD_LIVE_KILL`` entry."""
    parts = spec.split(":")
    point = parts[3] if len(parts) > 3 else "exchange"
    if len(parts) < 3 or len(parts) > 5 or point not in POINTS:
        raise ValueError(f"{ENV_KILL}={spec!r}: expected REPLICA:RANK:STEP[:POINT[:ATTEMPT]], POINT one of "
                         f"{sorted(POINTS)}")
    return parts[2], point, int(parts[4]) if len(parts) > 4 else 0


class Faults:
    """The faults this process injects on this attempt of its group."""

    def __init__(self, replica: int, rank: int, attempt: int, run_dir: str):
        self.kill_at: dict[str, str] = {}  # point -> step (a number, or "*": the first time)
        self.stop_at = None
        self.stop_s, self.until, self.metrics = 0.0, 0, str(Path(run_dir) / "metrics.jsonl")
        for spec in filter(None, os.environ.get(ENV_KILL, "").split(",")):
            step, point, on_attempt = _kill_spec(spec)
            if _mine(spec, replica, rank) and on_attempt == attempt:
                self.kill_at[point] = step
        if attempt > 0:
            return
        for stop in filter(None, os.environ.get(ENV_STOP, "").split(",")):
            if _mine(stop, replica, rank):
                parts = stop.split(":")
                self.stop_at, self.stop_s = int(parts[2]), float(parts[3])
                self.until = int(parts[4]) if len(parts) > 4 else 0

    def at(self, step: int, point: str = "exchange") -> None:
        """At ``point`` (``POINTS``) of step ``step``."""
        if self.kill_at.get(point) in (str(step), "*"):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.stop_at and point == "exchange":
            self.stop_at = None
            subprocess.Popen([sys.executable, "-c", _RESUME, str(os.getpid()), str(self.stop_s), self.metrics,
                              str(self.until)])
            os.kill(os.getpid(), signal.SIGSTOP)
