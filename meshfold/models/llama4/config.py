"""Llama 4's ``[model]`` keys and their checks: chunked attention on the RoPE layers, NoPE
layers (every ``nope_interval``-th) with attention temperature tuning, the L2 q/k norm. Torch-free.

The rest of a Llama 4 text shape is the common keys and the shared MoE block's: top-1 sigmoid
routing without renormalisation (``moe_router = "sigmoid"``, ``moe_norm_topk = false``) whose
gate scales the token before its expert (``moe_gate_input``), one shared expert, MoE on every
``moe_every``-th layer (Hugging Face's ``interleave_moe_layer_step``), the dense layers'
``ffn_dim`` (``intermediate_size_mlp``) wider than an expert's ``moe_ffn_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.errors import ConfigError
from meshfold.models.registry import LayerAttention


@dataclass
class Llama4Keys:
    """Llama 4's switches (each off by default, so other families are untouched)."""

    attention_chunk_size: int = 0  # > 0: RoPE layers attend within chunks of this many positions
    nope_interval: int = 0  # > 0: every nope_interval-th layer has no RoPE (and full causal attention)
    attn_temperature_tuning: bool = False  # NoPE layers: queries times 1 + attn_scale * log1p(floor((p + 1) / floor))
    attn_floor_scale: float = 8192.0
    attn_scale: float = 0.1
    l2_qk_norm: bool = False  # RoPE layers: q and k divided by their RMS over each head (no weight)

    def is_nope(self, layer: int) -> bool:
        """Hugging Face's ``no_rope_layers`` default: ``(i + 1) % no_rope_layer_interval == 0``."""
        return self.nope_interval > 0 and (layer + 1) % self.nope_interval == 0


def llama4_keys_set(m) -> bool:
    return bool(m.attention_chunk_size or m.nope_interval or m.l2_qk_norm)


def layer_attention(m, layer: int) -> LayerAttention | None:
    """The registry hook: RoPE layers chunked and L2-normed, NoPE layers whole-context with the
    temperature. None for configs without Llama 4's switches."""
    if not llama4_keys_set(m):
        return None
    if m.is_nope(layer):
        temperature = (m.attn_floor_scale, m.attn_scale) if m.attn_temperature_tuning else ()
        return LayerAttention(nope=True, temperature=temperature)
    return LayerAttention(chunk=m.attention_chunk_size, l2_qk_norm=m.l2_qk_norm)


def check_llama4(m) -> None:
    if m.attention_chunk_size < 0:
        raise ConfigError(f"model.attention_chunk_size must be >= 0 (0 = whole causal context), got "
                          f"{m.attention_chunk_size}")
    if m.nope_interval < 0:
        raise ConfigError(f"model.nope_interval must be >= 0 (0 = RoPE on every layer), got {m.nope_interval}")
    if m.attn_temperature_tuning and m.attn_floor_scale <= 0:
        raise ConfigError(f"model.attn_floor_scale must be positive, got {m.attn_floor_scale}")
    if llama4_keys_set(m) and m.attention != "gqa":
        raise ConfigError(f"model.attention_chunk_size / nope_interval / l2_qk_norm need grouped-query attention, "
                          f"not {m.attention!r}")
