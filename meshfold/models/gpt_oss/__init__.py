"""The gpt-oss family (``gpt_oss``, OpenAI's gpt-oss-20b / -120b): grouped-query attention
with a learned sink logit per head in every layer, 128-token sliding windows on every other
layer (the first of each pair), biases on q/k/v/o, on the router and on every expert, the
clamped SwiGLU experts (``(up + 1) * gate * sigmoid(1.702 gate)``, both clamped at 7),
top-k routing with a softmax over the k chosen logits, YaRN RoPE without truncation.

No block of its own: the shared ``gqa`` attention takes the per-layer window and sinks
(``registry.LayerAttention``), the shared MoE block its biases (``model.moe_bias``) and the
activation registered here as ``model.mlp = "clamped_swiglu"`` (``registry.mlps``), so tensor
parallel, FSDP, pipelines and the planner see a ``gqa`` MoE model. Context parallel refuses
windowed and sink layers (``parallel/config.py``).
"""

from __future__ import annotations

from meshfold.models.gpt_oss.config import GptOssKeys, check_gpt_oss, layer_attention
from meshfold.models.gpt_oss.hf import ADAPTER
from meshfold.models.gpt_oss.presets import PRESETS
from meshfold.models.registry import Family

FAMILY = Family("gpt_oss", sections=(GptOssKeys,), checks=(check_gpt_oss,), presets=PRESETS, hf=ADAPTER,
                layer_attention=layer_attention,
                mlps={"clamped_swiglu": "meshfold.models.gpt_oss.activation:clamped_swiglu"},
                # two clamps, the scale, sigmoid, two products and up + 1: 2+2+2+2+3+2+3 elements
                mlp_elements={"clamped_swiglu": 16})
