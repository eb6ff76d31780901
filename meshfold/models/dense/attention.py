"""Grouped-query attention's terms (the block is ``models/llama.py``'s ``Attention``, which every
family without an attention of its own composes): parameters, head widths, its checks.
Torch-free."""

from __future__ import annotations

from meshfold.errors import ConfigError
from meshfold.models.counts import linear_params


def gqa_params(cfg) -> int:
    hd = cfg.head_dim
    qkv_bias = cfg.bias or cfg.qkv_bias
    return (
        linear_params(cfg.dim, cfg.n_heads * hd, qkv_bias)
        + 2 * linear_params(cfg.dim, cfg.kv_heads * hd, qkv_bias)
        + linear_params(cfg.n_heads * hd, cfg.dim, cfg.bias)
        + (2 * hd if cfg.qk_norm else 0)
    )


def gqa_widths(cfg) -> tuple[int, int]:
    return cfg.head_dim, cfg.head_dim


def gqa_rope_dim(cfg) -> int:
    """The leading features of each head RoPE turns (all of them unless ``rope_fraction`` < 1)."""
    return int(cfg.head_dim * cfg.rope_fraction)


def check_gqa(m) -> None:
    if m.pos == "rope" and m.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head dim; model.dim/model.n_heads = {m.head_dim}")
    if m.pos == "rope" and gqa_rope_dim(m) % 2:
        raise ConfigError(f"model.rope_fraction = {m.rope_fraction} turns {gqa_rope_dim(m)} of a head's "
                          f"{m.head_dim} features; RoPE needs an even number")
