"""``[model]``: the architecture's dataclass and the checks that need nothing but it.

Checks that relate the model to the layout (heads over tp, seq_len over cp, layers over pp)
live in ``parallel/config.py``; ``config.validate`` runs both before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshfold.errors import ConfigError, divisors


@dataclass
class ModelConfig:
    preset: str = ""
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = same as n_heads (plain multi-head attention)
    ffn_dim: int = 0  # 0 = Llama's rule from dim
    vocab_size: int = 512
    seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    # Architecture switches so published non-Llama shapes (GPT-3) have exact counts.
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    mlp: str = "swiglu"  # swiglu | gelu
    bias: bool = False
    pos: str = "rope"  # rope | learned
    # Hugging Face families (Llama 3.x, Qwen 2/2.5/3, Mistral): docs/hf.md.
    max_position: int = 0  # the context the model is published for (HF max_position_embeddings); 0 = seq_len
    attn_head_dim: int = 0  # per-head width; 0 = dim / n_heads (Qwen3 sets it explicitly)
    qkv_bias: bool = False  # biases on the q/k/v projections only (Qwen2/2.5); `bias` puts them everywhere
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    rope_scaling: str = "none"  # none | linear | llama3 | dynamic | yarn
    rope_factor: float = 1.0
    rope_original_seq_len: int = 0  # the pre-training context the scaling stretches (original_max_position_embeddings)
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float = 0.0  # yarn: cos/sin scale; 0 = 0.1 ln(factor) + 1
    # Mixture of experts (0 experts = dense).
    moe_experts: int = 0
    moe_topk: int = 2
    moe_every: int = 1  # every k-th layer is MoE (1 = all)
    moe_ffn_dim: int = 0  # per-expert hidden size, 0 = ffn_dim
    moe_shared_experts: int = 0
    moe_router: str = "softmax"  # softmax | sigmoid
    moe_capacity_factor: float = 0.0  # 0 = dropless
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.0
    moe_bias_balance: bool = False  # aux-loss-free balancing via router bias
    moe_bias_update_rate: float = 1e-3
    moe_norm_topk: bool = True  # softmax router: renormalise the k gates to sum 1 (Mixtral); sigmoid always does
    moe_first_dense: int = 0  # leading dense layers before the first MoE layer (DeepSeek-MoE: 1)
    moe_dense_layers: list[int] = field(default_factory=list)  # further dense layers (Qwen3-MoE mlp_only_layers)
    # Group-limited routing (DeepSeek-V2/V3): experts in moe_groups equal groups, a token picks
    # the moe_topk_groups best groups first, then its top-k experts inside them. 0 = off.
    moe_groups: int = 0
    moe_topk_groups: int = 0
    moe_routed_scale: float = 1.0  # routed experts' gates times this (routed_scaling_factor)
    moe_seq_aux_loss_coef: float = 0.0  # DeepSeek-V3 sequence-wise balance loss (per sequence)
    # Multi-head latent attention (DeepSeek-V2/V3, models/mla.py): on when mla_kv_rank > 0.
    mla_kv_rank: int = 0  # compressed kv width (kv_lora_rank)
    mla_q_rank: int = 0  # compressed q width (q_lora_rank); 0 = one full q projection
    mla_rope_dim: int = 64  # the decoupled RoPE part of each q/k head (qk_rope_head_dim)
    mla_nope_dim: int = 128  # the position-free part of each q/k head (qk_nope_head_dim)
    mla_v_dim: int = 128  # each head's value width (v_head_dim)
    rope_mscale_all_dim: float = 0.0  # yarn + MLA: softmax scale times mscale(factor, this)^2 (DeepSeek)
    # Multi-token prediction (DeepSeek-V3, models/mtp.py): mtp_depth sequential modules after the
    # last layer, module k predicting token i+k+1; trained with mtp_loss_weight / mtp_depth times
    # the sum of their losses. 0 = off.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def mla(self) -> bool:
        return self.mla_kv_rank > 0

    @property
    def attention(self) -> str:
        """The attention block's kind, the key shared code looks its parts up by (model
        blocks, tp/cp plans, planner terms): ``gqa`` (multi-head and grouped-query) or ``mla``."""
        return "mla" if self.mla_kv_rank > 0 else "gqa"

    @property
    def rope_dim(self) -> int:
        """Features of a head that RoPE rotates (MLA: only the decoupled part)."""
        return self.mla_rope_dim if self.mla else self.head_dim

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.mlp == "gelu":
            return 4 * self.dim
        # Llama: 2/3 * 4d rounded up to a multiple of 256 (or 8 for tiny models).
        multiple = 256 if self.dim >= 1024 else 8
        hidden = int(2 * 4 * self.dim / 3)
        return multiple * math.ceil(hidden / multiple)

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.hidden_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (self.moe_experts > 0 and layer >= self.moe_first_dense and (layer + 1) % self.moe_every == 0
                and layer not in self.moe_dense_layers)


CHOICES: dict[str, tuple] = {
    "norm": ("rmsnorm", "layernorm"),
    "mlp": ("swiglu", "gelu"),
    "pos": ("rope", "learned"),
    "moe_router": ("softmax", "sigmoid"),
    "rope_scaling": ("none", "linear", "llama3", "dynamic", "yarn"),
}


def validate(m: ModelConfig) -> None:
    """``[model]`` on its own: sizes, heads, RoPE scaling, MoE. Raises ``ConfigError``."""
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "seq_len"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key} must be positive, got {getattr(m, key)}")
    if m.max_position < 0:
        raise ConfigError(f"model.max_position must be >= 0 (0 = seq_len), got {m.max_position}")
    if m.attn_head_dim < 0:
        raise ConfigError(f"model.attn_head_dim must be >= 0 (0 = dim / n_heads), got {m.attn_head_dim}")
    if m.dim % m.n_heads and not m.attn_head_dim:
        fits = [h for h in divisors(m.dim) if h <= 4 * m.n_heads][-3:]
        raise ConfigError(
            f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}; "
            f"n_heads could be one of {fits}"
        )
    if m.n_heads % m.kv_heads:
        raise ConfigError(
            f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.n_kv_heads}; "
            f"n_kv_heads could be one of {divisors(m.n_heads)}"
        )
    if m.mla:
        for key in ("mla_rope_dim", "mla_nope_dim", "mla_v_dim"):
            if getattr(m, key) <= 0:
                raise ConfigError(f"model.{key} must be positive with multi-head latent attention, got {getattr(m, key)}")
        if m.mla_q_rank < 0:
            raise ConfigError(f"model.mla_q_rank must be >= 0 (0 = full q projection), got {m.mla_q_rank}")
        if m.qk_norm or m.qkv_bias or m.bias or m.pos != "rope":
            raise ConfigError("model.mla_kv_rank > 0 (multi-head latent attention) goes with rope, without "
                              "model.qk_norm, model.qkv_bias or model.bias")
    if m.pos == "rope" and m.rope_dim % 2:
        if m.mla:
            raise ConfigError(f"rotary embeddings need an even model.mla_rope_dim, got {m.mla_rope_dim}")
        raise ConfigError(f"rotary embeddings need an even head dim; model.dim/model.n_heads = {m.head_dim}")
    if m.rope_scaling != "none":
        if m.pos != "rope":
            raise ConfigError(f"model.rope_scaling = {m.rope_scaling!r} needs model.pos = 'rope'")
        if m.rope_factor < 1.0:
            raise ConfigError(f"model.rope_factor = {m.rope_factor} must be >= 1 with model.rope_scaling")
        if m.rope_scaling in ("llama3", "dynamic", "yarn") and m.rope_original_seq_len <= 0:
            raise ConfigError(f"model.rope_scaling = {m.rope_scaling!r} needs model.rope_original_seq_len "
                              f"(the pre-training context, e.g. 8192 for Llama 3.1)")
        if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor = {m.rope_low_freq_factor}")
    if m.mtp_depth < 0:
        raise ConfigError(f"model.mtp_depth must be >= 0 (0 = no multi-token prediction), got {m.mtp_depth}")
    if m.mtp_depth and not m.mtp_depth < m.seq_len - 1:
        raise ConfigError(f"model.mtp_depth = {m.mtp_depth} leaves no target in a sequence of model.seq_len = "
                          f"{m.seq_len}; it must be below seq_len - 1")
    if m.mtp_loss_weight < 0:
        raise ConfigError(f"model.mtp_loss_weight must be >= 0, got {m.mtp_loss_weight}")
    if m.moe_experts:
        if not 1 <= m.moe_topk <= m.moe_experts:
            raise ConfigError(
                f"model.moe_topk = {m.moe_topk} must be between 1 and model.moe_experts = {m.moe_experts}"
            )
        if m.moe_every < 1:
            raise ConfigError(f"model.moe_every must be >= 1, got {m.moe_every}")
        if m.moe_first_dense < 0 or m.moe_first_dense >= m.n_layers:
            raise ConfigError(f"model.moe_first_dense = {m.moe_first_dense} must be between 0 and "
                              f"model.n_layers - 1 = {m.n_layers - 1}")
        if m.moe_groups:
            if m.moe_experts % m.moe_groups:
                raise ConfigError(f"model.moe_groups = {m.moe_groups} must divide model.moe_experts = {m.moe_experts}")
            if not 1 <= m.moe_topk_groups <= m.moe_groups:
                raise ConfigError(f"model.moe_topk_groups = {m.moe_topk_groups} must be between 1 and "
                                  f"model.moe_groups = {m.moe_groups}")
            if m.moe_topk > m.moe_topk_groups * (m.moe_experts // m.moe_groups):
                raise ConfigError(f"model.moe_topk = {m.moe_topk} exceeds the experts of model.moe_topk_groups = "
                                  f"{m.moe_topk_groups} groups")
        if any(not 0 <= i < m.n_layers for i in m.moe_dense_layers):
            raise ConfigError(f"model.moe_dense_layers = {m.moe_dense_layers} must be layer indices below "
                              f"model.n_layers = {m.n_layers}")
        if m.moe_seq_aux_loss_coef < 0:
            raise ConfigError(f"model.moe_seq_aux_loss_coef must be >= 0, got {m.moe_seq_aux_loss_coef}")
        if m.moe_capacity_factor < 0:
            raise ConfigError(f"model.moe_capacity_factor must be >= 0 (0 = dropless), got {m.moe_capacity_factor}")
