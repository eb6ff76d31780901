"""A cross-replica communicator that aborts itself on its own timeout (live recovery's
standalone groups, ``train/live.py``; docs/resilience.md "NCCL and aborts").

NCCL's own answer to a collective that never completes is its watchdog, which ends the
process after the collective timeout: under live recovery that turns a lost peer into a lost
replica group. ``AbortableGroup`` does what torchft's ``ProcessGroupNCCL`` wrapper does
(``torchft/process_group.py``): it builds the communicator non-blocking (``config.blocking
= False``: an init or a collective that hangs returns to the host, which can then abort it),
gives the backend a timeout longer than its own so the watchdog never fires first, and
bounds every wait itself: a collective not done within ``timeout_s`` aborts the
communicator (``ProcessGroup.abort``: ``ncclCommAbort`` on NCCL, closing the pairs on gloo),
marks the group errored and raises ``CommAborted`` in the waiting thread. The process lives
on; the caller drops the group and builds the next one from the quorum. Every later call on
an aborted group raises at once.

The deadline is judged by polling the work (``is_completed``) on the host, which the live
exchange does anyway (each rank votes on its result); ``PeerWatch.wait`` polls the same
``is_completed``, so a heartbeat verdict and this timeout compose.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from meshfold import comm

# The backend's own timeout, beyond the wrapper's: the wrapper aborts first, the NCCL
# watchdog (which ends the process) never gets to.
BACKEND_MARGIN_S = 60.0


class CommAborted(RuntimeError):
    """A collective of an ``AbortableGroup`` did not complete in time; the group is aborted."""


def _nccl_group(store, rank: int, size: int, timeout_s: float):
    """A non-blocking NCCL communicator (as torchft's): its init and collectives return to the
    host, so ``abort`` can end them. Needs NCCL >= 2.14's non-blocking mode."""
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(timeout_s)))
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = False
    opts._timeout = datetime.timedelta(seconds=timeout_s + BACKEND_MARGIN_S)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


class _Pg:
    """The communicator behind ``AbortableGroup.pg``: its collectives return ``_Work`` whose
    waits are bounded by the group's timeout."""

    def __init__(self, pg, group: "AbortableGroup"):
        self.raw, self.group = pg, group

    def allreduce(self, tensors, opts):
        return self._issue("all_reduce", lambda pg: pg.allreduce(tensors, opts))

    def broadcast(self, tensors, opts):
        return self._issue("broadcast", lambda pg: pg.broadcast(tensors, opts))

    def _issue(self, op: str, call):
        try:  # a non-blocking NCCL call can fail at once (its communicator's init timed out)
            work = call(self.group.check())
        except CommAborted:
            raise
        except RuntimeError as err:
            self.group.abort(f"{op}: {str(err).splitlines()[0][:200]}")
            raise CommAborted(self.group.error) from err
        return _Work(work, self.group, op)

    def abort(self) -> None:
        self.group.abort("aborted by its owner")

    def __getattr__(self, name):
        return getattr(self.raw, name)


class _Work:
    def __init__(self, work, group: "AbortableGroup", op: str):
        self.work, self.group, self.op = work, group, op
        self.deadline = time.monotonic() + group.timeout_s

    def is_completed(self) -> bool:
        """Done; raises ``CommAborted`` (after aborting the group) once the deadline passed."""
        try:
            if self.work.is_completed():
                return True
        except RuntimeError as err:  # the backend failed it (a peer closed its connection)
            self.group.abort(str(err).splitlines()[0][:200])
            raise CommAborted(self.group.error) from err
        if self.group.error is not None:
            raise CommAborted(self.group.error)
        if time.monotonic() > self.deadline:
            self.group.abort(f"{self.op} of the {self.group.backend} group of {self.group.size} did not complete "
                             f"within its {self.group.timeout_s:g} s timeout (a peer stopped answering)")
            raise CommAborted(self.group.error)
        return False

    def wait(self) -> bool:
        pause = 0.0005
        while not self.is_completed():
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        try:
            return self.work.wait()
        except RuntimeError as err:
            self.group.abort(str(err).splitlines()[0][:200])
            raise CommAborted(self.group.error) from err


class AbortableGroup(comm.StandaloneGroup):
    """``comm.StandaloneGroup`` whose collectives are bounded by ``timeout_s`` (module doc):
    ``comm.group_all_reduce`` / ``group_broadcast`` work on it unchanged."""

    def __init__(self, store, rank: int, size: int, timeout_s: float, device_type: str):
        self.rank, self.size, self.device_type, self.timeout_s = rank, size, device_type, timeout_s
        self.error: str | None = None
        if device_type == "cuda":
            raw, self.backend = _nccl_group(store, rank, size, timeout_s), "nccl"
        else:
            raw = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s + BACKEND_MARGIN_S))
            self.backend = "gloo"
        self._raw = raw
        self.pg = _Pg(raw, self)

    @property
    def pg(self):
        return self._pg

    @pg.setter
    def pg(self, value) -> None:
        """``pg = None`` (``live_watch.destroy``) drops the communicator itself too."""
        self._pg = value
        if value is None:
            self._raw = None

    def check(self):
        """The live communicator; raises ``CommAborted`` once the group was aborted or dropped."""
        if self.error is not None:
            raise CommAborted(f"the {self.backend} group was aborted: {self.error}")
        if self._raw is None:
            raise CommAborted(f"the {self.backend} group was destroyed")
        return self._raw

    def abort(self, why: str = "aborted by its owner") -> None:
        """End the communicator (``ncclCommAbort`` / gloo's pairs closed): in-flight collectives
        fail instead of waiting, later ones raise. Idempotent."""
        if self.error is not None:
            return
        self.error = why
        if self._raw is not None and hasattr(self._raw, "abort"):
            self._raw.abort()

    @property
    def aborted(self) -> bool:
        return self.error is not None
