"""Fault handling around the training step: NaN/Inf guard with rollback, straggler
detection, and collective timeouts that end the job with a named rank and operation.

NaN/Inf guard
    The global gradient norm (already reduced over every rank by the clip) decides: if it
    is not finite, no rank applies the update (all see the same norm, so they agree without
    another collective); the step is logged with ``nonfinite: true``. After
    ``train.nan_guard_rollback`` such steps in a row the trainer goes back to the newest
    good checkpoint (model, optimizer, scheduler, step) but keeps its data position, so the
    batches that blew up are not replayed. It cannot loop: no checkpoint is published while
    the last step is non-finite (the trainer asks ``healthy``), the checkpoint rolled back
    to is pinned against pruning, and the run gives up (``NonFiniteError``, naming the
    rollbacks tried) after ``MAX_ROLLBACKS`` to one checkpoint or ``MAX_TOTAL_ROLLBACKS``.

Straggler detection (C4 / MegaScale style)
    The communication layer (``meshfold.comm.timer()``) stamps every collective that goes
    through it (all of meshfold's: the trainer's reductions, the DDP comm hook, tensor,
    context, expert and pipeline parallel) with the wall-clock time this rank *entered* it;
    nothing patches ``torch.distributed``. Every ``train.straggler_every`` steps the stamps
    of that step are gathered on rank 0 (which judges and reports); for every collective (matched by group and sequence number)
    a rank's lateness is how much later it entered than the earliest rank. The lag a rank
    adds is the sum of the increases of its lateness along each group's sequence (so a late
    rank issuing several back-to-back asynchronous collectives counts once). A rank is
    *late* in a check when its lag exceeds ``train.straggler_margin`` x the median step
    time (and 50 ms); it is *named* (log line, ``straggler`` in ``metrics.jsonl``) only when
    it was late in at least ``PERSIST`` of the last ``WINDOW`` checks, so one scheduler
    hiccup on a shared host is never reported. Time blocked in synchronous collectives is
    reported per rank too (``wait_s``). Collectives torch issues itself (FSDP2's all-gathers
    and reduce-scatters) are not stamped: their lag shows at the next meshfold collective.
    Needs a common clock (one host, or NTP-synchronised hosts: offsets well below the
    margin).

Collective timeout
    Every process group gets ``train.collective_timeout_s`` as its timeout. When a
    collective times out, this rank names itself, the operation in flight (name, ranks,
    caller, from the communication layer's record) and, from a ``monitored_barrier`` on a spare group, which ranks do not respond,
    and raises ``CollectiveTimeoutError``: the CLI prints it and exits non-zero, the
    launcher stops the job. A watchdog thread ends the process with the same kind of message
    if a step outlives the timeout by a wide grace without any timeout firing.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import statistics
import sys
import threading
import time
from collections import defaultdict, deque

import torch.distributed as dist

from meshfold import comm
from meshfold.comm import ledger

MAX_ROLLBACKS = 3  # rollbacks to the same checkpoint before giving up
MAX_TOTAL_ROLLBACKS = 6  # rollbacks in one run (to any checkpoints) before giving up
MIN_LAG_S = 0.05  # lags below this are scheduler/logging noise, never reported
WINDOW, PERSIST = 3, 2  # a rank is named when late in PERSIST of the last WINDOW straggler checks

class CollectiveTimeoutError(RuntimeError):
    """A collective did not finish within ``train.collective_timeout_s``."""


class PeerLostError(RuntimeError):
    """A peer's connection closed in the middle of a collective (the peer died)."""


class NonFiniteError(RuntimeError):
    """Non-finite steps kept coming and there was no checkpoint to roll back to."""


