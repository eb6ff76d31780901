"""DeepSeek's blocks counted: latent attention's parameters and head widths, the multi-token
prediction depths' parameters and training FLOPs. Torch-free (the planner reads them)."""

from __future__ import annotations

from meshfold.models.counts import attention_flops, attention_params, ffn_params, norm_params


def mla_params(cfg) -> int:
    """Multi-head latent attention (deepseek/mla.py): q (full or low-rank with its norm), the
    kv compression with its norm and RoPE key, the kv expansion, the output."""
    H, qk = cfg.n_heads, cfg.mla_nope_dim + cfg.mla_rope_dim
    q = cfg.dim * H * qk if not cfg.mla_q_rank else cfg.dim * cfg.mla_q_rank + cfg.mla_q_rank * (1 + H * qk)
    kv = cfg.dim * (cfg.mla_kv_rank + cfg.mla_rope_dim) + cfg.mla_kv_rank * (1 + H * (cfg.mla_nope_dim + cfg.mla_v_dim))
    return q + kv + H * cfg.mla_v_dim * cfg.dim


def mla_widths(cfg) -> tuple[int, int]:
    """A head's q/k width (position-free + RoPE parts) and its value width: they differ."""
    return cfg.mla_nope_dim + cfg.mla_rope_dim, cfg.mla_v_dim


def mtp_params(cfg, active: bool = False) -> int:
    """The multi-token prediction depths (deepseek/mtp.py): each a block (layer index
    n_layers + k), enorm, hnorm, its output norm and eh_proj [2 dim -> dim]; the embedding
    and output head are the model's. 0 without MTP."""
    total = 0
    for k in range(cfg.mtp_depth):
        layer = cfg.n_layers + k
        total += (attention_params(cfg) + ffn_params(cfg, layer, active) + 5 * norm_params(cfg)
                  + 2 * cfg.dim * cfg.dim)
    return total


def mtp_training_flops(cfg, seq_len: int, causal: bool = False) -> float:
    """Forward FLOPs per token the depths add in training: block, eh_proj and output head each,
    and one layer's attention scores per depth."""
    depths = sum(attention_params(cfg) + ffn_params(cfg, cfg.n_layers + k, True) + 2 * cfg.dim * cfg.dim
                 + cfg.vocab_size * cfg.dim for k in range(cfg.mtp_depth))
    attn = attention_flops(cfg, seq_len) * cfg.n_layers
    if causal:
        attn /= 2
    return 2 * depths + attn / cfg.n_layers * cfg.mtp_depth
