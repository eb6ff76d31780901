"""The expert all-to-all's dispatch in fp8 (``parallel.ep_fp8_dispatch``): each row sent to
its experts is cast to e4m3 with a power-of-2 scale of its own, and the rows (1 byte a
value) and their scales (fp32, one per row) travel in two all-to-alls; the receiver
multiplies them back. On gloo, which has no float8 dtype, the rows cross as the same bytes
viewed as uint8 (``comm.gloo_bytes``); NCCL carries float8 itself.

Why it costs the experts no accuracy: their fp8 grouped GEMMs cast the same rows to e4m3
with power-of-2 scales too (``parallel/fp8/experts.py``: per row forward, per column within
each expert's group for the weight gradient; MXFP8: per block of 32). A power-of-2 scale
moves no rounding: each cast rounds a value to e4m3's 4 significant bits wherever the scale
puts it, so a row already on that grid comes through every later cast unchanged, and the
experts compute what they would from the bf16 rows (short of values the casts flush below
e4m3's normal range). The backward exchange (the rows' gradient) and the combine stay in
the compute dtype, as DeepEP's fp8 dispatch does.

Pipelined (``parallel.ep_overlap_chunks`` > 1, ``overlapped_exchange``): each chunk's rows go
the same way, cast with their own per-row scales (``Float8InFlight``): a row's scale depends
on that row alone, so the chunks carry exactly the values the unchunked dispatch does."""

from __future__ import annotations

import torch
from torch import nn

from meshfold.comm import all_to_all_single
from meshfold.parallel.ep.dispatch import AllToAllDispatcher, _a2a_async, _InFlight

E4M3 = torch.float8_e4m3fn


def _exchange(t: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    out = t.new_empty((t.shape[0] if out_splits is None else sum(out_splits),) + tuple(t.shape[1:]))
    all_to_all_single(out, t.contiguous(), group, "ep", out_splits=out_splits, in_splits=in_splits)
    return out


def to_float8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` [n, dim] as e4m3 values and each row's inverse scale [n, 1] (fp32)."""
    from torchao.float8.float8_utils import amax_to_scale  # torchao: only when a run asks for fp8

    x = rows.detach().float()
    scale = amax_to_scale(x.abs().amax(-1, keepdim=True), E4M3, round_scales_to_power_of_2=True)
    return (x * scale).clamp(-448.0, 448.0).to(E4M3), scale.reciprocal()


class Float8Dispatch(torch.autograd.Function):
    """``AllToAll`` with the rows in fp8 forward; the gradient's reverse exchange as it is."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.args = (out_splits, in_splits, group)
        data, inverse = to_float8_rows(rows)
        data, inverse = _exchange(data, out_splits, in_splits, group), _exchange(inverse, out_splits, in_splits, group)
        return (data.float() * inverse).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.args
        return _exchange(grad, in_splits, out_splits, group), None, None, None


class Float8InFlight(_InFlight):
    """One chunk's dispatch in flight in fp8: its e4m3 rows and their scales in two
    asynchronous all-to-alls (started by ``begin``, the rows multiplied back by ``end`` once
    both arrived). The gradient goes back in the compute dtype (``_InFlight``'s backward)."""

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        self.pending = [_a2a_async(t, self.out_splits, self.in_splits, self.group) for t in to_float8_rows(x)]
        return x.new_empty(self.pending[0][0].shape)  # the rows' place in the compute dtype

    def end(self, out: torch.Tensor) -> torch.Tensor:
        (data, data_work), (inverse, inverse_work) = self.pending
        self.pending = None
        data_work.wait()
        inverse_work.wait()
        return out.copy_(data.float() * inverse).view_as(out)


def apply_fp8_dispatch(model: nn.Module, parallel) -> None:
    """Every expert-parallel dispatcher sends its rows in fp8 (``parallel.ep_fp8_dispatch``)."""
    if not parallel.ep_fp8_dispatch:
        return
    for module in model.modules():
        if isinstance(module, AllToAllDispatcher):
            module.send_rows = Float8Dispatch.apply
            module.dispatch_flight = Float8InFlight
