"""The Gemma 3 family (``gemma3_text``): 5:1 local sliding-window and global layers with two
RoPE bases, the query_pre_attn_scalar softmax scale, QK-norm, the (1 + w) RMSNorm four times
per block, sqrt(dim) embedding scale, GeGLU, tied embeddings.

It adds no block of its own: the shared grouped-query attention and decoder block take its
per-layer window, RoPE and scale (``registry.LayerAttention``), its post norms and its
embedding scale through the registry's hooks, so tensor parallel, FSDP, pipelines and the
planner see a ``gqa`` model. Context parallel refuses windowed layers
(``parallel/config.py``).
"""

from __future__ import annotations

from meshfold.models.gemma3.config import Gemma3Keys, check_gemma3, layer_attention
from meshfold.models.gemma3.hf import ADAPTER
from meshfold.models.gemma3.presets import PRESETS
from meshfold.models.registry import Family

FAMILY = Family("gemma3", sections=(Gemma3Keys,), checks=(check_gemma3,), presets=PRESETS, hf=ADAPTER,
                norms={"gemma_rmsnorm": "meshfold.models.gemma3.norm:GemmaRMSNorm"},
                embedding_scale=lambda m: m.dim ** 0.5 if m.embed_scale else 1.0,
                layer_attention=layer_attention, post_norms=lambda m: m.sandwich_norm)
