"""The model's linears to torchao's float8 / MXFP8 training linears, in place, before tensor
and data parallel see them (``parallelize`` calls ``apply_fp8`` first of all). Works on a
``meta`` model: only the modules' classes and their weights' wrappers change, names and
shapes stay, so materialisation, FSDP2 and checkpoints see the same parameters in the
master dtype; only the GEMMs (and, with ``fp8_all_gather``, FSDP2's weight gathers) are fp8.

torchao is imported here only, when a run asks for fp8 (the optional ``fp8`` extra)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from meshfold.errors import ConfigError
from meshfold.parallel.fp8 import tp
from meshfold.parallel.fp8.config import AUTO, converts
from meshfold.parallel.fp8.experts import apply_fp8_experts


def _cast_to_autocast_dtype(module: nn.Module, args: tuple):
    """torchao's ``Float8Linear`` casts its input to CUDA's autocast dtype only; under CPU
    autocast the input would stay fp32 while the gradients arrive in bf16. (A no-op on CUDA.)"""
    x = args[0]
    kind = x.device.type
    if kind != "cuda" and torch.is_autocast_enabled(kind):
        return (x.to(torch.get_autocast_dtype(kind)), *args[1:])
    return None


def _linear_filter(recipe: str, tp_size: int = 1):
    def keep(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and converts(recipe, fqn, module.in_features, module.out_features, tp_size)
    return keep


def _float8_linears(model: nn.Module, recipe: str, all_gather: bool, tp_size: int) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = (Float8LinearConfig(enable_fsdp_float8_all_gather=True) if all_gather
              else Float8LinearConfig.from_recipe_name(recipe))
    convert_to_float8_training(model, config=config, module_filter_fn=_linear_filter(recipe, tp_size))
    tp.register(Float8Linear)  # tensor parallel's layers run its GEMMs with tp-wide scales
    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.register_forward_pre_hook(_cast_to_autocast_dtype)


def _mxfp8_linears(model: nn.Module, device_type: str) -> None:
    """Weights wrapped so that ``F.linear`` runs as MXFP8 (blocks of 32, e8m0 scales): the
    Blackwell kernels on CUDA, torchao's emulation elsewhere (the same numerics, slowly)."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    recipe = MXFP8TrainingRecipe.MXFP8_RCEIL if device_type == "cuda" else MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL
    quantize_(model, MXFP8TrainingOpConfig.from_recipe(recipe), filter_fn=_linear_filter("mxfp8"))


def apply_fp8(model: nn.Module, train, device: torch.device | None = None, tp_size: int = 1) -> nn.Module:
    """Convert ``model``'s linears for ``train.fp8`` (``"none"``: unchanged); ``tp_size``:
    the tensor-parallel degree the model is split over next (its pieces must stay aligned)."""
    if train.fp8 == "none":
        return model
    if train.fp8 == AUTO:
        raise ConfigError("train.fp8 = auto is the planner's to choose: run `meshfold plan CONFIG --cluster C "
                          "--out PLAN.toml` and train PLAN.toml, or set train.fp8 to none or a recipe")
    if device is not None and device.type == "cuda" and not train.compile and (
            not dist.is_initialized() or dist.get_rank() == 0):
        # measured: torchao's casts then run op by op (docs/gpu.md, "FP8, Muon and windowed attention")
        print(f"meshfold: train.fp8 = {train.fp8} without train.compile runs torchao's casts op by op: on an "
              f"H200 that step was 1.51x slower than bf16 (compiled, tensorwise: 1.13x faster); set "
              f"train.compile = true", file=sys.stderr, flush=True)
    if train.fp8 == "mxfp8":
        _mxfp8_linears(model, device.type if device is not None else "cpu")
    else:
        _float8_linears(model, train.fp8, train.fp8_all_gather, tp_size)
    apply_fp8_experts(model, train.fp8)  # the routed experts' grouped GEMMs
    return model
