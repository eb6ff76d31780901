"""The one communication layer: every collective and point-to-point exchange in meshfold.

Parallel code never calls ``torch.distributed`` collectives or p2p directly; it calls these
functions, which keep NCCL's rules whatever the backend:

- every tensor handed over lives on the compute device (a host tensor reaching a device
  collective, or a tensor created on the ``meta`` device by mistake, is a clear error here);
- point-to-point messages carry no tags: they match in issue order per peer pair, as NCCL
  matches them, so code that is correct here is correct on NCCL;
- paired sends and receives are posted together (``exchange``: one ``batch_isend_irecv``),
  so two neighbours that both send first cannot deadlock.

The layer is also the one place that counts traffic: every call names the mesh dimension
it runs over and records, in the per-step ledger, the bytes this rank sends; and the one
place that times collectives (``timer()``: the call in flight for timeout messages, entry
stamps for straggler detection), so nothing patches ``torch.distributed``.

Strict mode (``MESHFOLD_STRICT=1``, set for the whole test suite by ``tests/conftest.py``)
makes gloo fail where NCCL would although the tests compute on the host: inside
``strict_scope()`` (the trainer's step and evaluation) every tensor created without
``device=`` is marked as a host tensor and the mark follows it through every operation
until it is moved with ``.to(device)``; a marked tensor reaching this layer is a
``CommError`` naming the call. Tagged point-to-point calls are refused outright
(``install_strict_p2p_guard``). docs/communication.md has the rules and the mechanism.

A call may pass ``dim=None`` for a control scalar (the trainer's token count and loss sum:
8 bytes each per step), which is checked and timed but not counted as traffic, as the
planner's model does not count it either.

Byte convention (the same the planner's alpha-beta model uses): bytes a rank sends under
the bandwidth-optimal ring algorithm, ``meshfold/ring.py``'s ``FACTORS`` (all-reduce
2 (n-1)/n of the size, all-gather, reduce-scatter, all-to-all and broadcast (n-1)/n,
send the size).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from meshfold.ring import FACTORS

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG if hasattr(dist.ReduceOp, "AVG") else None}


class CommError(RuntimeError):
    """A tensor or call that would break on NCCL (host tensor, meta tensor, bad peer)."""


class CommLedger:
    """Bytes this rank sent, per mesh dimension: this step's and the run's; and how many
    calls carried them this step (``step_calls``: one per collective or per send)."""

    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)
        self.step_calls: dict[str, int] = defaultdict(int)

    def record(self, dim: str | None, op: str, size_bytes: float, group_size: int) -> None:
        if dim is None or group_size <= 1 or size_bytes <= 0:  # None: a control scalar, not traffic
            return
        self.add_sent(dim, FACTORS[op](group_size) * size_bytes)

    def add_sent(self, dim: str, sent_bytes: float) -> None:
        """Record bytes already known to be sent (point-to-point, variable all-to-all)."""
        self.step[dim] += sent_bytes
        self.total[dim] += sent_bytes
        self.step_calls[dim] += 1

    def pop_step(self) -> dict[str, int]:
        out = {k: int(round(v)) for k, v in sorted(self.step.items())}
        self.step.clear()
        self.step_calls.clear()
        return out

    def pop_step_collectives(self) -> dict[str, dict[str, int]]:
        """This step's ``{dim: {"count", "bytes"}}``, then a new step."""
        out = {k: {"count": self.step_calls[k], "bytes": int(round(v))} for k, v in sorted(self.step.items())}
        self.pop_step()
        return out


_LEDGER = CommLedger()


def ledger() -> CommLedger:
    """The process-wide ledger (one training job per process)."""
    return _LEDGER


def reset_ledger() -> CommLedger:
    global _LEDGER
    _LEDGER = CommLedger()
    return _LEDGER


# ---------------------------------------------------------------------------- strict mode


def strict() -> bool:
    """Strict mode: gloo made to fail where NCCL would (``MESHFOLD_STRICT=1``)."""
    return os.environ.get("MESHFOLD_STRICT", "") not in ("", "0")


_HOST_MARK = "_meshfold_host"
# Factories that put their result on the default device (the host) unless given ``device=``.
_FACTORIES = frozenset(f for f in (
    torch.tensor, torch.as_tensor, torch.from_numpy, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.empty_strided, torch.scalar_tensor, torch.tril_indices, torch.triu_indices)
    if f is not None)
