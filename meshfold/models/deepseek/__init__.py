"""The DeepSeek family (V2, V3): multi-head latent attention (``mla``, ``deepseek/mla.py``),
multi-token prediction heads (``mtp``, ``deepseek/mtp.py``) and group-limited routing (keys of
the shared MoE block). Its ``[model]`` keys are ``mla_*``, ``rope_mscale_all_dim`` and
``mtp_*`` (``deepseek/config.py``); MTP composes with any attention kind.
"""

from __future__ import annotations

from meshfold.models.deepseek.config import MLAKeys, MTPKeys, check_mla, check_mtp
from meshfold.models.deepseek.counts import mla_params, mla_widths, mtp_params, mtp_training_flops
from meshfold.models.deepseek.hf import ADAPTER
from meshfold.models.deepseek.presets import PRESETS
from meshfold.models.registry import AttentionKind, Family, Head

MLA = AttentionKind("mla", build="meshfold.models.deepseek.mla:build_attention", params=mla_params,
                    widths=mla_widths, rope_dim=lambda m: m.mla_rope_dim, selects=lambda m: m.mla_kv_rank > 0,
                    check=check_mla)
MTP = Head("mtp", active=lambda m: m.mtp_depth > 0, build="meshfold.models.deepseek.mtp:build_heads",
           params=mtp_params, training_flops=mtp_training_flops)

FAMILY = Family("deepseek", sections=(MLAKeys, MTPKeys), checks=(check_mtp,), presets=PRESETS, hf=ADAPTER,
                attention=(MLA,), heads=(MTP,))
