"""DeepSeek's ``[model]`` keys and their checks: multi-head latent attention (``mla_*``) and
multi-token prediction (``mtp_*``). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from meshfold.errors import ConfigError


@dataclass
class MLAKeys:
    """Multi-head latent attention (DeepSeek-V2/V3, ``deepseek/mla.py``): on when mla_kv_rank > 0."""

    mla_kv_rank: int = 0  # compressed kv width (kv_lora_rank)
    mla_q_rank: int = 0  # compressed q width (q_lora_rank); 0 = one full q projection
    mla_rope_dim: int = 64  # the decoupled RoPE part of each q/k head (qk_rope_head_dim)
    mla_nope_dim: int = 128  # the position-free part of each q/k head (qk_nope_head_dim)
    mla_v_dim: int = 128  # each head's value width (v_head_dim)
    rope_mscale_all_dim: float = 0.0  # yarn + MLA: softmax scale times mscale(factor, this)^2 (DeepSeek)

    @property
    def mla(self) -> bool:
        return self.mla_kv_rank > 0


@dataclass
class MTPKeys:
    """Multi-token prediction (DeepSeek-V3, ``deepseek/mtp.py``): mtp_depth sequential modules
    after the last layer, module k predicting token i+k+1; trained with mtp_loss_weight /
    mtp_depth times the sum of their losses. 0 = off."""

    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3


def check_mla(m) -> None:
    """The latent attention kind's keys (run when ``mla_kv_rank > 0``)."""
    for key in ("mla_rope_dim", "mla_nope_dim", "mla_v_dim"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key} must be positive with multi-head latent attention, got {getattr(m, key)}")
    if m.mla_q_rank < 0:
        raise ConfigError(f"model.mla_q_rank must be >= 0 (0 = full q projection), got {m.mla_q_rank}")
    if m.qk_norm or m.qkv_bias or m.bias or m.pos != "rope":
        raise ConfigError("model.mla_kv_rank > 0 (multi-head latent attention) goes with rope, without "
                          "model.qk_norm, model.qkv_bias or model.bias")
    if m.mla_rope_dim % 2:
        raise ConfigError(f"rotary embeddings need an even model.mla_rope_dim, got {m.mla_rope_dim}")


def check_mtp(m) -> None:
    if m.mtp_depth < 0:
        raise ConfigError(f"model.mtp_depth must be >= 0 (0 = no multi-token prediction), got {m.mtp_depth}")
    if m.mtp_depth and not m.mtp_depth < m.seq_len - 1:
        raise ConfigError(f"model.mtp_depth = {m.mtp_depth} leaves no target in a sequence of model.seq_len = "
                          f"{m.seq_len}; it must be below seq_len - 1")
    if m.mtp_loss_weight < 0:
        raise ConfigError(f"model.mtp_loss_weight must be >= 0, got {m.mtp_loss_weight}")
