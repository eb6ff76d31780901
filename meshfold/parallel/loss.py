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
on every tp rank, like ``cross_entropy_sum`` (the same computation with the whole
vocabulary on one rank). Both run over chunks of tokens, so no fp32 copy of the whole
[tokens, vocab] logits is ever made: the softmax is recomputed per chunk in backward from
each token's log-sum-exp.
"""

from __future__ import annotations

import math

import torch

from meshfold.data.dataset import IGNORE_INDEX
from meshfold.models.deepseek.mtp import MTPOutput, shift_left
from meshfold.parallel.facts.sizes import chunk_elements as device_chunk
from meshfold.parallel.tp.collectives import TensorParallelGroup


class _ChunkedCE(torch.autograd.Function):
    """Cross-entropy sum over token chunks: no fp32 copy of the whole [tokens, vocab] logits
    exists at any time, forward or backward. Saves the logits as they came (the compute
    dtype) and one fp32 number per token (the log-sum-exp); the backward recomputes each
    chunk's softmax from it, straight into the gradient when that is fp32 already. One
    chunk-sized fp32 scratch is reused by every chunk (on a host a fresh [tokens, vocab]
    buffer costs its page faults). Forward and backward together beat torch's fused
    ``F.cross_entropy``, which keeps a whole log-softmax (2,048 x 8,192 fp32 on this CPU,
    host-sized chunks: 58-61 ms against 90-94). ``tp`` None: the whole vocabulary is here."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, tp, chunk_elements):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        flat, labels = logits.detach().flatten(0, -2), labels.flatten()
        n, width = flat.shape
        rows = max(1, min(n, chunk_elements // max(1, width)))
        chunks = [slice(a, min(a + rows, n)) for a in range(0, n, rows)]
        # Global max per token (a constant shift: no gradient flows through it); a max is
        # exact in any dtype, so it is taken before the upcast.
        zmax = flat.amax(-1).to(dtype)
        if tp is not None:
            tp.all_reduce_(zmax, op="max")
        idx = labels - vocab_start
        mine = (idx >= 0) & (idx < width) & (labels != IGNORE_INDEX)
        idx = idx.masked_fill(~mine, 0)
        sums = torch.empty(2, n, dtype=dtype, device=flat.device)
        torch.sub(flat.gather(-1, idx.unsqueeze(-1)).squeeze(-1), zmax, out=sums[1])
        sums[1].masked_fill_(~mine, 0.0)
        scratch = torch.empty(rows, width, dtype=dtype, device=flat.device)
        for c in chunks:
            z = scratch[: c.stop - c.start]
            torch.sub(flat[c], zmax[c].unsqueeze(-1), out=z)
            torch.sum(z.exp_(), -1, out=sums[0, c])
        if tp is not None:
            tp.all_reduce_(sums)
        sumexp, target = sums
        valid = labels != IGNORE_INDEX
        logsum = sumexp.log()
        loss = (logsum - target).masked_fill(~valid, 0.0).sum()
        ctx.save_for_backward(logits, idx, mine, valid, zmax + logsum)
        ctx.chunks, ctx.rows = chunks, rows
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, idx, mine, valid, lse = ctx.saved_tensors
        flat = logits.detach().flatten(0, -2)
        dtype = lse.dtype
        out = torch.empty_like(flat)
        scale = valid.to(dtype) * grad.to(dtype)
        onehot = -mine.to(dtype)
        in_place = out.dtype == dtype
        scratch = None if in_place else torch.empty(ctx.rows, flat.shape[-1], dtype=dtype, device=flat.device)
        for c in ctx.chunks:
            # softmax(z) - onehot(y) on the rank owning y: a scatter, not boolean indexing (no host sync).
            g = out[c] if in_place else scratch[: c.stop - c.start]
            torch.sub(flat[c], lse[c].unsqueeze(-1), out=g)
            g.exp_().scatter_add_(-1, idx[c].unsqueeze(-1), onehot[c].unsqueeze(-1))
            g.mul_(scale[c].unsqueeze(-1))
            if not in_place:
                out[c] = g
        return out.view(logits.shape), None, None, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, chunk_elements: int | None = None) -> torch.Tensor:
    """Sum of token losses (labels equal to IGNORE_INDEX excluded), computed in at least fp32,
    chunked over tokens: ``_ChunkedCE`` with the whole vocabulary on this rank."""
    return _ChunkedCE.apply(logits, labels, 0, None, chunk_elements or device_chunk(logits.device.type))


class VocabParallelCrossEntropy:
    """``loss_fn(logits, labels) -> sum of token losses`` for vocabulary-parallel logits
    ([b, s, chunk] on each tp rank, rank r holding vocabulary ids [r*chunk, (r+1)*chunk))."""

    def __init__(self, tp: TensorParallelGroup, vocab_size: int):
        self.tp = tp
        self.chunk = math.ceil(vocab_size / tp.size)
        self.vocab_start = tp.rank * self.chunk

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _ChunkedCE.apply(logits, labels, self.vocab_start, self.tp, device_chunk(logits.device.type))


def vocab_parallel_loss(dims, cfg) -> VocabParallelCrossEntropy:
    return VocabParallelCrossEntropy(TensorParallelGroup.from_dims(dims), cfg.model.vocab_size)


# --------------------------------------------------------------------------- multi-token prediction


def mtp_labels(labels: torch.Tensor, k: int, valid: torch.Tensor) -> torch.Tensor:
    """Depth k's targets from the main labels: ``labels[i + k]`` where ``valid``."""
    return shift_left(labels, k, IGNORE_INDEX).masked_fill(~valid, IGNORE_INDEX)


class MTPLoss:
    """``loss_fn(out, labels)`` around the main token-loss sum ``base`` (one process or
    vocabulary-parallel: the depths' logits are computed, and split, like the main ones).

    On an ``MTPOutput`` it returns a tensor whose *value* is the main loss sum and whose
    *gradient* is that of main + weight / D * sum_k depth_k: the step engines report and
    scale it as they do any loss, and the depths' unweighted sum is kept (detached) in
    ``self.depth_sum`` for the ``mtp_loss`` metric (``pop``)."""

    def __init__(self, base, depth: int, weight: float):
        self.base, self.depth, self.weight = base, depth, weight
        self.depth_sum: torch.Tensor | None = None

    def __call__(self, out, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(out, MTPOutput):
            return self.base(out, labels)
        main = self.base(out.logits, labels)
        depths = sum(self.base(lg, mtp_labels(labels, k, v))
                     for k, (lg, v) in enumerate(zip(out.depth_logits, out.valid), start=1))
        total = depths.detach() if self.depth_sum is None else self.depth_sum + depths.detach()
        self.depth_sum = total
        extra = depths * (self.weight / self.depth)
        return main + (extra - extra.detach())  # value: exactly the main loss; gradient: both

    def pop(self) -> torch.Tensor | None:
        """This rank's sum over the step's micro-batches of the depths' token-loss sums
        (None if no depth ran here)."""
        out, self.depth_sum = self.depth_sum, None
        return out
