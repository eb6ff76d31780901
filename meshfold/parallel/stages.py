"""Pipeline stages as modules: how many blocks each stage gets, and a stage built as the
full ``Transformer`` with the other layers deleted (``layers`` keys are global layer
indices, init is name-seeded, so its values equal the full model's). Which rank holds
which stage is ``meshfold/schedule.py``'s layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshfold.models.llama import Transformer, init_weights
from meshfold.parallel.materialize import build_on_meta
from meshfold.models.stage_balance import stage_split_of
from meshfold.schedule import chunks_per_rank

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def stage_split(cfg: Config) -> tuple[list[int], str]:
    """Blocks per stage: ``parallel.pp_split`` if given, else the cost-balanced split (the
    planner prices the same split: ``stage_split_of``)."""
    p = cfg.parallel
    n = p.pp * chunks_per_rank(p.pp_schedule, p.pp_virtual_stages)
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
    if stage > 0:
        # multi-token prediction embeds the shifted tokens on the last stage: it keeps a copy of
        # the embedding, whose gradient the executor adds to the first stage's (pipeline.py)
        if not (last and model.mtp is not None):
            model.tok_embeddings = None
        model.pos_embeddings = None
    if not last:
        model.norm = None
        model.output = None
        model.mtp = None
    if not meta:
        model.to_empty(device="cpu")
        init_weights(model, cfg.model, cfg.train.seed)
    return model
