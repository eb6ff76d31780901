"""The routed experts' grouped GEMMs in fp8 (``train.fp8``; ``models/moe_experts.py``'s
``GroupedExperts.grouped_mm`` hook, set here for every experts module):

* ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``: rowwise e4m3 with power-of-2 scales,
  as torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (the Hopper recipe torchtitan
  uses for MoE): the input per row, each expert's weight per output column, and for the
  weight gradient both operands per column within each expert's group of rows. On CUDA
  torchao runs it (``torch._scaled_grouped_mm``); elsewhere, and on the dry-run's fake
  tensors, ``_RowwiseGroupedMM`` emulates it: the same casts, the GEMM on the fp8 values
  (exact in bf16: 4 significant bits times a power of 2), accumulated in fp32;
* ``mxfp8``: torchao's MXFP8 grouped GEMM (blocks of 32, e8m0 scales), its Blackwell
  kernels on CUDA, ``KernelPreference.EMULATED`` elsewhere.

Groups are padded to 16 rows (fp8) or 32 (MXFP8: the weight gradient scales blocks of 32
rows, which must not straddle two experts) through ``GroupedExperts.group_rows``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models.moe_experts import GroupedExperts, has_values

E4M3 = torch.float8_e4m3fn
GROUP_ROWS = {"tensorwise": 16, "rowwise": 16, "rowwise_with_gw_hp": 16, "mxfp8": 32}


def _fp8_values(t: torch.Tensor, dim: int, group: torch.Tensor | None = None, groups: int = 0) -> torch.Tensor:
    """``t`` rounded to e4m3 with a power-of-2 scale per slice along ``dim`` (per group of
    rows along dim 0 with ``group``: each row's group id, ``groups`` of them), returned
    dequantised in ``t``'s dtype (exact in bf16): the values a scaled GEMM multiplies."""
    from torchao.float8.float8_utils import amax_to_scale  # torchao: only when a run asks for fp8

    x = t.float()
    if group is None:
        amax = x.abs().amax(dim, keepdim=True)
    else:  # per (group, column) over the group's rows; rows past the last group: their own
        per = x.new_zeros(groups + 1, x.shape[1]).scatter_reduce(
            0, group[:, None].expand_as(x), x.abs(), "amax", include_self=True)
        amax = per[group]
    scale = amax_to_scale(amax, E4M3, round_scales_to_power_of_2=True)
    return ((x * scale).clamp(-448.0, 448.0).to(E4M3).float() / scale).to(t.dtype)


def _row_groups(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's group id from the groups' end offsets (rows past the last: ``len(offs)``)."""
    return torch.searchsorted(offs.to(torch.int64), torch.arange(rows, device=offs.device), right=True)


class _RowwiseGroupedMM(torch.autograd.Function):
    """``grouped_mm(a, b_t, offs)`` with torchao's rowwise fp8 casts, emulated (see above)."""

    @staticmethod
    def forward(ctx, a, b_t, offs):
        ctx.save_for_backward(a, b_t, offs)
        out = F.grouped_mm(_fp8_values(a, -1), _fp8_values(b_t, -2), offs=offs)
        return out.to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b_t, offs = ctx.saved_tensors
        grad_a = F.grouped_mm(_fp8_values(grad, -1), _fp8_values(b_t, -1).transpose(-2, -1), offs=offs)
        group = _row_groups(offs, a.shape[0])
        g, x = _fp8_values(grad, 0, group, offs.shape[0]), _fp8_values(a, 0, group, offs.shape[0])
        grad_b_t = F.grouped_mm(x.t(), g, offs=offs)  # [E, in, out]
        return grad_a.to(a.dtype), grad_b_t.to(b_t.dtype), None


def rowwise_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cuda" and has_values(a):
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        # (groups already padded to 16 rows: GroupedExperts.group_rows)
        return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, a.dtype, pad_token_groups_for_grouped_mm=False)
    return _RowwiseGroupedMM.apply(a, b_t, offs)


def mxfp8_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    kernel = KernelPreference.AUTO if a.device.type == "cuda" and has_values(a) else KernelPreference.EMULATED
    return _to_mxfp8_then_scaled_grouped_mm(a, b_t, offs, out_dtype=a.dtype, kernel_preference=kernel)


def apply_fp8_experts(model: nn.Module, recipe: str) -> None:
    """Every ``GroupedExperts`` whose widths the recipe can scale runs its grouped GEMMs in fp8."""
    align = GROUP_ROWS[recipe]
    for module in model.modules():
        if isinstance(module, GroupedExperts) and all(d % align == 0 for d in module.w2.shape[1:]):
            module.group_rows = align
            module.grouped_mm = mxfp8_grouped_mm if recipe == "mxfp8" else rowwise_grouped_mm
