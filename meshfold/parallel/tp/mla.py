"""Tensor parallel for multi-head latent attention (``models/deepseek/mla.py``), registered in
``parallel/tp/plan.py``'s ``ATTENTION_PLANS`` under ``"mla"``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from meshfold.models.deepseek.mla import MLAttention
from meshfold.parallel.tp.collectives import (
    COLUMN,
    REPLICATED,
    ROW,
    TensorParallelGroup,
    column_linears,
    local,
    tp_gemm,
    wire_dtype,
)
from meshfold.parallel.tp.placement import distribute, parallelize_norm, swap_class


class TensorParallelMLAttention(MLAttention):
    """Multi-head latent attention with its heads split over tp, as Megatron-Core lays it out:
    the down-projections (wq_a, wkv_a) and their norms are replicated and run on the tokens
    this rank holds (its sequence slice under sp); the small normed latent
    ``[c_q ; c_kv ; k_rope]`` then enters the tp region (sp: all-gather of the sequence,
    reduce-scatter backward; else ``f``), so what crosses the link a token is q_rank +
    kv_rank + rope_dim values (2,112 for DeepSeek-V3) instead of the model width (7,168);
    the up-projections (wq_b, or a full-rank wq, and wkv_b) are column-parallel by heads, wo
    row-parallel. Each rank's latent gradient covers its own heads: the entry's backward
    sums it over tp, so the down-projections see the whole gradient. Under sp their weights
    (and the latent norms') see one sequence slice each and are summed over tp per backward
    (``replicated``), like the block norms. Every linear's GEMM runs through ``tp_gemm``
    (fp8 ones with tp-wide scales, ``parallel/fp8/tp.py``; the down-projections as
    ``REPLICATED``: under sp their tokens are split)."""

    tp: TensorParallelGroup

    def forward(self, x, rope, positions=None, doc_ids=None):
        tp = self.tp
        latent = []
        if self.wq is None:  # low-rank q: its latent travels with the kv latent
            latent.append(self.q_a_norm(tp_gemm(self.wq_a, tp, REPLICATED)(x, tp.replicated(self.wq_a.weight))))
        c, k_rope = tp_gemm(self.wkv_a, tp, REPLICATED)(x, tp.replicated(self.wkv_a.weight)).split(
            [self.kv_rank, self.rope], -1)
        latent += [self.kv_a_norm(c), k_rope]
        wire = wire_dtype(x)
        if wire is not None:  # the up-projections compute in it anyway: gather the latent in it
            latent = [t.to(wire) for t in latent]
        parts = tp.enter(torch.cat(latent, -1)).split([t.shape[-1] for t in latent], -1)
        if self.wq is None:
            q = tp_gemm(self.wq_b, tp, COLUMN)(parts[0], local(self.wq_b.weight))
        else:  # a full-rank q projection: a column-parallel linear of the block input
            (q,) = column_linears(tp, x, [local(self.wq.weight)], [None], [tp_gemm(self.wq, tp, COLUMN)])
        # RoPE on the whole sequence, after the gather (rope covers it)
        out = self.attend(self.rope_query(q, rope), self.rope_latent(*parts[-2:], rope), positions, doc_ids)
        return tp.leave(tp_gemm(self.wo, tp, ROW)(out.flatten(2), local(self.wo.weight)))

    def up_kv(self, c):  # this rank's rows of wkv_b: its heads
        return tp_gemm(self.wkv_b, self.tp, COLUMN)(c, local(self.wkv_b.weight))


def parallelize_mla(attn: MLAttention, tp: TensorParallelGroup) -> None:
    low_rank_q = attn.wq is None
    # rows grouped by head: a Shard(0) splits the heads
    for lin in ((attn.wq_b,) if low_rank_q else (attn.wq,)) + (attn.wkv_b,):
        distribute(lin, "weight", tp, Shard(0))
    for lin in ((attn.wq_a,) if low_rank_q else ()) + (attn.wkv_a,):
        distribute(lin, "weight", tp, Replicate())
    for norm in ((attn.q_a_norm,) if low_rank_q else ()) + (attn.kv_a_norm,):
        parallelize_norm(norm, tp)
    distribute(attn.wo, "weight", tp, Shard(1))
    swap_class(attn, TensorParallelMLAttention, tp=tp)
