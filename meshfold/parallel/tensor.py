"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) with sequence parallel (Korthikanti
et al. 2022), applied from outside a parallelism-free ``Transformer``.

Layout over the ``tp`` ranks of the mesh (every parameter becomes a DTensor on the ``tp``
mesh, so FSDP2 composes with it as a 2-D / 3-D mesh, ``full_state()`` and checkpoints see
the unsharded names and shapes, and the gradient clip sums sharded norms over ``tp``):

=========================  ==============================  =========================================
module                     split                           placement of the weight
=========================  ==============================  =========================================
attention wq               column (by query heads)         Shard(0)
attention wk / wv          column (by kv heads) when       Shard(0), or Replicate (each rank uses
                           tp | n_kv_heads, else replicated  the one kv head its query heads need)
attention wo               row (by heads)                  Shard(1), bias Replicate
q/k biases                 with their weight's rows        as the weight (Shard(0) or Replicate)
q_norm / k_norm (per head) none (applied to local heads)   Replicate, gradient summed over tp
feed-forward w1 / w3       column (by hidden units)        Shard(0)
feed-forward w2            row                             Shard(1), bias Replicate
tok_embeddings, output     vocabulary rows                 Shard(0) (uneven when tp does not
                                                           divide the vocabulary; padded locally)
norms, pos_embeddings      none                            Replicate
=========================  ==============================  =========================================

The communication is Megatron's conjugate pair around each parallel region. Without
sequence parallel: ``f`` (identity forward, all-reduce backward) before a column-parallel
linear and ``g`` (all-reduce forward, identity backward) after a row-parallel one. With
``sp``: the residual stream, norms and dropout-free elementwise work run on a 1/tp slice of
the sequence; ``f`` becomes an all-gather along the sequence (reduce-scatter backward) and
``g`` a reduce-scatter (all-gather backward). The gathered input of a column-parallel
linear is not kept for backward: its sequence slice is, and backward gathers it again
(as Megatron does), so every activation a block saves shrinks by 1/tp.

Replicated parameters used on a sequence slice (norm weights, row-parallel biases,
positional embeddings) see only their slice's gradient; an ``f`` on the weight sums it
over ``tp``. Replicated kv weights (tp > n_kv_heads) get the same treatment, because each
rank feeds only its own kv head's rows.

