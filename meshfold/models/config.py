"""``[model]``: the architecture's dataclass and the checks that need nothing but it.

``ModelConfig`` is composed of sections: the keys every decoder has (``CommonKeys``), the
shared MoE block's (``models/moe_config.py``) and each registered family's own
(``models/registry.py``: a family's ``sections``, e.g. DeepSeek's ``mla_*`` and ``mtp_*``).
The TOML keys stay flat (``model.<key>``); each section's checks live with it.

Checks that relate the model to the layout (heads over tp, seq_len over cp, layers over pp)
live in ``parallel/config.py``; ``config.validate`` runs both before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshfold.errors import ConfigError, divisors
from meshfold.models import registry
from meshfold.models.moe_config import CHOICES as MOE_CHOICES
from meshfold.models.moe_config import MoEKeys, check_moe


GATED_MLPS = ("swiglu", "geglu")


@dataclass
class CommonKeys:
    """The keys every decoder has (the dense Llama-style shape, its RoPE, GPT-3's switches)."""

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
    mlp: str = "swiglu"  # swiglu | geglu | gelu
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
    rope_truncate: bool = True  # yarn: the correction range rounded to whole dimensions (false: gpt-oss)
    rope_fraction: float = 1.0  # share of each head's features RoPE turns, the leading ones (partial RoPE: GLM)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def attention(self) -> str:
        """The attention block's kind, the key shared code looks its parts up by (model
        blocks, tp/cp plans, planner terms): ``gqa`` (multi-head and grouped-query), or a kind
        a family registers (``mla``, DeepSeek)."""
        return registry.attention_of(self).name

    @property
    def rope_dim(self) -> int:
        """Features of a head that RoPE rotates (the attention kind's; MLA: only the decoupled part)."""
        return registry.attention_of(self).rope_dim(self)

    @property
    def gated_mlp(self) -> bool:
        """w2(act(w1 x) * w3 x): SwiGLU (silu) or GeGLU (tanh GELU, Gemma); else w2(gelu(w1 x))."""
        return self.mlp in GATED_MLPS or self.mlp in registry.mlps()

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


@dataclass
class ModelConfig(*reversed(registry.sections()), MoEKeys, CommonKeys):
    """``[model]``: the common keys, then MoE's, then each registered family's sections (in
    registration order: the field order of dumps and manifests)."""


CHOICES: dict[str, tuple] = {
    "norm": ("rmsnorm", "layernorm", *registry.norms()),  # families may add norm variants
    "mlp": ("swiglu", "geglu", "gelu", *registry.mlps()),  # families may add gated activations
    "pos": ("rope", "learned"),
    **MOE_CHOICES,
    "rope_scaling": ("none", "linear", "llama3", "dynamic", "yarn"),
}


def validate(m: ModelConfig) -> None:
    """``[model]`` on its own: sizes, heads, the attention kind's keys, RoPE scaling, each
    family's keys, MoE. Raises ``ConfigError``."""
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
    if not 0.0 < m.rope_fraction <= 1.0:
        raise ConfigError(f"model.rope_fraction = {m.rope_fraction} must be in (0, 1] (the share of each head RoPE turns)")
    registry.attention_of(m).check(m)  # its own keys, and RoPE's even width
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
    for check in registry.checks():
        check(m)
    if m.mlp == "geglu" and m.moe_experts:
        raise ConfigError("model.mlp = 'geglu' has no MoE experts (they are SwiGLU or GELU); use model.mlp = "
                          "'swiglu' or model.moe_experts = 0")
    check_moe(m)
