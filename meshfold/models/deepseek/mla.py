"""Multi-head latent attention (DeepSeek-V2/V3), free of parallelism.

Per token x (dim wide), H heads, each q/k head = a position-free part (``mla_nope_dim``)
and a decoupled RoPE part (``mla_rope_dim``):

    q        = W_q x                        or   W_qb RMSNorm(W_qa x)    (low-rank q, ``mla_q_rank``)
    [c, k_r] = W_kva x                      c: the compressed kv (``mla_kv_rank``), k_r: one RoPE key
    [k_n, v] = W_kvb RMSNorm(c)             per head: k_n (nope) and v (``mla_v_dim``)
    k        = [k_n ; RoPE(k_r)]            the RoPE key shared by all heads
    q        = [q_n ; RoPE(q_r)]
    out      = W_o softmax(q k^T * scale) v     scale = (nope + rope)^-1/2 * mscale^2 (yarn)

What a kv cache or context parallel moves per token is ``latent`` = [RMSNorm(c) ; RoPE(k_r)]
(kv_rank + rope_dim values), not the expanded keys and values: ``forward`` is split into
``query``, ``latent``, ``expand`` (the latent -> per-head k, v) and ``attend``, so context
parallel can override ``attend`` from outside (parallel/cp/mla.py). ``build_attention`` is the
registry's builder (``models/registry.py`` ``AttentionKind``).

RoPE rotates adjacent feature pairs (as meshfold's ``apply_rotary`` does and as DeepSeek's
own complex-number RoPE does), so DeepSeek weights import without a permutation. The norm
class, the rotary function and the core attention come from ``models/llama.py`` (passed in,
so this module imports nothing of it); the core stays a named submodule that context
parallel can swap, and the heads are read from the width, so a tensor-parallel split of
the heads needs no change here.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from meshfold.models.config import ModelConfig


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn softmax correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """The attention's softmax scale: 1/sqrt(q/k head width), times mscale^2 under yarn."""
    scale = (cfg.mla_nope_dim + cfg.mla_rope_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def build_attention(cfg: ModelConfig, layer_id: int, parts) -> MLAttention:
    """The block for the shared decoder; its q/kv latent norms use eps 1e-6 whatever norm_eps
    is, as DeepSeek's do."""
    return MLAttention(cfg, lambda d: parts.rms_norm(d, 1e-6), parts.core(), parts.rotary)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, norm: Callable[[int], nn.Module], core: nn.Module,
                 rotary: Callable[..., torch.Tensor]):
        super().__init__()
        H = cfg.n_heads
        self.nope, self.rope, self.v_dim, self.kv_rank = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim, cfg.mla_kv_rank
        qk = self.nope + self.rope
        if cfg.mla_q_rank:
            self.wq = None
            self.wq_a = nn.Linear(cfg.dim, cfg.mla_q_rank, bias=False)
            self.q_a_norm = norm(cfg.mla_q_rank)
            self.wq_b = nn.Linear(cfg.mla_q_rank, H * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, H * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = norm(self.kv_rank)
        self.wkv_b = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, cfg.dim, bias=False)
        self.core = core
        self.rotary = rotary
        # The core divides by sqrt(q/k width); q carries the rest of the model's scale.
        self.q_scale = mla_softmax_scale(cfg) * math.sqrt(qk)

    def forward(self, x, rope, positions=None, doc_ids=None):
        b, s, _ = x.shape
        out = self.attend(self.query(x, rope), self.latent(x, rope), positions, doc_ids)
        return self.wo(out.reshape(b, s, -1))

    def query(self, x, rope):
        """[b, s, heads, nope + rope]: RoPE'd, carrying the model's share of the softmax scale."""
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        return self.rope_query(q, rope)

    def rope_query(self, q, rope):
        """The projected q [b, s, heads x (nope + rope)] as [b, s, heads, nope + rope]: its RoPE
        part rotated, times the model's share of the softmax scale."""
        b, s, _ = q.shape
        q_nope, q_rope = q.view(b, s, -1, self.nope + self.rope).split([self.nope, self.rope], -1)
        cos, sin = rope
        q = torch.cat([q_nope, self.rotary(q_rope, cos, sin)], -1)
        return q * self.q_scale if self.q_scale != 1.0 else q

    def latent(self, x, rope):
        """The per-token kv, [b, s, kv_rank + rope]: [RMSNorm(c) ; RoPE(k_r)]."""
        c, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], -1)
        return self.rope_latent(self.kv_a_norm(c), k_rope, rope)

    def rope_latent(self, c, k_rope, rope):
        """[c ; RoPE(k_r)] from the normed compressed kv and the unrotated RoPE key."""
        cos, sin = rope
        k_rope = self.rotary(k_rope.unsqueeze(2), cos, sin).squeeze(2)
        return torch.cat([c, k_rope.to(c.dtype)], -1)

    def expand(self, latent):
        """latent -> per-head k [b, s, heads, nope + rope] and v [b, s, heads, v_dim]; the
        only weight it uses is ``wkv_b``."""
        b, s, _ = latent.shape
        c, k_rope = latent.split([self.kv_rank, self.rope], -1)
        kv = self.up_kv(c).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k_rope = k_rope.to(k_nope.dtype).unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)
        return torch.cat([k_nope, k_rope], -1), v

    def up_kv(self, c):
        """wkv_b: the normed compressed kv -> every head's [k_nope ; v]."""
        return self.wkv_b(c)

    def attend(self, q, latent, positions=None, doc_ids=None):
        """Attention output [b, s, heads, v_dim] of q against the expanded latent."""
        k, v = self.expand(latent)
        return self.core(q, k, v, positions=positions, doc_ids=doc_ids)  # (v narrower: the core pads it)
