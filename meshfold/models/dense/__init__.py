"""The dense Llama-style family: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 (and GPT-3's shape).

It provides grouped-query attention (``gqa``, the default attention kind every family without
its own composes; the block is ``models/llama.py``'s ``Attention``), the dense presets and the
Hugging Face adapter of ``llama``, ``mistral``, ``qwen2`` and ``qwen3``. Its keys are the
common ones (``models/config.py``).
"""

from __future__ import annotations

from meshfold.models.dense.attention import check_gqa, gqa_params, gqa_rope_dim, gqa_widths
from meshfold.models.dense.hf import ADAPTER
from meshfold.models.dense.presets import PRESETS
from meshfold.models.registry import AttentionKind, Family

GQA = AttentionKind("gqa", build="meshfold.models.llama:grouped_query_attention", params=gqa_params,
                    widths=gqa_widths, rope_dim=gqa_rope_dim, check=check_gqa)

FAMILY = Family("dense", presets=PRESETS, hf=ADAPTER, attention=(GQA,))
