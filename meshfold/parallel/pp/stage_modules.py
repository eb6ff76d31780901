"""Pipeline stages as modules: how many blocks each stage gets, and a stage built as the
full ``Transformer`` with the other layers deleted (``layers`` keys are global layer
indices, init is name-seeded, so its values equal the full model's). Which rank holds
which stage is the schedule object's layout (``meshfold/schedules``).

A part of the model that needs a copy of a first-stage weight on another stage registers
one function in ``WEIGHT_COPIES``: (cfg, n_stages) -> {module name: stages holding it}.
Those stages keep the module; the executor sums the copies' gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshfold.models.llama import Transformer, init_weights
from meshfold.parallel.materialize import build_on_meta
from meshfold.models.stage_balance import stage_split_of
from meshfold.parallel.pp.mtp_copies import mtp_embedding_copy
from meshfold.schedules import get_schedule

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


WEIGHT_COPIES = (mtp_embedding_copy,)


def weight_copies(cfg: Config, n_stages: int) -> dict[str, tuple[int, ...]]:
    """{module name: stages holding a copy of it} over every registered part."""
    out: dict[str, tuple[int, ...]] = {}
    for copies in WEIGHT_COPIES:
        out.update(copies(cfg, n_stages))
    return out


def stage_split(cfg: Config) -> tuple[list[int], str]:
    """Blocks per stage: ``parallel.pp_split`` if given, else the cost-balanced split (the
    planner prices the same split: ``stage_split_of``)."""
    p = cfg.parallel
    n = p.pp * get_schedule(p.pp_schedule).chunks_per_rank(p.pp_virtual_stages)
    return stage_split_of(cfg.model, n, p.pp_split)


def build_stage(cfg: Config, split: list[int], stage: int, meta: bool = False,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """The full model with everything outside ``stage`` deleted, initialised by name (or,
    ``meta``, left on the meta device for ``parallelize`` to shard and materialise)."""
    first = sum(split[:stage])
    keep = {str(i) for i in range(first, first + split[stage])}
    model = build_on_meta(lambda: Transformer(cfg.model), dtype)
    for key in [k for k in model.layers.keys() if k not in keep]:
        del model.layers[key]
    last = stage == len(split) - 1
    if stage > 0:  # the inputs' modules stay on stage 0, and on stages that keep a copy
        copies = weight_copies(cfg, len(split))
        for name in ("tok_embeddings", "pos_embeddings"):
            if stage not in copies.get(name, ()):
                setattr(model, name, None)
    if not last:
        model.norm = None
        model.output = None
        model.mtp = None
    if not meta:
        model.to_empty(device="cpu")
        init_weights(model, cfg.model, cfg.train.seed)
    return model
