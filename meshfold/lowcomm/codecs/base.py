"""What every gradient codec shares: the ``Codec`` base (per-tensor state, the async
reduce a DDP hook returns, checkpoint state) and the helpers the families use (group size,
work precision, a counted mean all-reduce).

Every buffer a codec creates is on the device of the tensor being coded (``device=``), and
the arithmetic runs there in the tensor's own precision (at least fp32): no host round
trip, no float64 on the CPU. Only the optional deflate coding (``fp4.py``) is host work by
nature."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshfold import comm


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision the codecs compute in: the tensor's own, raised to fp32 for bf16/fp16."""
    return torch.promote_types(dtype, torch.float32)


def all_reduce_mean(t: torch.Tensor, group, dim: str = "dp") -> torch.Tensor:
    n = group_size(group)
    if n > 1:
        comm.all_reduce(t, group, dim)
        t.div_(n)
    return t


class Codec:
    """Base: ``reduce(named)`` turns each local gradient into the group mean of what the
    codec transmits. ``state`` maps names to error-feedback (and other) buffers.

    ``reduce_async(named)`` returns a ``torch.futures.Future`` completed once the gradients
    hold the mean (what a DDP communication hook returns); the base class reduces at once."""

    def __init__(self, group):
        self.group = group
        self.n = group_size(group)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.step = 0

    @classmethod
    def from_config(cls, group, lc, seed: int = 0) -> Codec:
        """The codec ``lowcomm.compression`` names, built from its ``[lowcomm]`` keys."""
        raise NotImplementedError

    def step_begin(self) -> None:
        """Call once per optimizer step, before the step's ``reduce`` calls."""
        self.step += 1

    def reduce(self, named: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def reduce_async(self, named: list[tuple[str, torch.Tensor]]) -> torch.futures.Future:
        self.reduce(named)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def wait(self) -> None:
        """Block until every reduction handed to ``reduce_async`` has finished."""

    def state_dict(self) -> dict:
        self.wait()
        return {"step": self.step, "state": {k: {n: t.clone() for n, t in v.items()} for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        self.state = {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()}

    def _buf(self, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
        slot = self.state.setdefault(name, {})
        if key not in slot:
            slot[key] = torch.zeros_like(like)
        return slot[key]

