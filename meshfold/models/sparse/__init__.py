"""The mixture-of-experts family: Mixtral, Qwen3-MoE and DeepSeek-MoE (v1) shapes.

The dense decoder with the shared MoE block (``models/moe.py``, keys in
``models/moe_config.py``) in its feed-forward layers: no keys or blocks of its own beyond its
presets and the Hugging Face adapter of ``mixtral`` and ``qwen3_moe``.
"""

from __future__ import annotations

from meshfold.models.registry import Family
from meshfold.models.sparse.hf import ADAPTER
from meshfold.models.sparse.presets import PRESETS

FAMILY = Family("sparse", presets=PRESETS, hf=ADAPTER)
