"""The planner's terms of each attention block kind, looked up by ``ModelConfig.attention``.

Shared planner code (counts, kernels, layer terms, search) asks ``attention_terms(m)`` for
what differs between kinds (parameters per tp rank, GEMM shapes, what backward keeps, the
tp and cp traffic) and never names a kind. A new kind (sliding-window, chunked) is one
module with an ``AttentionTerms`` subclass and one line in ``VARIANTS``."""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.planner.attention.base import AttentionTerms
from meshfold.planner.attention.gqa import GroupedQuery
from meshfold.planner.attention.mla import LatentAttention
from meshfold.planner.attention.ring import RingSends, ring_sends

VARIANTS: dict[str, AttentionTerms] = {
    "gqa": GroupedQuery(),
    "mla": LatentAttention(),
}


def attention_terms(m: ModelConfig) -> AttentionTerms:
    """The terms of ``m``'s attention block kind."""
    return VARIANTS[m.attention]


__all__ = ["AttentionTerms", "RingSends", "VARIANTS", "attention_terms", "ring_sends"]
