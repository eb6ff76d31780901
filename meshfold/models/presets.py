"""Shipped model shapes, exact parameter counts and FLOPs per token.

The counts are computed from the shape (not looked up), and tests check them against the
published totals (e.g. Llama 3 8B = 8,030,261,248) and against ``sum(p.numel())`` of a
built model. The planner and the MFU metric both use ``flops_per_token``.
"""

from __future__ import annotations

import dataclasses

from meshfold.errors import ConfigError
from meshfold.models.config import ModelConfig

_LLAMA3 = dict(rope_theta=500000.0, vocab_size=128256, norm_eps=1e-5)
_LLAMA31_ROPE = dict(max_position=131072, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0, rope_original_seq_len=8192)
_QWEN2 = dict(vocab_size=151936, seq_len=4096, max_position=32768, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True)
_DEEPSEEK_YARN = dict(max_position=163840, rope_scaling="yarn", rope_factor=40.0, rope_original_seq_len=4096)
_QWEN3 = dict(vocab_size=151936, seq_len=4096, max_position=40960, rope_theta=1e6, norm_eps=1e-6, attn_head_dim=128,
              qk_norm=True)

PRESETS: dict[str, dict] = {
    # Tiny shapes for tests, the demo and CPU benchmarks.
    "debug": dict(dim=64, n_layers=2, n_heads=4, vocab_size=512, seq_len=64),
    "llama-20m": dict(dim=384, n_layers=8, n_heads=6, n_kv_heads=2, vocab_size=8192, seq_len=256),
    "llama-125m": dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, seq_len=1024),
    # Published shapes.
    "llama2-7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32000, seq_len=4096),
    "llama3-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, seq_len=8192,
                      tie_embeddings=True, **_LLAMA3),
    "llama3-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, seq_len=8192,
                      tie_embeddings=True, **_LLAMA3),
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, seq_len=8192, **_LLAMA3),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, seq_len=8192, **_LLAMA3),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, seq_len=8192,
                        **_LLAMA3),
    # Hugging Face families for continued pre-training (docs/hf.md); seq_len is a training
    # default, the RoPE scaling is the published one. Llama 3.1 / 3.2 (llama3 RoPE scaling).
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, seq_len=8192,
                        **_LLAMA3, **_LLAMA31_ROPE),
    "llama3.1-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, seq_len=8192,
                         **_LLAMA3, **_LLAMA31_ROPE),
    "llama3.1-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, seq_len=8192,
                          **_LLAMA3, **_LLAMA31_ROPE),
    "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, seq_len=8192,
                        tie_embeddings=True, **_LLAMA3, **dict(_LLAMA31_ROPE, rope_factor=32.0)),
    "llama3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, seq_len=8192,
                        tie_embeddings=True, **_LLAMA3, **dict(_LLAMA31_ROPE, rope_factor=32.0)),
    # Qwen2.5 (biases on q/k/v only; the small ones tie their embeddings).
    "qwen2.5-0.5b": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, tie_embeddings=True,
                         **_QWEN2),
    "qwen2.5-1.5b": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960, tie_embeddings=True,
                         **_QWEN2),
    "qwen2.5-3b": dict(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_dim=11008, tie_embeddings=True,
                       **_QWEN2),
    "qwen2.5-7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                       **dict(_QWEN2, vocab_size=152064)),
    # Qwen3 (per-head q/k RMSNorm, head_dim 128 whatever dim / n_heads is).
    "qwen3-0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True, **_QWEN3),
    "qwen3-1.7b": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_embeddings=True, **_QWEN3),
    "qwen3-4b": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_embeddings=True, **_QWEN3),
    "qwen3-8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, **_QWEN3),
    # Mistral 7B v0.3 (no sliding window; v0.1's 4096-token window is not supported).
    "mistral-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32768,
                       seq_len=8192, max_position=32768, rope_theta=1e6),
    # GPT-3 (Brown et al. 2020): learned positions, LayerNorm, GELU MLP, biases, tied embeddings.
    "gpt3-175b": dict(dim=12288, n_layers=96, n_heads=96, vocab_size=50257, seq_len=2048, norm="layernorm",
                      mlp="gelu", bias=True, pos="learned", tie_embeddings=True),
    # Mixture of experts.
    # Hugging Face MoE families (docs/hf.md, docs/moe.md); counts equal transformers' models.
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                         seq_len=4096, max_position=32768, rope_theta=1e6, moe_experts=8, moe_topk=2,
                         moe_aux_loss_coef=0.02),
    "mixtral-8x22b": dict(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384, vocab_size=32768,
                          seq_len=4096, max_position=65536, rope_theta=1e6, moe_experts=8, moe_topk=2,
                          moe_aux_loss_coef=0.02),
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, moe_ffn_dim=768,
                          moe_experts=128, moe_topk=8, moe_aux_loss_coef=0.001, **_QWEN3),
    "qwen3-235b-a22b": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288, moe_ffn_dim=1536,
                            moe_experts=128, moe_topk=8, moe_aux_loss_coef=0.001, **_QWEN3),
    # DeepSeek: multi-head latent attention, shared + fine-grained routed experts, dense first layers.
    "deepseek-v2-lite": dict(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, ffn_dim=10944, vocab_size=102400, seq_len=4096,
                             norm_eps=1e-6, moe_experts=64, moe_topk=6, moe_ffn_dim=1408, moe_shared_experts=2,
                             moe_first_dense=1, moe_norm_topk=False, mla_kv_rank=512, **_DEEPSEEK_YARN,
                             rope_attention_factor=1.0, rope_mscale_all_dim=0.707),
    "deepseek-v3": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432, vocab_size=129280, seq_len=4096,
                        norm_eps=1e-6, moe_experts=256, moe_topk=8, moe_ffn_dim=2048, moe_shared_experts=1,
                        moe_first_dense=3, moe_router="sigmoid", moe_bias_balance=True, moe_aux_loss_coef=0.0,
                        moe_groups=8, moe_topk_groups=4, moe_routed_scale=2.5, mla_kv_rank=512, mla_q_rank=1536,
                        **_DEEPSEEK_YARN, rope_attention_factor=1.0, rope_mscale_all_dim=1.0),
    # DeepSeek-MoE-16B-like fine-grained experts: 64 routed (top-6) + 2 shared, small expert width.
    "deepseek-moe-16b": dict(dim=2048, n_layers=28, n_heads=16, ffn_dim=10944, vocab_size=102400,
                             seq_len=4096, moe_experts=64, moe_topk=6, moe_ffn_dim=1408,
                             moe_shared_experts=2, moe_first_dense=1, moe_norm_topk=False),
    "moe-debug": dict(dim=64, n_layers=2, n_heads=4, vocab_size=512, seq_len=64, moe_experts=4, moe_topk=2),
}