def _log(message: str) -> None:
    print(f"meshfold: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- lag


def straggler_lag(stamps_by_rank: list[list[tuple[tuple, int, float]]]) -> list[float]:
    """Seconds each rank made the others wait: for every group's sequence of collectives,
    the positive increases of the rank's lateness (entry time minus the earliest entry)."""
    entries: dict[tuple, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for rank, stamps in enumerate(stamps_by_rank):
        for group, seq, t in stamps:
            entries[group][seq][rank] = t
    lag = [0.0] * len(stamps_by_rank)
    for by_seq in entries.values():
        previous: dict[int, float] = {}
        for seq in sorted(by_seq):
            times = by_seq[seq]
            if len(times) < 2:
                continue
            first = min(times.values())
            for rank, t in times.items():
                late = t - first
                lag[rank] += max(0.0, late - previous.get(rank, 0.0))
                previous[rank] = late
    return lag


# --------------------------------------------------------------------------- monitor


class FaultMonitor:
    """One per run: wraps each step (``with monitor.step():``), decides whether an
    update may be applied, and runs the straggler check and rollback after the step.
    Explicit inputs (it never sees the Trainer): ``train`` (the config section), this
    rank and the world size, the run's ``Progress`` (read to name steps) and the
    ``checkpointer`` to roll back with (None: no rollback possible). ``collectives_wait``:
    False where collectives return at once (torch's fake process group): nothing to time
    out, so no timeouts, probe group or watchdog."""

    def __init__(self, train, rank: int, world: int, progress, checkpointer=None, collectives_wait: bool = True):
        self.progress, self.checkpointer = progress, checkpointer
        t = train
        self.rank = rank
        self.world = world
        self.rollback_after = t.nan_guard_rollback
        self.every = t.straggler_every
        self.margin = t.straggler_margin
        self.timeout_s = t.collective_timeout_s
        self.broken = False  # set when a collective timed out or a peer was lost: no group teardown at close
        self.nonfinite_in_a_row = 0
        self.skipped_steps = 0
        self.rollbacks: dict[int, int] = defaultdict(int)
        self.rollback_targets: list[int] = []  # every rollback of the run, in order (the give-up line names them)
        self.step_times: list[float] = []
        self.last_report = ""  # the last straggler line logged (rank 0)
        self.metrics: dict = {}  # fields for metrics.jsonl (nonfinite, straggler, rolled_back_to); see pop_metrics
        self.tracker = None
        self._probe_group = None
        self._step_started: float | None = None
        self.late_history: deque[set[int]] = deque(maxlen=WINDOW)
        if self.world > 1 and dist.is_initialized() and collectives_wait:
            self.tracker = comm.timer()
            self._set_timeouts()
            # A spare group for naming unresponsive ranks after a timeout.
            self._probe_group = dist.new_group(backend="gloo",
                                               timeout=datetime.timedelta(seconds=self.timeout_s))
            self._watchdog = threading.Thread(target=self._watch, daemon=True, name="meshfold-watchdog")
            self._stop = threading.Event()
            self._watchdog.start()

    def _set_timeouts(self) -> None:
        from torch.distributed.distributed_c10d import _set_pg_timeout, _world

        timeout = datetime.timedelta(seconds=self.timeout_s)
        for group in list(_world.pg_map):
            try:
                _set_pg_timeout(timeout, group)
            except (ValueError, AssertionError, RuntimeError):
                continue  # a group this rank is not in

    # ------------------------------------------------------------------ NaN guard

    def update_allowed(self, grad_norm) -> bool:
        """False (and logged) when the global gradient norm is not finite."""
        if math.isfinite(float(grad_norm)):
            self.nonfinite_in_a_row = 0
            return True
        self.nonfinite_in_a_row += 1
        self.skipped_steps += 1
        step = self.progress.step + 1
        self.metrics.update(nonfinite=True, skipped_steps=self.skipped_steps)
        if self.rank == 0:
            _log(f"non-finite gradient norm at step {step}: update skipped "
                 f"({self.nonfinite_in_a_row} in a row; rollback after train.nan_guard_rollback = "
                 f"{self.rollback_after})")
        return False

    @property
    def healthy(self) -> bool:
        """False while the last step was non-finite: no checkpoint is published then."""
        return self.nonfinite_in_a_row == 0

    def _maybe_rollback(self) -> None:
        if self.rollback_after <= 0 or self.nonfinite_in_a_row < self.rollback_after:
            return
        step = self.progress.step
        self.nonfinite_in_a_row = 0
        tried = (f" (tried {len(self.rollback_targets)} rollbacks, to steps "
                 f"{', '.join(map(str, self.rollback_targets))}; {self.skipped_steps} updates skipped)"
                 if self.rollback_targets else f" ({self.skipped_steps} updates skipped)")
        if len(self.rollback_targets) >= MAX_TOTAL_ROLLBACKS:
            raise NonFiniteError(
                f"non-finite steps again at step {step} after {MAX_TOTAL_ROLLBACKS} rollbacks{tried}; giving up: "
                f"lower train.lr, raise train.warmup_steps, set train.grad_clip or check the data")
        target = self.checkpointer.rollback() if self.checkpointer is not None else None
        if target is None:
            raise NonFiniteError(
                f"{self.rollback_after} non-finite steps in a row at step {step} and no checkpoint to roll back "
                f"to; set train.checkpoint_every, lower train.lr or raise train.grad_clip{tried}"
            )
        self.rollbacks[target] += 1
        if self.rollbacks[target] > MAX_ROLLBACKS:
            raise NonFiniteError(
                f"rolled back to step {target} {MAX_ROLLBACKS} times and the steps after it keep going "
                f"non-finite; giving up: lower train.lr or check the data{tried}"
            )
        self.rollback_targets.append(target)
        self.metrics["rolled_back_to"] = target
        if self.rank == 0:
            _log(f"{self.rollback_after} non-finite steps in a row: rolled back from step {step} to the "
                 f"checkpoint of step {target} (data continues from where it was)")

    # ------------------------------------------------------------------ step wrapper

    def step(self):
        return _StepScope(self)

    @contextlib.contextmanager
    def boundary(self):
        """The step boundary's collectives (the stop agreement, evaluation, checkpoints): a peer
        lost there is named as in the step (``PeerLostError``), not left as gloo's raw line."""
        try:
            yield
        except RuntimeError as exc:
            if _is_peer_lost(exc) and not isinstance(exc, PeerLostError):
                raise self.peer_lost(exc) from exc
            raise

    def _begin(self) -> None:
        if self.tracker is not None:
            check = self.every > 0 and (self.progress.step + 1) % self.every == 0
            self.tracker.reset(recording=check)
        self._step_started = time.time()

    def _end(self, elapsed: float) -> None:
        self._step_started = None
        self.step_times.append(elapsed)
        if self.tracker is not None and self.tracker.recording:
            self.tracker.recording = False
            self._straggler_check(elapsed)

    def after_step(self) -> None:
        """After the step is logged: roll back if too many non-finite steps in a row."""
        self._maybe_rollback()

    def pop_metrics(self) -> dict:
        """The fields recorded since the last call (the trainer adds them to its step record)."""
        out, self.metrics = self.metrics, {}
        return out

    def persistent(self, late: set[int]) -> list[int]:
        """Record this check's late ranks; name those late now and in at least PERSIST of
        the last WINDOW checks (one hiccup on a shared host is never a straggler)."""
        self.late_history.append(late)
        return [r for r in sorted(late) if sum(r in h for h in self.late_history) >= PERSIST]

    def _straggler_check(self, elapsed: float) -> None:
        mine = (self.tracker.stamps, elapsed, self.tracker.wait_s)
        # to rank 0 only (it judges and reports; metrics.jsonl is its): one gather, not every
        # rank's stamps to every rank
        gathered = comm.gather_object(mine)
        if self.rank != 0:
            ledger().add_sent("fault", len(mine[0]) * 48)
        if gathered is None:
            return
        stamps = [g[0] for g in gathered]
        step_s = [g[1] for g in gathered]
        wait_s = [g[2] for g in gathered]
        lag = straggler_lag(stamps)
        median = statistics.median(step_s)
        late = {r for r, x in enumerate(lag) if x > max(self.margin * median, MIN_LAG_S)}
        slow = self.persistent(late)
        self.metrics["straggler"] = {"ranks": slow, "late": sorted(late), "lag_s": [round(x, 4) for x in lag],
                                     "wait_s": [round(x, 4) for x in wait_s]}
        if slow and self.rank == 0:
            named = ", ".join(f"rank {r} (peers waited {lag[r]:.3f} s for it)" for r in slow)
            self.last_report = (f"straggler at step {self.progress.step}: {named}; more than train.straggler_margin = "
                 f"{self.margin} of the {median:.3f} s step in {PERSIST} of the last {WINDOW} checks. Lag by rank: "
                 f"{[round(x, 3) for x in lag]}; time blocked in collectives by rank: "
                 f"{[round(x, 3) for x in wait_s]}")
            _log(self.last_report)

    # ------------------------------------------------------------------ timeouts

    def _describe(self, err: BaseException | None = None) -> str:
        """The operation that did not finish: the synchronous collective in flight if there
        is one; else the code that was waiting (a collective issued from C++ or an
        asynchronous one), with the last collective this rank issued from Python."""
        t = self.tracker
        if t is not None and t.inflight is not None:
            name, ranks, caller, _ = t.inflight
            return f"collective {name} on ranks {list(ranks)} (called from {caller})"
        where = _innermost_outside_torch(err.__traceback__) if err is not None else "?"
        last = ""
        if t is not None and t.last_issued is not None:
            name, ranks, caller, _ = t.last_issued
            last = f"; the last collective issued from Python was {name} on ranks {list(ranks)} from {caller}"
        return f"a collective waited on in {where} (issued by torch internals or asynchronously){last}"

    def _unresponsive(self) -> str:
        """Ask the spare group who is there: rank 0 hears from everyone that is alive."""
        if self._probe_group is None:
            return "unknown"
        probe = datetime.timedelta(seconds=max(1.0, min(10.0, self.timeout_s / 2)))
        try:
            comm.monitored_barrier(self._probe_group, probe, wait_all_ranks=True)
        except RuntimeError as err:
            found = re.search(r"[Rr]anks? ([\d, ]+) failed", str(err))
            if found:
                return f"rank(s) {found.group(1).strip()} (they did not reach a monitored barrier)"
            return "rank 0 (the monitor did not answer)" if self.rank != 0 else "unknown"
        return "none now (every rank answered the probe: a rank arrived late, or called a different collective)"

    def timed_out(self, err: BaseException) -> CollectiveTimeoutError:
        self.broken = True
        what = self._describe(err)
        missing = self._unresponsive()
        return CollectiveTimeoutError(
            f"rank {self.rank}: a collective did not finish within train.collective_timeout_s = "
            f"{self.timeout_s:g} s at step {self.progress.step + 1}: {what}. Not responding: {missing}. "
            f"Ending the job (backend said: {_first_line(err)})"
        )

    def peer_lost(self, err: BaseException) -> "PeerLostError":
        self.broken = True
        return PeerLostError(
            f"rank {self.rank}: lost the connection to a peer (it crashed or was killed) at step "
            f"{self.progress.step + 1}: {self._describe(err)}. Ending this worker: {after_worker_loss()} "
            f"(backend said: {_first_line(err)})"
        )

    def _watch(self) -> None:
        """Backstop for hangs no timeout catches: end the process with a message."""
        grace = self.timeout_s + max(30.0, self.timeout_s)
        while not self._stop.wait(1.0):
            started = self._step_started
            if started is not None and time.time() - started > grace:
                _log(f"rank {self.rank}: step {self.progress.step + 1} has run {time.time() - started:.0f} s, "
                     f"past train.collective_timeout_s = {self.timeout_s:g} s with no timeout firing; "
                     f"{self._describe()}. Ending the job.")
                os._exit(124)

    def close(self) -> None:
        if self._probe_group is not None:
            self._stop.set()
            if not self.broken:
                dist.destroy_process_group(self._probe_group)
            self._probe_group = None


def job_restart_note(done: int, allowed: int) -> str:
    """What follows a worker's end when its launcher restarts the whole job."""
    if done < allowed:
        return f"the launcher restarts all workers from the last checkpoint (restart {done + 1} of {allowed})"
    return (f"no restart left (--max-restarts {allowed}); run the same command again to resume from the last "
            "checkpoint")


# A feature whose processes restart otherwise (live recovery: one replica group, healed from
# a peer) puts its own note here when it is built (``set_restart_note``).
_restart_note = job_restart_note


def set_restart_note(note) -> None:
    """``note(done, allowed) -> str``: what follows a worker's end, for this process's run."""
    global _restart_note
    _restart_note = note


def after_worker_loss() -> str:
    """What happens once this worker ends, from the launcher's restart count and limit
    (torchrun's agent sets both in every worker's environment)."""
    done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    return _restart_note(done, allowed)


def _first_line(err: BaseException, limit: int = 400) -> str:
    """The backend's first line, whole (a long one cut at a word, never mid-word)."""
    line = (str(err).splitlines() or [type(err).__name__])[0].strip()
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def _innermost_outside_torch(tb) -> str:
    """file:line (function) of the deepest traceback frame outside torch."""
    found = "?"
    while tb is not None:
        code = tb.tb_frame.f_code
        if f"{os.sep}torch{os.sep}" not in code.co_filename and code.co_filename != __file__:
            path = code.co_filename
            short = path.split(f"{os.sep}meshfold{os.sep}", 1)[-1] if "meshfold" in path else os.path.basename(path)
            found = f"{short}:{tb.tb_lineno} ({code.co_name})"
        tb = tb.tb_next
    return found


def _is_peer_lost(err: BaseException) -> bool:
    text = str(err)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


def _is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, getattr(dist, "DistBackendError", ())) or "timed out" in text or "timeout" in text


class _StepScope:
    def __init__(self, monitor: FaultMonitor):
        self.monitor = monitor

    def __enter__(self):
        self.start = time.perf_counter()
        self.monitor._begin()
        return self

    def __exit__(self, exc_type, exc, tb):
        m = self.monitor
        if exc is not None:
            m._step_started = None
            if m.tracker is not None and isinstance(exc, RuntimeError):
                if _is_peer_lost(exc):
                    raise m.peer_lost(exc) from exc
                if _is_timeout(exc):
                    raise m.timed_out(exc) from exc
            return False
        m._end(time.perf_counter() - self.start)
        return False
