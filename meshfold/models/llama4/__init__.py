"""The Llama 4 family (``llama4_text``): chunked attention on three of four layers, NoPE
layers (every fourth) with attention temperature tuning, the L2 q/k norm on the RoPE layers,
top-1 sigmoid experts gating their input beside a shared expert, dense and MoE layers
alternating (Maverick).

It adds no block of its own: the shared grouped-query attention takes its per-layer chunk,
NoPE, L2 norm and temperature (``registry.LayerAttention``, ``layer_attention`` here) and the
shared MoE block its routing keys (``moe_norm_topk = false``, ``moe_gate_input``), so tensor
parallel, FSDP, pipelines and the planner see a ``gqa`` MoE model. Context parallel refuses
chunked layers (``parallel/config.py``).
"""

from __future__ import annotations

from meshfold.models.llama4.config import Llama4Keys, check_llama4, layer_attention
from meshfold.models.llama4.hf import ADAPTER
from meshfold.models.llama4.presets import PRESETS
from meshfold.models.registry import Family

FAMILY = Family("llama4", sections=(Llama4Keys,), checks=(check_llama4,), presets=PRESETS, hf=ADAPTER,
                layer_attention=layer_attention)