# Always host, and invisible to function modes (they take no tensor): wrapped while a
# HostTensorMode is active.
_HOST_ONLY = ("from_numpy", "frombuffer")


def is_host_marked(t) -> bool:
    if torch.compiler.is_compiling():  # (a traced tensor has no such attribute; strict mode checks eager runs)
        return False
    return isinstance(t, torch.Tensor) and t.__dict__.get(_HOST_MARK, False)


def _mark(out) -> None:
    if isinstance(out, torch.Tensor):
        out.__dict__[_HOST_MARK] = True
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                o.__dict__[_HOST_MARK] = True


def _tensors_in(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _target_device(args, kwargs):
    """The device a ``Tensor.to`` call moves to, or None for a dtype-only cast."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class HostTensorMode(TorchFunctionMode):
    """Marks tensors that would be on the host on a GPU run, whatever the device here.

    A tensor made by a factory without ``device=`` is marked; an operation whose tensor
    inputs are all marked gives marked results (mixed with a device tensor, CUDA either
    computes on the device, for a host scalar, or refuses) (``x * 2``, ``torch.cat``,
    ``.double()``, ``.detach()``...); ``.cpu()`` marks a copy; ``.to(device)`` returns an
    unmarked copy, as a move to the GPU would. In-place operations keep their target's
    state. ``check_tensors`` refuses marked tensors. ``torch.from_numpy``/``frombuffer``,
    which function modes do not see, are wrapped to mark their result while it is active."""

    def __enter__(self):
        self._saved = {}
        for name in _HOST_ONLY:
            fn = getattr(torch, name, None)
            if fn is not None and not getattr(fn, "_meshfold_marks", False):
                self._saved[name] = fn
                setattr(torch, name, _marking(fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch, name, fn)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES:
            out = func(*args, **kwargs)
            if kwargs.get("device") is None:
                _mark(out)
            return out
        if func is torch.Tensor.to and is_host_marked(args[0]) and _target_device(args, kwargs) is not None:
            return func(*args, **{**kwargs, "copy": True})  # a move makes a new tensor on the GPU
        if func is torch.Tensor.cpu:
            out = func(*args, **kwargs)
            out = out.clone() if out is args[0] else out
            _mark(out)
            return out
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if "out" in kwargs or name == "__setitem__" or name.startswith("__i") or (
                name.endswith("_") and not name.endswith("__")):
            return out  # in place: the target keeps its device
        marked = unmarked = False
        for t in _tensors_in(args, kwargs):
            if is_host_marked(t):
                marked = True
            else:
                unmarked = True
        if marked and not unmarked and out is not None:
            _mark(out)
        return out


def _marking(fn):
    @functools.wraps(fn)
    def marked(*args, **kwargs):
        out = fn(*args, **kwargs)
        _mark(out)
        return out

    marked._meshfold_marks = True
    return marked


def strict_scope(enabled: bool = True):
    """Where a step runs: in strict mode, tensors created without ``device=`` are tracked
    as host tensors (``HostTensorMode``); otherwise nothing."""
    if not (enabled and strict()):
        return contextlib.nullcontext()
    return HostTensorMode()


def install_strict_p2p_guard() -> None:
    """Strict mode: refuse tagged ``torch.distributed`` point-to-point calls (NCCL ignores
    tags, so code whose matching depends on them is wrong there). A test-harness guard
    installed by the strict pool workers and the launcher, never in normal runs."""
    from torch.distributed import distributed_c10d as c10d

    for name in ("send", "recv", "isend", "irecv"):
        fn = getattr(c10d, name)
        if getattr(fn, "_meshfold_strict", False):
            continue

        def guarded(*args, _fn=fn, _name=name, **kwargs):
            tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
            if tag:
                raise CommError(f"strict mode: {_name}(tag={tag}) from {_caller()}: NCCL ignores tags and "
                                "matches messages in issue order per peer pair; use meshfold.comm.exchange")
            return _fn(*args, **kwargs)

        guarded = functools.wraps(fn)(guarded)
        guarded._meshfold_strict = True
        setattr(c10d, name, guarded)
        setattr(dist, name, guarded)


# ---------------------------------------------------------------------------- checks


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_device_type(group) -> str:
    """'cuda' for an NCCL group, 'cpu' for gloo."""
    backend = dist.get_backend(group)
    return "cuda" if "nccl" in str(backend).lower() else "cpu"


# The CUDA dry-run's recorder (meshfold/gpucheck.py): told of every call with its tensors
# and mesh dimension; None otherwise.
_OBSERVER = None


def set_observer(observer) -> None:
    global _OBSERVER
    _OBSERVER = observer


def _observed(op: str, tensors, group, dim):
    if _OBSERVER is None:
        return contextlib.nullcontext()
    return _OBSERVER.comm_call(op, tensors, group, dim)


def check_tensors(tensors: Sequence[torch.Tensor], group, what: str) -> None:
    """Every tensor must live where the group's backend computes (NCCL: the GPU)."""
    _check_device(tensors, _group_device_type(group), str(dist.get_backend(group)), what)


def _check_device(tensors: Sequence[torch.Tensor], expected: str, backend: str, what: str) -> None:
    for t in tensors:
        if t.device.type == "meta":
            raise CommError(f"{what}: a tensor on the meta device reached a collective; it was "
                            "created without device= (create it on the compute device)")
        if t.device.type != expected:
            raise CommError(f"{what}: tensor on {t.device} handed to a {backend} "
                            f"group, which needs {expected} tensors; create it on the compute device")
        if is_host_marked(t) and _OBSERVER is not None:  # the CUDA dry-run records it and goes on
            _OBSERVER.host_in_collective(what, t)
        elif is_host_marked(t):
            raise CommError(f"{what} called from {_caller()}: strict mode: a host tensor (created without "
                            f"device=, or derived only from such tensors) reached a collective; NCCL refuses "
                            f"it. Create it with device= the compute device or move it with .to(device)")


def _size(group) -> int:
    return dist.get_world_size(group)


# ---------------------------------------------------------------------------- timing


def _caller() -> str:
    """file:line (function) of the nearest caller outside this module and torch."""
    frame = sys._getframe(1)
    skip = (__file__, contextlib.__file__)
    while frame is not None and (frame.f_code.co_filename in skip
                                 or f"{os.sep}torch{os.sep}" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    short = path.split(f"{os.sep}meshfold{os.sep}", 1)[-1] if "meshfold" in path else os.path.basename(path)
    return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"


class CommTimer:
    """What this process's collectives are doing: the synchronous call in flight and the
    last one issued (for timeout messages), and while ``recording`` each collective's
    (group ranks, sequence number in that group, wall-clock entry time) and the time spent
    blocked in synchronous calls, for straggler detection (train/fault.py)."""

    def __init__(self):
        self.inflight: tuple[str, tuple, str, float] | None = None
        self.last_issued: tuple[str, tuple, str, float] | None = None
        self.recording = False
        self.stamps: list[tuple[tuple, int, float]] = []
        self.seq: dict[tuple, int] = defaultdict(int)
        self.wait_s = 0.0
        self._ranks: dict[int, tuple] = {}

    def reset(self, recording: bool) -> None:
        self.recording = recording
        self.inflight = None
        self.stamps, self.seq, self.wait_s = [], defaultdict(int), 0.0

    def ranks_of(self, group) -> tuple:
        if group is None:
            return ("world",)
        key = id(group)
        if key not in self._ranks:
            try:
                self._ranks[key] = (group, tuple(dist.get_process_group_ranks(group)))
            except Exception:  # noqa: BLE001 - e.g. a rank outside the group
                self._ranks[key] = (group, ("?",))
        return self._ranks[key][1]

    @contextlib.contextmanager
    def call(self, name: str, group, async_op: bool, collective: bool = True):
        """Around one call. Collectives (every rank of the group calls them in the same
        order) are stamped; point-to-point only named. An exception leaves ``inflight``
        naming the call."""
        ranks = self.ranks_of(group)
        start = time.time()
        op = (name, ranks, _caller(), start)
        self.last_issued = op
        if self.recording and collective:
            self.seq[ranks] += 1
            self.stamps.append((ranks, self.seq[ranks], start))
        if async_op:
            yield
            return
        self.inflight = op
        yield
        self.inflight = None
        self.wait_s += time.time() - start


_TIMER = CommTimer()


def timer() -> CommTimer:
    """The process-wide collective timer."""
    return _TIMER


class _TimedWork:
    """An asynchronous work whose ``wait`` is timed and named like a synchronous call, and
    safe to wait on twice (a gloo receive waited on again would wait for a new message)."""

    def __init__(self, work, name: str, group):
        self.work, self.name, self.group = work, name, group
        self.done = False

    def wait(self, *args, **kwargs):
        if self.done:
            return True
        with _TIMER.call(f"wait({self.name})", self.group, async_op=False, collective=False):
            out = self.work.wait(*args, **kwargs)
        self.done = True
        return out

    def __getattr__(self, attr):
        return getattr(self.work, attr)


# ---------------------------------------------------------------------------- collectives


def all_reduce(t: torch.Tensor, group, dim: str, op: str = "sum", async_op: bool = False):
    check_tensors([t], group, "all_reduce")
    ledger().record(dim, "all_reduce", _nbytes(t), _size(group))
    with _TIMER.call("all_reduce", group, async_op), _observed("all_reduce", [t], group, dim):
        return dist.all_reduce(t, op=_OPS[op], group=group, async_op=async_op)


_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))


