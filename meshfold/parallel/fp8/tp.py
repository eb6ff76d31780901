"""FP8 GEMMs under tensor parallel: a torchao ``Float8Linear``'s three GEMMs on this rank's
pieces (``parallel/tp``'s column- and row-parallel layers call them through ``tp_gemm``),
with each cast's scale reduced over tp wherever the axis it scales over is split, so every
rank casts with the scale one process would use on the whole tensor (torchao's
``Float8ColwiseParallel``/``Float8RowwiseParallel`` get the same from DTensor's amax
all-reduce). Per-tensor scales: one max all-reduce per split operand; per-row scales only
where the row runs along the split axis (the row-parallel input and weight forward, the
column-parallel output gradient and weight for the input gradient; a replicated linear under
sp, whose tokens are split: the weight gradient's operands). Every all-reduce is a scalar or
one value per row, recorded under ``"tp"``.

The GEMM itself is torchao's (``Float8TrainingTensor`` operands, ``torch._scaled_mm``):
the same casts, in the same order, as ``matmul_with_hp_or_float8_args``; only the scales'
reduction is added, so one tp rank computes exactly its slice of the one-process result up
to the summation order of the row-parallel reduction."""

from __future__ import annotations

import torch
from torch import nn

from meshfold.parallel.tp.collectives import COLUMN, REPLICATED, ROW, TP_GEMMS, TensorParallelGroup

# The axis of each 2-D operand split over tp, by the linear's split: ``x`` [tokens, in],
# ``w_t`` (the weight transposed, as torchao holds it) [in, out], ``grad`` [tokens, out].
SPLIT_AXES = {
    COLUMN: {"x": None, "w_t": 1, "grad": 1},  # out features split; the input is whole
    ROW: {"x": 1, "w_t": 0, "grad": None},  # in features split; the output a partial sum
    # (under sp; without sp nothing of a replicated linear is split): the tokens split, the weight whole
    REPLICATED: {"x": 0, "w_t": None, "grad": 0},
}
UNSPLIT = {"x": None, "w_t": None, "grad": None}


def _cast(tp: TensorParallelGroup, hp: torch.Tensor, cast, mm_config, role, axiswise: int, split_axis, round_pow2):
    """``hp`` to a Float8TrainingTensor with the scale one process would compute: the local
    amax, max-reduced over tp when it spans ``split_axis``."""
    from torchao.float8.config import ScalingGranularity, ScalingType  # torchao: only when a run asks for fp8
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    if cast.scaling_type is ScalingType.DISABLED:
        return hp
    dim = get_maybe_axiswise_dim(axiswise, cast.scaling_granularity)
    with torch.no_grad():
        amax = tensor_to_amax(hp, False, None, cast.scaling_granularity, dim)
        spans = cast.scaling_granularity is ScalingGranularity.TENSORWISE or dim % hp.dim() == split_axis
        if split_axis is not None and spans:
            amax = tp.all_reduce_(amax.float().contiguous(), op="max")
        scale = amax_to_scale(amax, cast.target_dtype, round_pow2)
    return hp_tensor_and_scale_to_float8(hp, scale, cast.target_dtype, mm_config, role, dim)


class _TensorParallelFloat8Matmul(torch.autograd.Function):
    """``x @ w_t`` with fp8 operands, forward and both gradients (torchao's casts, tp scales)."""

    @staticmethod
    def forward(ctx, x, w_t, tp, axes, mm_config, config):
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.save_for_backward(x, w_t)
        ctx.tp, ctx.axes, ctx.mm_config, ctx.config = tp, axes, mm_config, config
        c, axes, pow2 = config, ctx.axes, config.round_scales_to_power_of_2
        x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]: the axes SPLIT_AXES names
        x8 = _cast(tp, x2, c.cast_config_input, mm_config, GemmInputRole.INPUT, -1, axes["x"], pow2)
        w8 = _cast(tp, w_t, c.cast_config_weight, mm_config, GemmInputRole.WEIGHT, 0, axes["w_t"], pow2)
        out = torch.mm(x8, w8)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        from torchao.float8.float8_training_tensor import GemmInputRole

        x, w_t = ctx.saved_tensors
        tp, c, axes, mm, pow2 = ctx.tp, ctx.config, ctx.axes, ctx.mm_config, ctx.config.round_scales_to_power_of_2
        g = grad.reshape(-1, grad.shape[-1])
        g8 = _cast(tp, g, c.cast_config_grad_output, mm, GemmInputRole.GRAD_OUTPUT, -1, axes["grad"], pow2)
        w8 = _cast(tp, w_t, c.cast_config_weight_for_grad_input, mm, GemmInputRole.WEIGHT, -1, axes["w_t"], pow2)
        grad_x = torch.mm(g8, w8.t()).reshape(*grad.shape[:-1], w_t.shape[0])
        x2 = x.reshape(-1, x.shape[-1])
        g8 = _cast(tp, g, c.cast_config_grad_output_for_grad_weight, mm, GemmInputRole.GRAD_OUTPUT, 0, axes["grad"], pow2)
        x8 = _cast(tp, x2, c.cast_config_input_for_grad_weight, mm, GemmInputRole.INPUT, 0, axes["x"], pow2)
        grad_w = torch.mm(g8.t(), x8)
        return grad_x, grad_w.t(), None, None, None, None


def float8_tp_gemm(linear: nn.Linear, tp: TensorParallelGroup, split: str):
    """The maker ``tp_gemm`` calls for a Float8Linear: ``gemm(x, w, b)`` on local pieces,
    with the input in the autocast dtype as ``Float8Linear.forward`` has it."""
    axes = UNSPLIT if split == REPLICATED and not tp.sp else SPLIT_AXES[split]

    def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        out = _TensorParallelFloat8Matmul.apply(x, w.t(), tp, axes, linear.linear_mm_config, linear.config)
        return out if b is None else out + b.to(out.dtype)

    return gemm


def register(float8_linear: type) -> None:
    """``tp_gemm`` runs torchao's Float8Linear's GEMMs here (``convert.py`` calls it when a
    run converts its linears: torchao is imported only then)."""
    TP_GEMMS[float8_linear] = float8_tp_gemm
