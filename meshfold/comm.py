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
it runs over and records, in the per-step ledger, the bytes this rank sends.

Byte convention (the same the planner's alpha-beta model uses): bytes a rank sends under
the bandwidth-optimal ring algorithm for each collective over a group of n ranks holding
``size`` bytes in total (all-reduce, all-gather output, reduce-scatter input):

    all-reduce      2 (n-1)/n * size
    all-gather        (n-1)/n * size
    reduce-scatter    (n-1)/n * size
    all-to-all        (n-1)/n * size   (uniform splits; variable splits: the bytes leaving)
    broadcast         (n-1)/n * size
    send              size
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
           "send": lambda n: 1.0, "broadcast": lambda n: (n - 1) / n}

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG if hasattr(dist.ReduceOp, "AVG") else None}


class CommError(RuntimeError):
    """A tensor or call that would break on NCCL (host tensor, meta tensor, bad peer)."""


class CommLedger:
    """Bytes this rank sent, per mesh dimension: this step's and the run's."""

    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)

    def record(self, dim: str, op: str, size_bytes: float, group_size: int) -> None:
        if group_size <= 1 or size_bytes <= 0:
            return
        self.add_sent(dim, FACTORS[op](group_size) * size_bytes)

    def add_sent(self, dim: str, sent_bytes: float) -> None:
        """Record bytes already known to be sent (point-to-point, variable all-to-all)."""
        self.step[dim] += sent_bytes
        self.total[dim] += sent_bytes

    def pop_step(self) -> dict[str, int]:
        out = {k: int(round(v)) for k, v in sorted(self.step.items())}
        self.step.clear()
        return out


_LEDGER = CommLedger()


def ledger() -> CommLedger:
    """The process-wide ledger (one training job per process)."""
    return _LEDGER


def reset_ledger() -> CommLedger:
    global _LEDGER
    _LEDGER = CommLedger()
    return _LEDGER


# ---------------------------------------------------------------------------- checks


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_device_type(group) -> str:
    """'cuda' for an NCCL group, 'cpu' for gloo."""
    backend = dist.get_backend(group)
    return "cuda" if "nccl" in str(backend).lower() else "cpu"


def check_tensors(tensors: Sequence[torch.Tensor], group, what: str) -> None:
    """Every tensor must live where the group's backend computes (NCCL: the GPU)."""
    expected = _group_device_type(group)
    for t in tensors:
        if t.device.type == "meta":
            raise CommError(f"{what}: a tensor on the meta device reached a collective; it was "
                            "created without device= (create it on the compute device)")
        if t.device.type != expected:
            raise CommError(f"{what}: tensor on {t.device} handed to a {dist.get_backend(group)} "
                            f"group, which needs {expected} tensors; create it on the compute device")


def _size(group) -> int:
    return dist.get_world_size(group)


# ---------------------------------------------------------------------------- collectives


def all_reduce(t: torch.Tensor, group, dim: str, op: str = "sum", async_op: bool = False):
    check_tensors([t], group, "all_reduce")
    ledger().record(dim, "all_reduce", _nbytes(t), _size(group))
    return dist.all_reduce(t, op=_OPS[op], group=group, async_op=async_op)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group, dim: str, async_op: bool = False):
    """Concatenate every rank's ``t`` along dim 0 into ``out``."""
    check_tensors([out, t], group, "all_gather")
    ledger().record(dim, "all_gather", _nbytes(out), _size(group))
    return dist.all_gather_into_tensor(out, t, group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group, dim: str, op: str = "sum",
                          async_op: bool = False):
    check_tensors([out, t], group, "reduce_scatter")
    ledger().record(dim, "reduce_scatter", _nbytes(t), _size(group))
    return dist.reduce_scatter_tensor(out, t, op=_OPS[op], group=group, async_op=async_op)


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
    return dist.all_to_all_single(out, t, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src_group_rank: int, group, dim: str, async_op: bool = False):
    check_tensors([t], group, "broadcast")
    ledger().record(dim, "broadcast", _nbytes(t), _size(group))
    return dist.broadcast(t, src=dist.get_global_rank(group, src_group_rank), group=group, async_op=async_op)


def barrier(group=None) -> None:
    """Only outside the step's hot path (start-up, checkpoints, shut-down)."""
    dist.barrier(group=group)


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
        # c10d's own isend/irecv: P2POp refuses the wrappers train/fault.py installs on dist.*
        ops.append(dist.P2POp(dist.distributed_c10d.isend, t, dist.get_global_rank(group, peer), group))
    for t, peer in recvs:
        ops.append(dist.P2POp(dist.distributed_c10d.irecv, t, dist.get_global_rank(group, peer), group))
    return dist.batch_isend_irecv(ops)


def wait_all(works: Sequence) -> None:
    for w in works:
        w.wait()
