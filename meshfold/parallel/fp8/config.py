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
AUTO = "auto"  # `meshfold plan` prices none and tensorwise and writes the faster (planner/choices.py)

# The dimension every converted linear's widths must be a multiple of.
ALIGN = {"tensorwise": 16, "rowwise": 16, "rowwise_with_gw_hp": 16, "mxfp8": 32}

# Linears kept in high precision by their attribute name in the model.
HIGH_PRECISION_NAMES = ("output", "router")

# The CUDA compute capability each recipe's kernels need (fp8 GEMMs: Ada/Hopper; MX: Blackwell).
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (8, 9), "rowwise_with_gw_hp": (8, 9), "mxfp8": (10, 0)}


def converts(recipe: str, fqn: str, in_features: int, out_features: int, tp: int = 1) -> bool:
    """Whether the linear at ``fqn`` computes in fp8 under ``recipe``. Under tensor parallel
    (``tp`` > 1) either width may be split, so both must stay aligned once divided by ``tp``."""
    if recipe == "none" or fqn.rsplit(".", 1)[-1] in HIGH_PRECISION_NAMES:
        return False
    align = ALIGN[recipe] * tp
    return in_features % align == 0 and out_features % align == 0


def validate(cfg: Config) -> None:
    """``train.fp8`` against the rest of the config: one line naming the key to change."""
    t, p = cfg.train, cfg.parallel
    if t.fp8_all_gather and t.fp8 not in ("tensorwise", AUTO):
        raise ConfigError(f"train.fp8_all_gather = true needs train.fp8 = tensorwise (torchao gathers only "
                          f"per-tensor scaled weights in fp8), got train.fp8 = {t.fp8!r}")
    if p.ep_fp8_dispatch and (t.fp8 == "none" or p.ep == 1):
        raise ConfigError("parallel.ep_fp8_dispatch = true needs train.fp8 (not none) and parallel.ep > 1 "
                          f"(got {t.fp8!r}, {p.ep}); set parallel.ep_fp8_dispatch = false")
    if t.fp8 == "none":
        return
    if p.tp > 1 and t.fp8 == "mxfp8":
        raise ConfigError("train.fp8 = mxfp8 with parallel.tp > 1 is not supported yet (tensor parallel runs "
                          "the tensorwise and rowwise recipes); use train.fp8 = rowwise or parallel.tp = 1")
    if p.tp > 1 and t.fp8_all_gather:
        raise ConfigError("train.fp8_all_gather = true with parallel.tp > 1 is not supported yet (FSDP2's fp8 "
                          "gathers of tp-sharded weights); set train.fp8_all_gather = false")
