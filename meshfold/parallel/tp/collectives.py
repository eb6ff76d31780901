"""The tensor-parallel group and its collectives: Megatron's conjugate operators as explicit
autograd functions (``f``/``g`` without sequence parallel, all-gather/reduce-scatter of the
sequence with it), the token gathers expert parallel uses, and the sequence-parallel
column-parallel linear that gathers its input again in backward. Every collective is
recorded in the comm ledger under ``"tp"``; under bf16 autocast activations cross the link
in bf16 (``wire_dtype``). The layout they serve is in ``parallel/tp/plan.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshfold import comm
from meshfold.mesh import ParallelDims

SEQ_DIM = 1  # activations are [batch, seq, ...]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The rank's local piece of a (possibly DTensor) parameter; autograd flows through."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t


@dataclass
class TensorParallelGroup:
    """The ``tp`` process group plus the collectives the layers need (each one recorded)."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    sp: bool

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> "TensorParallelGroup":
        return cls(dims["tp"], dims.group("tp"), dims.size("tp"), dims.rank("tp"), dims.parallel.sp)

    # -- raw collectives (no autograd)
    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        comm.all_reduce(t, self.group, "tp", op=op)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.movedim(dim, 0).contiguous()
        out = t.new_empty((self.size * t.shape[0],) + t.shape[1:])
        comm.all_gather_into_tensor(out, t, self.group, "tp")
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.movedim(dim, 0).contiguous()
        out = t.new_empty((t.shape[0] // self.size,) + t.shape[1:])
        comm.reduce_scatter_tensor(out, t, self.group, "tp")
        return out.movedim(0, dim).contiguous()

    # -- Megatron's conjugate operators (autograd)
    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel region: f (no sp) or all-gather of the sequence (sp).
        Under autocast the collective carries the compute dtype (``wire_dtype``)."""
        return _GatherSeq.apply(x, self) if self.sp else _CopyToTP.apply(x, self, wire_dtype(x))

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel region: all-reduce (no sp) or reduce-scatter of the sequence.
        Under autocast the collective carries the compute dtype (``wire_dtype``)."""
        return _ScatterSeq.apply(x, self) if self.sp else _ReduceFromTP.apply(x, self)

    def gather_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Rows (dim 0) of every tp rank, rank-major: all-gather forward, reduce-scatter
        backward; in the wire dtype."""
        return _GatherTokens.apply(t, self, wire_dtype(t))

    def scatter_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over tp of rank-major rows, each rank keeping its own (``gather_tokens``'s
        conjugate): reduce-scatter forward, all-gather backward, in the wire dtype."""
        return _ScatterTokens.apply(t, self)

    def grad_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Identity forward; the gradient is summed over tp ranks in backward, in its own
        dtype (a replicated parameter's gradient: fp32 under bf16 autocast)."""
        return _CopyToTP.apply(t, self, None)

    def replicated(self, p: torch.Tensor | None) -> torch.Tensor | None:
        """A replicated parameter used on this rank's activations: with sp they hold only a
        slice of the sequence, so the weight gradient is a partial sum to add over tp."""
        if p is None:
            return None
        t = local(p)
        return self.grad_sum(t) if self.sp else t


def wire_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype an activation (or its gradient) crosses the tp link in: under autocast the
    compute dtype, when ``x`` is a wider floating-point tensor (the fp32 residual stream and
    norm outputs of ``train.dtype = bfloat16``); None (as it is) otherwise. Megatron-LM's tp
    and sp collectives carry bf16 activations, and pipeline parallel's sends here do too
    (``PipelineRunner.wire_dtype``). Without autocast (float32, float64) nothing changes."""
    device = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(device):
        return None
    cast = torch.get_autocast_dtype(device)
    return cast if cast != x.dtype else None


def _to_wire(t: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """``t`` as the collective's input: a fresh contiguous tensor (collectives work in place)."""
    return t.contiguous().clone() if wire is None or t.dtype == wire else t.to(wire).contiguous()


def _on_wire(t: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """``t`` in the wire dtype (the collective helpers copy it as they need)."""
    return t if wire is None or t.dtype == wire else t.to(wire)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (in ``wire`` dtype, then the gradient's)."""

    @staticmethod
    def forward(ctx, x, tp, wire):
        ctx.tp, ctx.wire = tp, wire
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce_(_to_wire(grad, ctx.wire)).to(grad.dtype), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (in the wire dtype, then the input's), identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce_(_to_wire(x, wire_dtype(x))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (both in the wire dtype)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.wire = tp, wire_dtype(x)
        return tp.all_gather(_on_wire(x, ctx.wire), SEQ_DIM).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(_on_wire(grad, ctx.wire), SEQ_DIM).to(grad.dtype), None


class _ScatterSeq(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (both in the wire dtype)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.wire = tp, wire_dtype(x)
        return tp.reduce_scatter(_on_wire(x, ctx.wire), SEQ_DIM).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(_on_wire(grad, ctx.wire), SEQ_DIM).to(grad.dtype), None


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter backward (both in ``wire`` dtype, if any)."""

    @staticmethod
    def forward(ctx, x, tp, wire):
        ctx.tp, ctx.wire = tp, wire
        return tp.all_gather(_on_wire(x, wire), 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(_on_wire(grad, ctx.wire), 0).to(grad.dtype), None, None


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter along dim 0 forward, all-gather backward (both in the wire dtype)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.wire = tp, wire_dtype(x)
        return tp.reduce_scatter(_on_wire(x, ctx.wire), 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(_on_wire(grad, ctx.wire), 0).to(grad.dtype), None


class _GatheredLinears(torch.autograd.Function):
    """Sequence parallel entry fused with the column-parallel linears it feeds:
    ``[F.linear(all_gather(x), w_i, b_i)]``, saving only the local sequence slice of ``x``
    and gathering it again in backward (Megatron-LM's sequence-parallel linear), so the
    gathered [b, s, d] input is never kept alive between forward and backward."""

    @staticmethod
    def forward(ctx, x, tp, n, *weights_biases):
        weights, biases = weights_biases[:n], weights_biases[n:]
        device = x.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.dtypes = (x.dtype, [w.dtype for w in weights], [None if b is None else b.dtype for b in biases])
        if cast is not None:
            x = x.to(cast)
            weights = [w.to(cast) for w in weights]
            biases = [None if b is None else b.to(cast) for b in biases]
        with torch.autocast(device, enabled=False):
            full = tp.all_gather(x, SEQ_DIM)
            outs = tuple(F.linear(full, w, b) for w, b in zip(weights, biases))
        ctx.tp, ctx.n, ctx.has_bias = tp, n, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        tp = ctx.tp
        full = tp.all_gather(x, SEQ_DIM).flatten(0, -2)
        x_dtype, w_dtypes, b_dtypes = ctx.dtypes
        grad_full = None
        grad_ws, grad_bs = [], []
        for g, w, w_dtype, b_dtype in zip(grads, weights, w_dtypes, b_dtypes):
            if g is None:
                grad_ws.append(None)
                grad_bs.append(None)
                continue
            g = g.to(w.dtype)
            term = g @ w
            grad_full = term if grad_full is None else grad_full + term
            g2 = g.flatten(0, -2)
            grad_ws.append((g2.t() @ full).to(w_dtype))
            grad_bs.append(g2.sum(0).to(b_dtype) if b_dtype is not None else None)
        grad_x = None
        if grad_full is not None and ctx.needs_input_grad[0]:
            grad_x = tp.reduce_scatter(grad_full, SEQ_DIM).to(x_dtype)
        return (grad_x, None, None, *grad_ws, *grad_bs)


COLUMN, ROW = "column", "row"  # how a linear is split over tp (its output's or its input's features)
REPLICATED = "replicated"  # whole on every tp rank, on the rank's tokens (its sequence slice under sp)

# How a linear's GEMM runs on this rank's pieces, by the linear module's type: ``F.linear``
# unless the package that supplies the type registers a maker ``(linear, tp, split) ->
# gemm(x, w, b)`` (``parallel/fp8/tp.py`` for torchao's Float8Linear: fp8 with tp-wide scales).
TP_GEMMS: dict[type, Callable] = {}


def tp_gemm(linear: nn.Module, tp: TensorParallelGroup, split: str) -> Callable:
    """``linear``'s GEMM on local pieces, ``split`` (``COLUMN`` or ``ROW``) over ``tp``."""
    make = TP_GEMMS.get(type(linear))
    return F.linear if make is None else make(linear, tp, split)


def column_linears(tp: TensorParallelGroup, x: torch.Tensor, weights: list, biases: list,
                   gemms: list | None = None) -> tuple:
    """Column-parallel linears sharing one input ``x`` (local weights already); ``gemms``:
    each one's ``tp_gemm`` (default ``F.linear``). Registered GEMMs see the gathered input
    (kept for backward: their own autograd saves what it needs)."""
    if gemms is not None and any(g is not F.linear for g in gemms):
        x = tp.enter(x)
        return tuple(g(x, w, b) for g, w, b in zip(gemms, weights, biases))
    if tp.sp:
        return _GatheredLinears.apply(x, tp, len(weights), *weights, *biases)
    x = tp.enter(x)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