def gloo_bytes(t: torch.Tensor, group) -> torch.Tensor:
    """gloo has no float8 dtypes: a float8 tensor travels as the same bytes viewed as uint8.
    Only on gloo: NCCL has the dtypes (and the observer sees the float8 tensor either way)."""
    if t.dtype in _FLOAT8 and _group_device_type(group) == "cpu":
        return t.view(torch.uint8)
    return t


def _tensor_collective(name: str, before: str):
    """torch's one-tensor collective by its current name (torch 2.13 renamed
    ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single`` and warns on the old
    names once per process), or the old name on a torch that predates it. Looked up at each
    call, so a test's spy on ``torch.distributed`` sees it."""
    return getattr(dist, name, None) or getattr(dist, before)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group, dim: str, async_op: bool = False):
    """Concatenate every rank's ``t`` along dim 0 into ``out``."""
    check_tensors([out, t], group, "all_gather")
    ledger().record(dim, "all_gather", _nbytes(out), _size(group))
    with _TIMER.call("all_gather_into_tensor", group, async_op), _observed("all_gather", [t, out], group, dim):
        return _tensor_collective("all_gather_single", "all_gather_into_tensor")(
            gloo_bytes(out, group), gloo_bytes(t, group), group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group, dim: str, op: str = "sum",
                          async_op: bool = False):
    check_tensors([out, t], group, "reduce_scatter")
    ledger().record(dim, "reduce_scatter", _nbytes(t), _size(group))
    with _TIMER.call("reduce_scatter_tensor", group, async_op), _observed("reduce_scatter", [t, out], group, dim):
        return _tensor_collective("reduce_scatter_single", "reduce_scatter_tensor")(
            out, t, op=_OPS[op], group=group, async_op=async_op)


