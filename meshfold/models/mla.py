"""Multi-head latent attention (DeepSeek-V2/V3), free of parallelism.

Per token x (dim wide), H heads, each q/k head = a position-free part (``mla_nope_dim``)
and a decoupled RoPE part (``mla_rope_dim``):

    q        = W_q x                        or   W_qb RMSNorm(W_qa x)    (low-rank q, ``mla_q_rank``)
    [c, k_r] = W_kva x                      c: the compressed kv (``mla_kv_rank``), k_r: one RoPE key
    [k_n, v] = W_kvb RMSNorm(c)             per head: k_n (nope) and v (``mla_v_dim``)
    k        = [k_n ; RoPE(k_r)]            the RoPE key shared by all heads
    q        = [q_n ; RoPE(q_r)]
    out      = W_o softmax(q k^T * scale) v     scale = (nope + rope)^-1/2 * mscale^2 (yarn)

What a kv cache or context parallel would move per token is ``c`` and ``k_r``
(kv_rank + rope_dim values), not the expanded keys and values.

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
import torch.nn.functional as F
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
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(b, s, -1, self.nope + self.rope).split([self.nope, self.rope], -1)
        c, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], -1)
        kv = self.wkv_b(self.kv_a_norm(c)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        cos, sin = rope
        q_rope = self.rotary(q_rope, cos, sin)
        k_rope = self.rotary(k_rope.unsqueeze(2), cos, sin).expand(-1, -1, k_nope.shape[2], -1)
        q = torch.cat([q_nope, q_rope], -1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_rope], -1)
        out = attend_padded(self.core, q, k, v, positions, doc_ids)
        return self.wo(out.reshape(b, s, -1))


def attend_padded(core: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions, doc_ids):
    """``core(q, k, v)`` with v zero-padded to the q/k head width and the output cut back:
    the fused flash kernels take one head width for q, k and v (PyTorch's CPU and CUDA flash
    both refuse v narrower than q/k, and the fallback materializes the s x s scores in fp32),
    as Hugging Face pads for FlashAttention-2."""
    width = v.shape[-1]
    if width == q.shape[-1]:
        return core(q, k, v, positions=positions, doc_ids=doc_ids)
    v = F.pad(v, (0, q.shape[-1] - width))
    return core(q, k, v, positions=positions, doc_ids=doc_ids)[..., :width]
