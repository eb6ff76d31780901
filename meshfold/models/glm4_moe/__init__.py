"""The GLM-4.5 family (``glm4_moe``): grouped-query attention with partial RoPE (half of each
head), q/k/v biases and optional q/k norms, DeepSeek-V3's sigmoid group-limited routing with a
correction bias and shared experts, dense first layers, a multi-token prediction layer. Every
block is shared (the ``gqa`` attention, the MoE block, DeepSeek's ``mtp`` head): the family is
its Hugging Face adapter and presets."""

from __future__ import annotations

from meshfold.models.glm4_moe.hf import ADAPTER
from meshfold.models.glm4_moe.presets import PRESETS
from meshfold.models.registry import Family

FAMILY = Family("glm4_moe", presets=PRESETS, hf=ADAPTER)