def all_to_all_single(out: torch.Tensor, t: torch.Tensor, group, dim: str,
                      out_splits: list[int] | None = None, in_splits: list[int] | None = None,
                      async_op: bool = False):
    """Uniform (splits None) or variable all-to-all along dim 0; counts the bytes leaving."""
    check_tensors([out, t], group, "all_to_all")
    n = _size(group)
    if in_splits is None:
        ledger().record(dim, "all_to_all", _nbytes(t), n)
    else:
        row = _nbytes(t) // max(t.shape[0], 1) if t.dim() else t.element_size()
        ledger().add_sent(dim, (sum(in_splits) - in_splits[dist.get_rank(group)]) * row)
    with _TIMER.call("all_to_all_single", group, async_op), _observed("all_to_all", [t, out], group, dim):
        work = dist.all_to_all_single(out, t, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=group, async_op=async_op)
    # async: its wait() is timed (time blocked on it) and named like a synchronous call
    return _TimedWork(work, "all_to_all_single", group) if async_op and work is not None else work


def broadcast(t: torch.Tensor, src_group_rank: int, group, dim: str, async_op: bool = False):
    check_tensors([t], group, "broadcast")
    ledger().record(dim, "broadcast", _nbytes(t), _size(group))
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank
    with _TIMER.call("broadcast", group, async_op), _observed("broadcast", [t], group, dim):
        return dist.broadcast(t, src=src, group=group, async_op=async_op)


def barrier(group=None) -> None:
    """Only outside the step's hot path (start-up, checkpoints, shut-down)."""
    with _TIMER.call("barrier", group, async_op=False):
        dist.barrier(group=group)


