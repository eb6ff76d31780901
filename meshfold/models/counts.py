"""Exact parameter counts and FLOPs per token of a ``ModelConfig``, computed from the shape.

Tests check them against published totals (e.g. Llama 3 8B = 8,030,261,248) and against
``sum(p.numel())`` of a built model; the planner and the MFU metric use ``flops_per_token``.
The attention block's and the extra heads' terms come from the registry (``models/registry.py``):
each family counts the blocks it adds. Torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshfold.models import registry

if TYPE_CHECKING:
    from meshfold.models.config import ModelConfig


def norm_params(cfg: ModelConfig) -> int:
    return cfg.dim * (2 if (cfg.norm == "layernorm" and cfg.bias) else 1)


def linear_params(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one layer's attention block (the attention kind's count)."""
    return registry.attention_of(cfg).params(cfg)


def mlp_params(cfg: ModelConfig, hidden: int) -> int:
    mats = 3 if cfg.gated_mlp else 2
    return mats * cfg.dim * hidden + ((2 * hidden if cfg.gated_mlp else hidden) + cfg.dim if cfg.bias else 0)


def ffn_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Feed-forward parameters of one layer; ``active`` counts only what one token uses."""
    if not cfg.is_moe_layer(layer):
        return mlp_params(cfg, cfg.hidden_dim)
    routed = cfg.moe_topk if active else cfg.moe_experts
    # Routed experts and the router carry biases with moe_bias only (models/moe.py); the shared
    # experts are one MLP of width moe_shared_experts * expert_dim, with the model's bias setting.
    expert = mlp_params(dataclasses.replace(cfg, bias=cfg.moe_bias), cfg.expert_dim)
    shared = mlp_params(cfg, cfg.moe_shared_experts * cfg.expert_dim) if cfg.moe_shared_experts else 0
    router = (cfg.dim + cfg.moe_bias) * cfg.moe_experts
    return router + routed * expert + shared


def block_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """One decoder block (layer index ``layer``, MoE placement by it): attention, feed-forward, two
    norms (four with ``registry.post_norms``)."""
    norms = 4 if registry.post_norms(cfg) else 2
    sinks = cfg.n_heads if registry.layer_attention(cfg, layer).sinks else 0  # one logit per query head
    return attention_params(cfg) + sinks + ffn_params(cfg, layer, active) + norms * norm_params(cfg)


def heads_params(cfg: ModelConfig, active: bool = False) -> int:
    """The extra output heads' parameters (multi-token prediction); 0 when none is on."""
    return sum(h.params(cfg, active) for h in registry.heads() if h.active(cfg))


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """Exact number of parameters of ``Transformer(cfg)`` (``active``: per-token for MoE)."""
    total = cfg.vocab_size * cfg.dim  # token embedding
    if cfg.pos == "learned":
        total += cfg.seq_len * cfg.dim
    for layer in range(cfg.n_layers):
        total += block_params(cfg, layer, active)
    total += norm_params(cfg)
    if not cfg.tie_embeddings:
        total += cfg.vocab_size * cfg.dim
    return total + heads_params(cfg, active)


def matmul_params(cfg: ModelConfig, active: bool = True) -> int:
    """Parameters that take part in a matrix multiply per token (no embedding lookup, no
    norms), counting the output projection once even when tied."""
    total = cfg.vocab_size * cfg.dim  # output projection
    for layer in range(cfg.n_layers):
        total += attention_params(cfg) + ffn_params(cfg, layer, active)
    return total


def attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one layer's scores (q/k width) and weighted sum (v width),
    the whole s x s (4·s·d for plain heads)."""
    qk, v = registry.attention_of(cfg).widths(cfg)
    return 2 * seq_len * cfg.n_heads * (qk + v)


def window_keys(window: int, seq_len: int, causal: bool) -> float:
    """Keys per query a sliding-window layer scores: ``window`` (causal: the band's area
    s·w - w²/2 over s), where a full layer counts s (causal: s/2)."""
    return window - window * window / (2 * seq_len) if causal else float(window)


def chunk_keys(chunk: int, seq_len: int, causal: bool) -> float:
    """Keys per query a chunked layer scores: its chunks' squares (causal: triangles) over s."""
    n, rest = divmod(seq_len, chunk)
    area = n * chunk * chunk + rest * rest
    return area / (2 * seq_len) if causal else area / seq_len


def layers_attention_flops(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Forward FLOPs per token of every layer's attention scores and weighted sum: the whole
    s x s per layer (half with ``causal``), a sliding-window layer's band only, a chunked
    layer's chunks only."""
    specs = [registry.layer_attention(cfg, i) for i in range(cfg.n_layers)]
    keys = [window_keys(spec.window, seq_len, causal) if 0 < spec.window < seq_len
            else chunk_keys(spec.chunk, seq_len, causal) if 0 < spec.chunk < seq_len else None for spec in specs]
    local = [k for k in keys if k is not None]
    full = attention_flops(cfg, seq_len)
    attn = full * (cfg.n_layers - len(local))
    if causal:
        attn /= 2
    return attn + sum(full * k / seq_len for k in local)


def attention_share(cfg: ModelConfig, seq_len: int, causal: bool) -> float:
    """Every layer's attention work over that of as many full layers (1.0 without sliding
    windows or chunks): what the planner scales its per-layer attention core by."""
    full = attention_flops(cfg, seq_len) * cfg.n_layers
    return layers_attention_flops(cfg, seq_len, causal) / (full / 2 if causal else full)


def plain_layers(cfg: ModelConfig) -> bool:
    """Whether every layer is plain causal softmax(QK^T / sqrt(d)) attention: no sliding
    window, no chunks, no softmax scale of its own, no sinks (what context parallel's attention computes;
    a layer's own RoPE is applied before it)."""
    specs = (registry.layer_attention(cfg, i) for i in range(cfg.n_layers))
    return not any(spec.window or spec.scale or spec.sinks or spec.chunk for spec in specs)


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None, training: bool = True,
                    causal: bool = False) -> float:
    """Model FLOPs per token: 2 per multiply-add in every matmul, plus attention scores and
    the weighted sum (4·s·d per layer forward). Training is 3× forward (no recompute: model
    FLOPs, as MFU is defined). ``causal=True`` counts only the unmasked half of attention;
    the default counts it whole, the convention of PaLM/Megatron MFU figures."""
    s = seq_len or cfg.seq_len
    attn = layers_attention_flops(cfg, s, causal)  # (sliding-window layers: their band)
    forward = 2 * matmul_params(cfg, active=True) + attn
    if training:  # heads that run in training only (multi-token prediction)
        forward += sum(h.training_flops(cfg, s, causal) for h in registry.heads() if h.active(cfg))
    return float(3 * forward if training else forward)
