"""Graceful stop: SIGTERM, SIGINT (Ctrl-C) and the scheduler's warning signal (SIGUSR1, e.g.
Slurm's ``--signal=USR1@120``) finish the current step, write a checkpoint and exit with
``EXIT_STOPPED``; a second signal exits at once (``128 + signal``), without a traceback.

The handler only sets a flag; the training loop asks ``StopRequest.agreed()`` after each
step. With several processes every rank must stop after the *same* step (a checkpoint needs
all of them), so the flag is agreed on with one max all-reduce of a 4-byte tensor on the
compute device per step, after the step's own host sync (the loss); a signal delivered to
one rank only (or to the launcher, which passes it on) stops them all.

Under the local launcher (``--nproc``) a Ctrl-C reaches every process of the terminal's
process group and torchrun's agent then passes it on to the workers once more: a repeat of
the same signal within ``REPEAT_S`` of the first is that echo, not a second request.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from meshfold import comm

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint written; run it again to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
REPEAT_S = 1.0


class StopRequest:
    """Installed once per process (main thread) by the CLI; the trainer polls it."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.signum: int | None = None
        self.first_at = 0.0
        self._previous = {}

    def install(self) -> "StopRequest":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
            if self.rank == 0:
                print(f"meshfold: {signal.Signals(signum).name} received: finishing this step, then writing a "
                      f"checkpoint and stopping (send it again to stop at once, without one)",
                      file=sys.stderr, flush=True)
            return
        if signum == self.signum and now - self.first_at < REPEAT_S:
            return  # the launcher passing on the same signal
        print(f"meshfold: rank {self.rank}: {signal.Signals(signum).name} again: stopping now, without a checkpoint",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank was asked to stop (one all-reduce per call)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        comm.all_reduce(flag, None, None, op="max")  # a control flag: not counted as traffic
        if flag.item() and self.signum is None:
            self.signum = signal.SIGTERM  # another rank was signalled: stop with it
            self.first_at = time.monotonic()
        return bool(flag.item())

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "?"


class StopAtBoundary(Exception):
    """A feature cannot start the next step (live recovery: its lighthouse is lost): the trainer
    writes the last step's checkpoint and stops as on a signal (``Stopped``, ``EXIT_STOPPED``);
    the message says why."""


class Stopped(Exception):
    """Training stopped on a signal after ``step``; ``saved`` says whether its checkpoint was written."""

    def __init__(self, signame: str, step: int, saved: str | None, failure: str | None = None):
        self.signame, self.step, self.saved, self.failure = signame, step, saved, failure
        super().__init__(f"stopped by {signame} after step {step}")