def preset_values(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError(f"model.preset = {name!r} is not a shipped shape; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name], preset=name)


def preset(name: str, **overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig(**preset_values(name)), **overrides)


# --------------------------------------------------------------------------- counting


def _norm_params(cfg: ModelConfig) -> int:
    return cfg.dim * (2 if (cfg.norm == "layernorm" and cfg.bias) else 1)


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def mla_params(cfg: ModelConfig) -> int:
    """Multi-head latent attention (models/mla.py): q (full or low-rank with its norm), the
    kv compression with its norm and RoPE key, the kv expansion, the output."""
    H, qk = cfg.n_heads, cfg.mla_nope_dim + cfg.mla_rope_dim
    q = cfg.dim * H * qk if not cfg.mla_q_rank else cfg.dim * cfg.mla_q_rank + cfg.mla_q_rank * (1 + H * qk)
    kv = cfg.dim * (cfg.mla_kv_rank + cfg.mla_rope_dim) + cfg.mla_kv_rank * (1 + H * (cfg.mla_nope_dim + cfg.mla_v_dim))
    return q + kv + H * cfg.mla_v_dim * cfg.dim


def attention_params(cfg: ModelConfig) -> int:
    if cfg.mla:
        return mla_params(cfg)
    hd = cfg.head_dim
    qkv_bias = cfg.bias or cfg.qkv_bias
    return (
        _linear(cfg.dim, cfg.n_heads * hd, qkv_bias)
        + 2 * _linear(cfg.dim, cfg.kv_heads * hd, qkv_bias)
        + _linear(cfg.n_heads * hd, cfg.dim, cfg.bias)
        + (2 * hd if cfg.qk_norm else 0)
    )


def mlp_params(cfg: ModelConfig, hidden: int) -> int:
    mats = 3 if cfg.mlp == "swiglu" else 2
    return mats * cfg.dim * hidden + ((2 * hidden if cfg.mlp == "swiglu" else hidden) + cfg.dim if cfg.bias else 0)


def ffn_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Feed-forward parameters of one layer; ``active`` counts only what one token uses."""
    if not cfg.is_moe_layer(layer):
        return mlp_params(cfg, cfg.hidden_dim)
    routed = cfg.moe_topk if active else cfg.moe_experts
    # Routed experts carry no biases (models/moe.py); the shared experts are one MLP of
    # width moe_shared_experts * expert_dim, with the model's bias setting.
    expert = mlp_params(dataclasses.replace(cfg, bias=False), cfg.expert_dim)
    shared = mlp_params(cfg, cfg.moe_shared_experts * cfg.expert_dim) if cfg.moe_shared_experts else 0
    router = cfg.dim * cfg.moe_experts
    return router + routed * expert + shared


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """Exact number of parameters of ``Transformer(cfg)`` (``active``: per-token for MoE)."""
    total = cfg.vocab_size * cfg.dim  # token embedding
    if cfg.pos == "learned":
        total += cfg.seq_len * cfg.dim
    for layer in range(cfg.n_layers):
        total += attention_params(cfg) + ffn_params(cfg, layer, active) + 2 * _norm_params(cfg)
    total += _norm_params(cfg)
    if not cfg.tie_embeddings:
        total += cfg.vocab_size * cfg.dim
    return total + mtp_params(cfg, active)


def mtp_params(cfg: ModelConfig, active: bool = False) -> int:
    """The multi-token prediction depths (models/mtp.py): each a block (layer index
    n_layers + k), enorm, hnorm, its output norm and eh_proj [2 dim -> dim]; the embedding
    and output head are the model's. 0 without MTP."""
    total = 0
    for k in range(cfg.mtp_depth):
        layer = cfg.n_layers + k
        total += (attention_params(cfg) + ffn_params(cfg, layer, active) + 5 * _norm_params(cfg)
                  + 2 * cfg.dim * cfg.dim)
    return total


def matmul_params(cfg: ModelConfig, active: bool = True) -> int:
    """Parameters that take part in a matrix multiply per token (no embedding lookup, no
    norms), counting the output projection once even when tied."""
    total = cfg.vocab_size * cfg.dim  # output projection
    for layer in range(cfg.n_layers):
        total += attention_params(cfg) + ffn_params(cfg, layer, active)
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None, training: bool = True,
                    causal: bool = False) -> float:
    """Model FLOPs per token: 2 per multiply-add in every matmul, plus attention scores and
    the weighted sum (4·s·d per layer forward). Training is 3× forward (no recompute: model
    FLOPs, as MFU is defined). ``causal=True`` counts only the unmasked half of attention;
    the default counts it whole, the convention of PaLM/Megatron MFU figures."""
    s = seq_len or cfg.seq_len
    # scores (q/k width) and the weighted sum (v width); MLA's heads differ in the two
    qk, v = (cfg.mla_nope_dim + cfg.mla_rope_dim, cfg.mla_v_dim) if cfg.mla else (cfg.head_dim, cfg.head_dim)
    attn = 2 * s * cfg.n_heads * (qk + v) * cfg.n_layers
    if causal:
        attn /= 2
    forward = 2 * matmul_params(cfg, active=True) + attn
    if training and cfg.mtp_depth:  # the depths run in training only: block, eh_proj, output head each
        depths = sum(attention_params(cfg) + ffn_params(cfg, cfg.n_layers + k, True) + 2 * cfg.dim * cfg.dim
                     + cfg.vocab_size * cfg.dim for k in range(cfg.mtp_depth))
        forward += 2 * depths + attn / cfg.n_layers * cfg.mtp_depth
    return float(3 * forward if training else forward)
