"""Heads per tensor-parallel rank and the Ulysses degree, with the registry of attention
variants' layout rules (torch-free: ``parallel/config.py`` and the planner use them).

A variant's layout rules are an object with ``kv_heads(model)`` (the key/value heads tp
and Ulysses split) and ``check(cfg)`` (what the variant refuses, before any process group
starts); ``ATTENTION_LAYOUTS`` holds one per ``ModelConfig.attention`` value, one line each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.errors import divisors
from meshfold.parallel.facts.mla import LatentAttentionLayout

if TYPE_CHECKING:  # the configs are handed in; their modules sit above or beside this one
    from meshfold.config import Config
    from meshfold.layout import ParallelConfig
    from meshfold.models.config import ModelConfig


class GroupedQueryLayout:
    """Multi-head and grouped-query attention: n_kv_heads heads of keys and values; any
    layout the generic checks accept."""

    @staticmethod
    def kv_heads(model: ModelConfig) -> int:
        return model.kv_heads

    @staticmethod
    def check(cfg: Config) -> None:
        return None


ATTENTION_LAYOUTS = {
    "gqa": GroupedQueryLayout(),
    "mla": LatentAttentionLayout(),
}


def local_heads(model: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, key/value heads) one tensor-parallel rank holds: kv heads are split
    when tp divides them and replicated (one per rank) when they divide tp."""
    kv_heads = ATTENTION_LAYOUTS[model.attention].kv_heads(model)
    kv = kv_heads // tp if kv_heads % tp == 0 else 1
    return model.n_heads // tp, kv


def ulysses_fits(model: ModelConfig, tp: int, degree: int) -> bool:
    heads, kv = local_heads(model, tp)
    return heads % degree == 0 and (kv % degree == 0 or degree % kv == 0)


def ulysses_degree(parallel: ParallelConfig, model: ModelConfig) -> int:
    """Ulysses group size: 1 for ring, cp for ulysses, ``cp_ulysses`` (or the largest
    divisor of cp below cp whose heads fit) for hybrid."""
    if parallel.cp_mode == "ring" or parallel.cp == 1:
        return 1
    if parallel.cp_mode == "ulysses":
        return parallel.cp
    if parallel.cp_ulysses:
        return parallel.cp_ulysses
    fits = [u for u in divisors(parallel.cp) if u < parallel.cp and ulysses_fits(model, parallel.tp, u)]
    return fits[-1]
