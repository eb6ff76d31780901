"""The tensor-parallel layers: each a subclass of the model's layer that ``swap_class`` turns
it into in place (names, children and hooks stay), computing on this rank's DTensor pieces
with the collectives of ``collectives.py``. The layout table is ``parallel/tp/plan.py``'s."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models.llama import Attention, FeedForward, RMSNorm
from meshfold.parallel.tp.collectives import COLUMN, ROW, TensorParallelGroup, column_linears, local, tp_gemm


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad a local vocabulary shard with zero rows up to the common chunk size."""
    return w if w.shape[0] == rows else F.pad(w, (0, 0, 0, rows - w.shape[0]))


class TensorParallelAttention(Attention):
    """Heads split over tp: q (and k/v when tp divides n_kv_heads) column-parallel, wo
    row-parallel. ``kv_rows`` is set when kv heads are replicated: the rows of wk/wv
    holding the one kv head this rank's query heads share."""

    tp: TensorParallelGroup
    kv_rows: tuple[int, int] | None

    def _kv(self, lin: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kv_rows is None:
            return local(lin.weight), local(lin.bias)
        lo, hi = self.kv_rows
        w = self.tp.grad_sum(local(lin.weight))[lo:hi]
        b = None if lin.bias is None else self.tp.grad_sum(local(lin.bias))[lo:hi]
        return w, b

    def forward(self, x, rope, positions=None, doc_ids=None):
        tp = self.tp
        (wk, bk), (wv, bv) = self._kv(self.wk), self._kv(self.wv)
        q, k, v = column_linears(tp, x, [local(self.wq.weight), wk, wv], [local(self.wq.bias), bk, bv],
                                 [tp_gemm(lin, tp, COLUMN) for lin in (self.wq, self.wk, self.wv)])
        out = self.attend(q, k, v, rope, positions, doc_ids)  # this rank's heads (q/k norm, RoPE, core)
        out = tp.leave(tp_gemm(self.wo, tp, ROW)(out, local(self.wo.weight)))
        if self.wo.bias is not None:  # added once, after the reduction
            out = out + tp.replicated(self.wo.bias)
        return out


class TensorParallelFeedForward(FeedForward):
    """w1/w3 column-parallel over hidden units, w2 row-parallel."""

    tp: TensorParallelGroup

    def forward(self, x):
        tp = self.tp
        if self.w3 is not None:
            a, b = column_linears(tp, x, [local(self.w1.weight), local(self.w3.weight)],
                                  [local(self.w1.bias), local(self.w3.bias)],
                                  [tp_gemm(self.w1, tp, COLUMN), tp_gemm(self.w3, tp, COLUMN)])
            h = self.activate(a) * b
        else:
            (a,) = column_linears(tp, x, [local(self.w1.weight)], [local(self.w1.bias)], [tp_gemm(self.w1, tp, COLUMN)])
            h = self.activate(a)
        out = tp.leave(tp_gemm(self.w2, tp, ROW)(h, local(self.w2.weight)))
        if self.w2.bias is not None:
            out = out + tp.replicated(self.w2.bias)
        return out


class TensorParallelRMSNorm(RMSNorm):
    tp: TensorParallelGroup

    def forward(self, x):
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.gain(self.tp.replicated(self.weight))


class TensorParallelHeadNorm(RMSNorm):
    """Per-head q/k RMSNorm (Qwen3) on this rank's heads: the weight is replicated, and each
    rank's gradient covers only its own heads, so it is summed over tp (with or without sp)."""

    tp: TensorParallelGroup

    def forward(self, x):
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.gain(self.tp.grad_sum(local(self.weight)))


class TensorParallelLayerNorm(nn.LayerNorm):
    tp: TensorParallelGroup

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.tp.replicated(self.weight),
                            self.tp.replicated(self.bias), self.eps)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + chunk) on this rank; tokens outside give zeros and
    the partial embeddings are summed over tp (reduce-scattered along the sequence with sp)."""

    tp: TensorParallelGroup
    vocab_start: int
    chunk: int

    def forward(self, tokens):
        w = _pad_rows(local(self.weight), self.chunk)
        ids = tokens - self.vocab_start
        outside = (ids < 0) | (ids >= self.chunk)
        out = F.embedding(ids.masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.leave(out)


class VocabParallelOutput(nn.Module):
    """Output projection split by vocabulary rows. Returns this rank's [b, s, chunk] slice
    of the logits; columns past the real vocabulary (padding) are -inf, so neither a
    softmax nor the vocab-parallel cross-entropy ever sees them."""

    def __init__(self, tp: TensorParallelGroup, vocab_size: int, owner: nn.Module):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.chunk = math.ceil(vocab_size / tp.size)
        self.vocab_start = tp.rank * self.chunk
        # Plain attribute, not a child: the weight belongs to (and is named by) ``owner``.
        object.__setattr__(self, "owner", owner)

    def forward(self, x):
        w = _pad_rows(local(self.owner.weight), self.chunk)
        (logits,) = column_linears(self.tp, x, [w], [None])
        n_real = self.vocab_size - self.vocab_start
        if n_real < self.chunk:
            pad = torch.arange(self.chunk, device=logits.device) >= n_real
            logits = logits.masked_fill(pad, float("-inf"))
        return logits


class VocabParallelLinear(nn.Linear):
    """``model.output`` in place: same parameter name, vocabulary-parallel forward."""

    head: VocabParallelOutput

    def forward(self, x):
        return self.head(x)


class SequenceParallelPositionEmbedding(nn.Embedding):
    """Learned positions: with sp each rank adds the rows of its own sequence slice."""

    tp: TensorParallelGroup

    def forward(self, pos):
        tp = self.tp
        if tp.sp:
            n = pos.shape[-1] // tp.size
            pos = pos.narrow(-1, tp.rank * n, n)
        return F.embedding(pos, tp.replicated(self.weight))


class ReplicatedLinear(nn.Linear):
    """A linear layer every tp rank computes whole on the same (replicated) activations."""

    tp: TensorParallelGroup

    def forward(self, x):
        return F.linear(x, self.tp.replicated(self.weight), self.tp.replicated(self.bias))


def fill_positions_hook(tp: TensorParallelGroup):
    """With sp the model sees a 1/tp slice of the sequence, so it cannot derive rotary
    angles (or learned positions) from the hidden-state length: pass the full positions."""

    def hook(_module, args, kwargs):
        if kwargs.get("positions") is not None or len(args) > 1 and args[1] is not None:
            return None
        x = args[0] if args else kwargs["tokens"]
        # Token ids are the full sequence; hidden states (later pipeline stages) a slice.
        seq = x.shape[1] * (tp.size if torch.is_floating_point(x) else 1)
        positions = torch.arange(seq, device=x.device).expand(x.shape[0], seq)
        if len(args) > 1:
            args = (args[0], positions, *args[2:])
        else:
            kwargs = {**kwargs, "positions": positions}
        return args, kwargs

    return hook
