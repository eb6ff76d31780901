"""Vocabulary-parallel cross-entropy (Megatron-LM): the loss over logits split by vocabulary
across tp ranks, without ever gathering a full row of logits on one rank.

For token t with logits split as z = [z^(0) | ... | z^(tp-1)] and label y:

    m     = max_r max_j z^(r)_j                       (all-reduce MAX over tp)
    S     = sum_r sum_j exp(z^(r)_j - m)              (all-reduce SUM over tp)
    z_y   = the one rank's z^(r)_{y - start_r}, 0 elsewhere   (same all-reduce SUM)
    loss  = log S + m - z_y

and in backward each rank forms its own slice of softmax(z) - onehot(y) with no
communication. Padding columns (vocabulary rounded up to a multiple of tp) arrive as -inf
from ``VocabParallelOutput`` and so contribute exp(-inf) = 0 to S and 0 to the gradient.
Returns the *sum* of token losses (labels equal to IGNORE_INDEX excluded), the same value
on every tp rank, like ``trainer.cross_entropy_sum``.
"""

from __future__ import annotations

import math

import torch

from meshfold.data.dataset import IGNORE_INDEX
from meshfold.parallel.tensor import TensorParallelGroup


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, tp):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        z = logits.detach().flatten(0, -2).to(dtype)
        labels = labels.flatten()
        chunk = z.shape[-1]
        # Global max (a constant shift, so no gradient flows through it).
        zmax = z.max(dim=-1).values
        tp.all_reduce_(zmax, op="max")
        z = z - zmax.unsqueeze(-1)
        exp = z.exp()
        idx = labels - vocab_start
        mine = (idx >= 0) & (idx < chunk) & (labels != IGNORE_INDEX)
        idx = idx.masked_fill(~mine, 0)
        target = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([exp.sum(-1), target])
        tp.all_reduce_(sums)
        sumexp, target = sums
        valid = labels != IGNORE_INDEX
        loss = (sumexp.log() - target).masked_fill(~valid, 0.0).sum()
        softmax = exp.div_(sumexp.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, mine, valid)
        ctx.shape, ctx.in_dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine, valid = ctx.saved_tensors
        # - onehot(y) on the rank owning y; a scatter, not boolean indexing (no host sync).
        g = softmax.scatter_add(-1, idx.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        g = g * (valid.to(g.dtype) * grad.to(g.dtype)).unsqueeze(-1)
        return g.to(ctx.in_dtype).view(ctx.shape), None, None, None


class VocabParallelCrossEntropy:
    """``loss_fn(logits, labels) -> sum of token losses`` for vocabulary-parallel logits
    ([b, s, chunk] on each tp rank, rank r holding vocabulary ids [r*chunk, (r+1)*chunk))."""

    def __init__(self, tp: TensorParallelGroup, vocab_size: int):
        self.tp = tp
        self.chunk = math.ceil(vocab_size / tp.size)
        self.vocab_start = tp.rank * self.chunk

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _VocabParallelCE.apply(logits, labels, self.vocab_start, self.tp)


def vocab_parallel_loss(dims, cfg) -> VocabParallelCrossEntropy:
    return VocabParallelCrossEntropy(TensorParallelGroup.from_dims(dims), cfg.model.vocab_size)