def monitored_barrier(group, timeout, wait_all_ranks: bool = True) -> None:
    """gloo's barrier that names the ranks that did not arrive (fault diagnosis only)."""
    dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


# Object collectives pickle Python objects through host memory: start-up, metrics and
# test inspection only, never a step's tensors.


def all_gather_object(obj, group=None, dim: str = "meta") -> list:
    """Every rank's ``obj``, in group rank order."""
    out = [None] * dist.get_world_size(group)
    with _TIMER.call("all_gather_object", group, async_op=False):
        dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj, group=None, dst_group_rank: int = 0) -> list | None:
    """Every rank's ``obj`` on group rank ``dst_group_rank`` (None elsewhere)."""
    me = dist.get_rank(group)
    out = [None] * dist.get_world_size(group) if me == dst_group_rank else None
    with _TIMER.call("gather_object", group, async_op=False):
        dist.gather_object(obj, out, group=group, group_dst=dst_group_rank)
    return out


def broadcast_object(obj, src_group_rank: int = 0, group=None):
    """``obj`` of group rank ``src_group_rank``, on every rank."""
    box = [obj]
    with _TIMER.call("broadcast_object_list", group, async_op=False):
        dist.broadcast_object_list(box, group=group, group_src=src_group_rank)
    return box[0]


# ---------------------------------------------------------------------------- point to point


def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             group, dim: str) -> list:
    """Post paired sends and receives together; peers are ranks *within* ``group``.

    No tags: messages between two ranks match in the order they are issued, as on NCCL.
    All operations go out in one ``batch_isend_irecv``, so a ring or a pipeline whose
    neighbours both send first cannot deadlock. Returns the works to ``wait()`` on."""
    if not sends and not recvs:
        return []
    check_tensors([t for t, _ in sends] + [t for t, _ in recvs], group, "exchange")
    ops = []
    for t, peer in sends:
        ledger().add_sent(dim, _nbytes(t))
        ops.append(dist.P2POp(dist.distributed_c10d.isend, t, dist.get_global_rank(group, peer), group))
    for t, peer in recvs:
        ops.append(dist.P2POp(dist.distributed_c10d.irecv, t, dist.get_global_rank(group, peer), group))
    with _TIMER.call("exchange", group, async_op=True, collective=False), \
            _observed("exchange", [t for t, _ in sends] + [t for t, _ in recvs], group, dim):
        works = dist.batch_isend_irecv(ops)
    return [_TimedWork(w, "exchange", group) for w in works]


def wait_all(works: Sequence) -> None:
    for w in works:
        w.wait()


# ---------------------------------------------------------------------------- standalone groups
# Live recovery (train/live.py) links rank j of every replica group in a group of its own,
# outside the default world (each replica group is a world of its own, restarted alone),
# rebuilt from a shared store whenever the quorum changes. Same rules: device tensors,
# counted bytes, timed calls.


class StandaloneGroup:
    """A process group over ``size`` ranks met through ``store`` (NCCL for cuda, gloo for cpu)."""

    def __init__(self, store, rank: int, size: int, timeout_s: float, device_type: str):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size, self.device_type = rank, size, device_type
        if device_type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.backend = "nccl" if device_type == "cuda" else "gloo"

    def abort(self) -> None:
        """After a member died: NCCL must be aborted (its kernels would wait forever); gloo's
        pairs are closed with the object."""
        if self.backend == "nccl" and hasattr(self.pg, "abort"):
            self.pg.abort()


def group_all_reduce(t: torch.Tensor, group: StandaloneGroup, dim: str | None, op: str = "sum") -> None:
    _check_device([t], group.device_type, group.backend, "all_reduce")
    ledger().record(dim, "all_reduce", _nbytes(t), group.size)
    opts = dist.AllreduceOptions()
    opts.reduceOp = _OPS[op]
    with _TIMER.call("all_reduce(standalone)", None, async_op=False):
        group.pg.allreduce([t], opts).wait()


def group_broadcast(t: torch.Tensor, src: int, group: StandaloneGroup, dim: str | None) -> None:
    _check_device([t], group.device_type, group.backend, "broadcast")
    ledger().record(dim, "broadcast", _nbytes(t), group.size)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    with _TIMER.call("broadcast(standalone)", None, async_op=False):
        group.pg.broadcast([t], opts).wait()
