"""Gemma 3's ``[model]`` keys and their checks: the local (sliding-window) layers, their RoPE
base, the softmax scale, the four norms per block and the embedding scale. Torch-free.

The rest of a Gemma 3 shape is the common keys: ``norm = "gemma_rmsnorm"`` (the (1 + w)
RMSNorm, ``gemma3/norm.py``), ``mlp = "geglu"``, ``qk_norm = true``, tied embeddings;
``rope_theta`` / ``rope_scaling`` are the global layers' RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.errors import ConfigError
from meshfold.models.registry import LayerAttention


@dataclass
class Gemma3Keys:
    """Gemma 3's switches (each off by default, so other families are untouched)."""

    sliding_window: int = 0  # > 0: local layers attend to their `sliding_window` latest keys (itself included)
    sliding_pattern: int = 6  # every sliding_pattern-th layer is global (5 local : 1 global), the rest local
    rope_local_theta: float = 10000.0  # RoPE base of the local layers (unscaled); global: rope_theta, rope_scaling
    query_pre_attn_scalar: float = 0.0  # softmax scale 1 / sqrt(this); 0 = 1 / sqrt(head_dim)
    sandwich_norm: bool = False  # also normalise attention and feed-forward outputs (four norms per block)
    embed_scale: bool = False  # token embeddings times sqrt(dim)

    def is_local(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the window (Hugging Face's ``layer_types``
        rule: ``(i + 1) % sliding_window_pattern != 0``)."""
        return self.sliding_window > 0 and (layer + 1) % self.sliding_pattern != 0


def layer_attention(m, layer: int) -> LayerAttention | None:
    """The registry hook: local layers get the window and their own RoPE base; every layer the
    query_pre_attn_scalar softmax scale. None for configs without Gemma 3's switches."""
    if not (m.sliding_window or m.query_pre_attn_scalar):
        return None
    scale = m.query_pre_attn_scalar ** -0.5 if m.query_pre_attn_scalar else 0.0
    if m.is_local(layer):
        return LayerAttention(window=m.sliding_window, scale=scale,
                              rope=(("rope_theta", m.rope_local_theta), ("rope_scaling", "none")))
    return LayerAttention(scale=scale)


def check_gemma3(m) -> None:
    if m.sliding_window < 0:
        raise ConfigError(f"model.sliding_window must be >= 0 (0 = no sliding-window layers), got {m.sliding_window}")
    if m.sliding_pattern < 1:
        raise ConfigError(f"model.sliding_pattern must be >= 1 (every n-th layer global), got {m.sliding_pattern}")
    if m.query_pre_attn_scalar < 0:
        raise ConfigError(f"model.query_pre_attn_scalar must be >= 0 (0 = head_dim), got {m.query_pre_attn_scalar}")
    if m.rope_local_theta <= 0:
        raise ConfigError(f"model.rope_local_theta must be positive, got {m.rope_local_theta}")
    if (m.sliding_window or m.query_pre_attn_scalar) and m.attention != "gqa":
        raise ConfigError(f"model.sliding_window / query_pre_attn_scalar need grouped-query attention, not "
                          f"{m.attention!r}")
