"""The FP8 recipes and their rules, torch-free (the config checks, the dry-run and the
planner share them).

What stays in high precision, as torchtitan does: the output layer (the loss is sensitive to
its logits), the MoE router (tiny, and its scores pick the experts), and every linear whose
input or output width is not a multiple of ``ALIGN[recipe]`` (the fp8 GEMMs need 16-aligned
dimensions; MXFP8 scales blocks of 32)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.errors import ConfigError

if TYPE_CHECKING:  # the composed config is handed in; its module sits above this layer
    from meshfold.config import Config

RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")

# The dimension every converted linear's widths must be a multiple of.
ALIGN = {"tensorwise": 16, "rowwise": 16, "rowwise_with_gw_hp": 16, "mxfp8": 32}

# Linears kept in high precision by their attribute name in the model.
HIGH_PRECISION_NAMES = ("output", "router")

# The CUDA compute capability each recipe's kernels need (fp8 GEMMs: Ada/Hopper; MX: Blackwell).
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (8, 9), "rowwise_with_gw_hp": (8, 9), "mxfp8": (10, 0)}


def converts(recipe: str, fqn: str, in_features: int, out_features: int) -> bool:
    """Whether the linear at ``fqn`` computes in fp8 under ``recipe``."""
    if recipe == "none" or fqn.rsplit(".", 1)[-1] in HIGH_PRECISION_NAMES:
        return False
    return in_features % ALIGN[recipe] == 0 and out_features % ALIGN[recipe] == 0


def validate(cfg: Config) -> None:
    """``train.fp8`` against the rest of the config: one line naming the key to change."""
    t, p = cfg.train, cfg.parallel
    if t.fp8_all_gather and t.fp8 != "tensorwise":
        raise ConfigError(f"train.fp8_all_gather = true needs train.fp8 = tensorwise (torchao gathers only "
                          f"per-tensor scaled weights in fp8), got train.fp8 = {t.fp8!r}")
    if t.fp8 == "none":
        return
    if p.tp > 1:
        raise ConfigError("train.fp8 with parallel.tp > 1 is not supported yet (meshfold's tensor-parallel "
                          "layers call their GEMMs directly); use parallel.tp = 1 or train.fp8 = none")
