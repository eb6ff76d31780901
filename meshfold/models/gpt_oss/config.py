"""gpt-oss's ``[model]`` keys and their checks: the alternating sliding windows, the attention
sinks and the clamped SwiGLU's constants. Torch-free.

The rest of a gpt-oss shape is shared keys: ``bias = true`` (q/k/v/o biases), ``moe_bias =
true`` (router and expert biases), ``mlp = "clamped_swiglu"``, ``moe_norm_topk = true`` (a
softmax over the k chosen logits is the softmax over all renormalised over the k), YaRN
``rope_scaling`` with ``rope_truncate = false``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.errors import ConfigError
from meshfold.models.registry import LayerAttention


@dataclass
class GptOssKeys:
    """gpt-oss's switches (each off by default, so other families are untouched)."""

    alternating_window: int = 0  # > 0: even layers (0, 2, ...) attend to their latest keys only, odd ones to all
    attention_sinks: bool = False  # a learned logit per head in every layer's softmax denominator
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate) * (up + 1)
    swiglu_limit: float = 7.0  # clamped_swiglu: gate clamped above, up on both sides, at this value

    def is_windowed(self, layer: int) -> bool:
        """Hugging Face's ``layer_types`` rule for gpt-oss: ``(i + 1) % 2`` is sliding."""
        return self.alternating_window > 0 and (layer + 1) % 2 == 1


def layer_attention(m, layer: int) -> LayerAttention | None:
    """The registry hook: the window on even layers, sinks on all; None for other configs."""
    if not (m.alternating_window or m.attention_sinks):
        return None
    return LayerAttention(window=m.alternating_window if m.is_windowed(layer) else 0, sinks=m.attention_sinks)


def check_gpt_oss(m) -> None:
    if m.alternating_window < 0:
        raise ConfigError(f"model.alternating_window must be >= 0 (0 = no windowed layers), got "
                          f"{m.alternating_window}")
    if (m.alternating_window or m.attention_sinks) and m.attention != "gqa":
        raise ConfigError(f"model.alternating_window / attention_sinks need grouped-query attention, not "
                          f"{m.attention!r}")
    if (m.alternating_window or m.attention_sinks) and (m.sliding_window or m.query_pre_attn_scalar):
        raise ConfigError("model.alternating_window / attention_sinks do not combine with model.sliding_window / "
                          "query_pre_attn_scalar (Gemma 3's layers); set one family's keys")
    if m.mlp != "clamped_swiglu":
        return
    if m.swiglu_limit <= 0 or m.swiglu_alpha <= 0:
        raise ConfigError(f"model.swiglu_limit and model.swiglu_alpha must be positive, got {m.swiglu_limit} "
                          f"and {m.swiglu_alpha}")
    dense = [i for i in range(m.n_layers) if not m.is_moe_layer(i)]
    if dense or m.moe_shared_experts:
        raise ConfigError(f"model.mlp = 'clamped_swiglu' runs in routed experts only; layers {dense[:4]} are dense "
                          f"(or model.moe_shared_experts > 0): make every layer MoE or use model.mlp = 'swiglu'")