Under ``train.dtype = bfloat16`` (fp32 master weights, fp32 residual stream, bf16 autocast)
activations and their gradients cross the tp link in bf16 (``wire_dtype``: the embedding's
reduction and its sp gradient gather, ``f``'s gradient all-reduce; the row-parallel outputs
and the sp-gathered linear inputs are bf16 already), as in Megatron-LM; the gradients of
replicated weights are summed in their own dtype (fp32, or bf16 under FSDP2's param_dtype),
and the vocabulary-parallel loss's statistics in fp32 (``loss.py``).

Every collective is recorded in the comm ledger under ``"tp"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshfold import comm
from meshfold.mesh import ParallelDims
from meshfold.models.llama import Attention, FeedForward, RMSNorm, Transformer
from meshfold.models.mla import MLAttention

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config

SEQ_DIM = 1  # activations are [batch, seq, ...]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The rank's local piece of a (possibly DTensor) parameter; autograd flows through."""
    if isinstance(t, DTensor):
        return t.to_local()
    return t


# --------------------------------------------------------------------------- the tp group


@dataclass
class TensorParallelGroup:
    """The ``tp`` process group plus the collectives the layers need (each one recorded)."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    sp: bool

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> "TensorParallelGroup":
        return cls(dims["tp"], dims.group("tp"), dims.size("tp"), dims.rank("tp"), dims.parallel.sp)

    # -- raw collectives (no autograd)
    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        comm.all_reduce(t, self.group, "tp", op=op)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.movedim(dim, 0).contiguous()
        out = t.new_empty((self.size * t.shape[0],) + t.shape[1:])
        comm.all_gather_into_tensor(out, t, self.group, "tp")
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.movedim(dim, 0).contiguous()
        out = t.new_empty((t.shape[0] // self.size,) + t.shape[1:])
        comm.reduce_scatter_tensor(out, t, self.group, "tp")
        return out.movedim(0, dim).contiguous()

    # -- Megatron's conjugate operators (autograd)
    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel region: f (no sp) or all-gather of the sequence (sp).
        Under autocast the collective carries the compute dtype (``wire_dtype``)."""
        return _GatherSeq.apply(x, self) if self.sp else _CopyToTP.apply(x, self, wire_dtype(x))

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel region: all-reduce (no sp) or reduce-scatter of the sequence.
        Under autocast the collective carries the compute dtype (``wire_dtype``)."""
        return _ScatterSeq.apply(x, self) if self.sp else _ReduceFromTP.apply(x, self)

    def gather_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Rows (dim 0) of every tp rank, rank-major: all-gather forward, reduce-scatter
        backward; in the wire dtype."""
        return _GatherTokens.apply(t, self, wire_dtype(t))

    def scatter_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over tp of rank-major rows, each rank keeping its own (``gather_tokens``'s
        conjugate): reduce-scatter forward, all-gather backward, in the wire dtype."""
        return _ScatterTokens.apply(t, self)

    def grad_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Identity forward; the gradient is summed over tp ranks in backward, in its own
        dtype (a replicated parameter's gradient: fp32 under bf16 autocast)."""
        return _CopyToTP.apply(t, self, None)

    def replicated(self, p: torch.Tensor | None) -> torch.Tensor | None:
        """A replicated parameter used on this rank's activations: with sp they hold only a
        slice of the sequence, so the weight gradient is a partial sum to add over tp."""
        if p is None:
            return None
        t = local(p)
        return self.grad_sum(t) if self.sp else t


def wire_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype an activation (or its gradient) crosses the tp link in: under autocast the
    compute dtype, when ``x`` is a wider floating-point tensor (the fp32 residual stream and
    norm outputs of ``train.dtype = bfloat16``); None (as it is) otherwise. Megatron-LM's tp
    and sp collectives carry bf16 activations, and pipeline parallel's sends here do too
    (``PipelineRunner.wire_dtype``). Without autocast (float32, float64) nothing changes."""
    device = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(device):
        return None
    cast = torch.get_autocast_dtype(device)
    return cast if cast != x.dtype else None


def _to_wire(t: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """``t`` as the collective's input: a fresh contiguous tensor (collectives work in place)."""
    return t.contiguous().clone() if wire is None or t.dtype == wire else t.to(wire).contiguous()


def _on_wire(t: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """``t`` in the wire dtype (the collective helpers copy it as they need)."""
    return t if wire is None or t.dtype == wire else t.to(wire)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (in ``wire`` dtype, then the gradient's)."""

    @staticmethod
    def forward(ctx, x, tp, wire):
        ctx.tp, ctx.wire = tp, wire
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce_(_to_wire(grad, ctx.wire)).to(grad.dtype), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (in the wire dtype, then the input's), identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce_(_to_wire(x, wire_dtype(x))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (both in the wire dtype)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.wire = tp, wire_dtype(x)
        return tp.all_gather(_on_wire(x, ctx.wire), SEQ_DIM).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(_on_wire(grad, ctx.wire), SEQ_DIM).to(grad.dtype), None


class _ScatterSeq(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (both in the wire dtype)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.wire = tp, wire_dtype(x)
        return tp.reduce_scatter(_on_wire(x, ctx.wire), SEQ_DIM).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(_on_wire(grad, ctx.wire), SEQ_DIM).to(grad.dtype), None


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter backward (both in ``wire`` dtype, if any)."""

    @staticmethod
    def forward(ctx, x, tp, wire):
        ctx.tp, ctx.wire = tp, wire
        return tp.all_gather(_on_wire(x, wire), 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(_on_wire(grad, ctx.wire), 0).to(grad.dtype), None, None


class _ScatterTokens(torch.autograd.Function):
    """Reduce-scatter along dim 0 forward, all-gather backward (both in the wire dtype)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.wire = tp, wire_dtype(x)
        return tp.reduce_scatter(_on_wire(x, ctx.wire), 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(_on_wire(grad, ctx.wire), 0).to(grad.dtype), None


class _GatheredLinears(torch.autograd.Function):
    """Sequence parallel entry fused with the column-parallel linears it feeds:
    ``[F.linear(all_gather(x), w_i, b_i)]``, saving only the local sequence slice of ``x``
    and gathering it again in backward (Megatron-LM's sequence-parallel linear), so the
    gathered [b, s, d] input is never kept alive between forward and backward."""

    @staticmethod
    def forward(ctx, x, tp, n, *weights_biases):
        weights, biases = weights_biases[:n], weights_biases[n:]
        device = x.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.dtypes = (x.dtype, [w.dtype for w in weights], [None if b is None else b.dtype for b in biases])
        if cast is not None:
            x = x.to(cast)
            weights = [w.to(cast) for w in weights]
            biases = [None if b is None else b.to(cast) for b in biases]
        with torch.autocast(device, enabled=False):
            full = tp.all_gather(x, SEQ_DIM)
            outs = tuple(F.linear(full, w, b) for w, b in zip(weights, biases))
        ctx.tp, ctx.n, ctx.has_bias = tp, n, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        tp = ctx.tp
        full = tp.all_gather(x, SEQ_DIM).flatten(0, -2)
        x_dtype, w_dtypes, b_dtypes = ctx.dtypes
        grad_full = None
        grad_ws, grad_bs = [], []
        for g, w, w_dtype, b_dtype in zip(grads, weights, w_dtypes, b_dtypes):
            if g is None:
                grad_ws.append(None)
                grad_bs.append(None)
                continue
            g = g.to(w.dtype)
            term = g @ w
            grad_full = term if grad_full is None else grad_full + term
            g2 = g.flatten(0, -2)
            grad_ws.append((g2.t() @ full).to(w_dtype))
            grad_bs.append(g2.sum(0).to(b_dtype) if b_dtype is not None else None)
        grad_x = None
        if grad_full is not None and ctx.needs_input_grad[0]:
            grad_x = tp.reduce_scatter(grad_full, SEQ_DIM).to(x_dtype)
        return (grad_x, None, None, *grad_ws, *grad_bs)


def column_linears(tp: TensorParallelGroup, x: torch.Tensor, weights: list, biases: list) -> tuple:
    """Column-parallel linears sharing one input ``x`` (local weights already)."""
    if tp.sp:
        return _GatheredLinears.apply(x, tp, len(weights), *weights, *biases)
    x = tp.enter(x)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))


# --------------------------------------------------------------------------- parameters


def shard_range(size: int, n: int, rank: int) -> tuple[int, int]:
    """Rows of dimension ``size`` that rank holds under DTensor's ``Shard`` (torch.chunk
    sizes: ceil(size/n) each, the last ranks shorter or empty)."""
    chunk = math.ceil(size / n)
    return min(rank * chunk, size), min((rank + 1) * chunk, size)


def _distribute(module: nn.Module, name: str, tp: TensorParallelGroup, placement) -> None:
    """Replace ``module.<name>`` by a DTensor parameter on the tp mesh, sliced locally from
    the (identical on every rank) full value: no communication."""
    param = getattr(module, name)
    if param is None:
        return
    full = param.detach()
    if isinstance(placement, Shard):
        start, stop = shard_range(full.shape[placement.dim], tp.size, tp.rank)
        piece = full.narrow(placement.dim, start, stop - start).clone()
    else:
        piece = full.clone()
    dt = DTensor.from_local(piece, tp.mesh, [placement], run_check=False, shape=full.shape, stride=full.stride())
    setattr(module, name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad a local vocabulary shard with zero rows up to the common chunk size."""
    return w if w.shape[0] == rows else F.pad(w, (0, 0, 0, rows - w.shape[0]))


def _swap_class(module: nn.Module, cls: type, **attrs) -> None:
    """Turn ``module`` into its tensor-parallel subclass in place (names, children and
    hooks stay), as FSDP2 does for its wrapper classes."""
    module.__class__ = cls
    for key, value in attrs.items():
        setattr(module, key, value)


# --------------------------------------------------------------------------- layers


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
        q, k, v = column_linears(tp, x, [local(self.wq.weight), wk, wv], [local(self.wq.bias), bk, bv])
        out = self.attend(q, k, v, rope, positions, doc_ids)  # this rank's heads (q/k norm, RoPE, core)
        out = tp.leave(F.linear(out, local(self.wo.weight)))
        if self.wo.bias is not None:  # added once, after the reduction
            out = out + tp.replicated(self.wo.bias)
        return out


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
    (``replicated``), like the block norms."""

    tp: TensorParallelGroup

    def forward(self, x, rope, positions=None, doc_ids=None):
        tp = self.tp
        latent = []
        if self.wq is None:  # low-rank q: its latent travels with the kv latent
            latent.append(self.q_a_norm(F.linear(x, tp.replicated(self.wq_a.weight))))
        c, k_rope = F.linear(x, tp.replicated(self.wkv_a.weight)).split([self.kv_rank, self.rope], -1)
        latent += [self.kv_a_norm(c), k_rope]
        wire = wire_dtype(x)
        if wire is not None:  # the up-projections compute in it anyway: gather the latent in it
            latent = [t.to(wire) for t in latent]
        parts = tp.enter(torch.cat(latent, -1)).split([t.shape[-1] for t in latent], -1)
        if self.wq is None:
            q = F.linear(parts[0], local(self.wq_b.weight))
        else:  # a full-rank q projection: a column-parallel linear of the block input
            (q,) = column_linears(tp, x, [local(self.wq.weight)], [None])
        # RoPE on the whole sequence, after the gather (rope covers it)
        out = self.attend(self.rope_query(q, rope), self.rope_latent(*parts[-2:], rope), positions, doc_ids)
        return tp.leave(F.linear(out.flatten(2), local(self.wo.weight)))

    def up_kv(self, c):  # this rank's rows of wkv_b: its heads
        return F.linear(c, local(self.wkv_b.weight))


class TensorParallelFeedForward(FeedForward):
    """w1/w3 column-parallel over hidden units, w2 row-parallel."""

    tp: TensorParallelGroup

    def forward(self, x):
        tp = self.tp
        if self.w3 is not None:
            a, b = column_linears(tp, x, [local(self.w1.weight), local(self.w3.weight)],
                                  [local(self.w1.bias), local(self.w3.bias)])
            h = F.silu(a) * b
        else:
            (a,) = column_linears(tp, x, [local(self.w1.weight)], [local(self.w1.bias)])
            h = F.gelu(a, approximate="tanh")
        out = tp.leave(F.linear(h, local(self.w2.weight)))
        if self.w2.bias is not None:
            out = out + tp.replicated(self.w2.bias)
        return out


class TensorParallelRMSNorm(RMSNorm):
    tp: TensorParallelGroup

    def forward(self, x):
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.tp.replicated(self.weight)


class TensorParallelHeadNorm(RMSNorm):
    """Per-head q/k RMSNorm (Qwen3) on this rank's heads: the weight is replicated, and each
    rank's gradient covers only its own heads, so it is summed over tp (with or without sp)."""

    tp: TensorParallelGroup

    def forward(self, x):
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.tp.grad_sum(local(self.weight))


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


def _fill_positions_hook(tp: TensorParallelGroup):
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


# --------------------------------------------------------------------------- entry point


def kv_heads_split(n_kv_heads: int, tp: int) -> bool:
    """The rule for grouped-query attention: kv heads are split over tp when tp divides
    them, else (tp a multiple of n_kv_heads) replicated, each rank using one kv head."""
    return n_kv_heads % tp == 0


def _parallelize_norm(norm: nn.Module | None, tp: TensorParallelGroup) -> None:
    if norm is None:
        return
    cls = TensorParallelRMSNorm if isinstance(norm, RMSNorm) else TensorParallelLayerNorm
    if not isinstance(norm, (RMSNorm, nn.LayerNorm)):
        raise TypeError(f"tensor parallel: unsupported norm {type(norm).__name__}")
    for name in ("weight", "bias"):
        if getattr(norm, name, None) is not None:
            _distribute(norm, name, tp, Replicate())
    _swap_class(norm, cls, tp=tp)


def _parallelize_attention(attn: Attention, tp: TensorParallelGroup) -> None:
    split = kv_heads_split(attn.n_kv_heads, tp.size)
    for lin in (attn.wq, attn.wk, attn.wv):
        kv = lin is not attn.wq
        place = Shard(0) if (not kv or split) else Replicate()
        _distribute(lin, "weight", tp, place)
        _distribute(lin, "bias", tp, place)
    _distribute(attn.wo, "weight", tp, Shard(1))
    _distribute(attn.wo, "bias", tp, Replicate())
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            _distribute(norm, "weight", tp, Replicate())
            _swap_class(norm, TensorParallelHeadNorm, tp=tp)
    kv_rows = None
    if not split:
        head = tp.rank * attn.n_kv_heads // tp.size
        kv_rows = (head * attn.head_dim, (head + 1) * attn.head_dim)
    _swap_class(attn, TensorParallelAttention, tp=tp, kv_rows=kv_rows)


def _parallelize_mla(attn: MLAttention, tp: TensorParallelGroup) -> None:
    low_rank_q = attn.wq is None
    # rows grouped by head: a Shard(0) splits the heads
    for lin in ((attn.wq_b,) if low_rank_q else (attn.wq,)) + (attn.wkv_b,):
        _distribute(lin, "weight", tp, Shard(0))
    for lin in ((attn.wq_a,) if low_rank_q else ()) + (attn.wkv_a,):
        _distribute(lin, "weight", tp, Replicate())
    for norm in ((attn.q_a_norm,) if low_rank_q else ()) + (attn.kv_a_norm,):
        _parallelize_norm(norm, tp)
    _distribute(attn.wo, "weight", tp, Shard(1))
    _swap_class(attn, TensorParallelMLAttention, tp=tp)


def _parallelize_ffn(ffn: FeedForward, tp: TensorParallelGroup) -> None:
    for lin in (ffn.w1, ffn.w3):
        if lin is not None:
            _distribute(lin, "weight", tp, Shard(0))
            _distribute(lin, "bias", tp, Shard(0))
    _distribute(ffn.w2, "weight", tp, Shard(1))
    _distribute(ffn.w2, "bias", tp, Replicate())
    _swap_class(ffn, TensorParallelFeedForward, tp=tp)


class ReplicatedLinear(nn.Linear):
    """A linear layer every tp rank computes whole on the same (replicated) activations."""

    tp: TensorParallelGroup

    def forward(self, x):
        return F.linear(x, self.tp.replicated(self.weight), self.tp.replicated(self.bias))


def _parallelize_block(block: nn.Module, tp: TensorParallelGroup) -> None:
    _parallelize_norm(block.attention_norm, tp)
    _parallelize_norm(block.ffn_norm, tp)
    if isinstance(block.attention, MLAttention):
        _parallelize_mla(block.attention, tp)
    else:
        _parallelize_attention(block.attention, tp)
    if type(block.feed_forward) is FeedForward:
        _parallelize_ffn(block.feed_forward, tp)
    # MoE: left to expert parallel (parallel/expert.py splits its experts over tp and, with
    # sp, gathers each rank's routed tokens around them)


def _parallelize_mtp(model: Transformer, tp: TensorParallelGroup) -> None:
    """Multi-token prediction depths (models/mtp.py; without sp, so their inputs are whole
    on every rank): the block like the model's, the norms and ``eh_proj`` replicated."""
    for module in (model.mtp.values() if getattr(model, "mtp", None) is not None else ()):
        _parallelize_block(module.block, tp)
        for norm in (module.enorm, module.hnorm, module.norm):
            _parallelize_norm(norm, tp)
        _distribute(module.eh_proj, "weight", tp, Replicate())
        _swap_class(module.eh_proj, ReplicatedLinear, tp=tp)


def parallelize_tensor(model: Transformer, dims: ParallelDims, cfg: Config) -> Transformer:
    """Apply tensor (and, with ``parallel.sp``, sequence) parallel to ``model`` in place.
    Works on a pipeline stage too (``tok_embeddings``/``norm``/``output`` may be None; under
    sp the hidden states a stage takes and returns are its 1/tp slice of the sequence)."""
    tp = TensorParallelGroup.from_dims(dims)
    vocab = cfg.model.vocab_size
    chunk = math.ceil(vocab / tp.size)

    for block in model.layers.values():
        _parallelize_block(block, tp)
    _parallelize_norm(model.norm, tp)
    _parallelize_mtp(model, tp)

    if model.tok_embeddings is not None:
        _distribute(model.tok_embeddings, "weight", tp, Shard(0))
        _swap_class(model.tok_embeddings, VocabParallelEmbedding, tp=tp, vocab_start=tp.rank * chunk, chunk=chunk)
    if model.pos_embeddings is not None:
        _distribute(model.pos_embeddings, "weight", tp, Replicate())
        _swap_class(model.pos_embeddings, SequenceParallelPositionEmbedding, tp=tp)
    if model.output is not None:
        _distribute(model.output, "weight", tp, Shard(0))
        _swap_class(model.output, VocabParallelLinear, head=VocabParallelOutput(tp, vocab, model.output))
    elif cfg.model.tie_embeddings and model.tok_embeddings is not None:
        # Tied weights: an unregistered head over the embedding's (vocab-sharded) weight,
        # so parameter names stay those of the one-process model.
        object.__setattr__(model, "output", VocabParallelOutput(tp, vocab, model.tok_embeddings))
    if tp.sp:
        model.register_forward_pre_hook(_fill_positions_hook(tp), with_kwargs=True)
    return model
