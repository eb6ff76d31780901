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

The package: ``collectives.py`` (the group and its autograd collectives), ``layers.py``
(the tp subclasses of the model's layers), ``placement.py`` (parameters to DTensors, the
norm and feed-forward plans), this module (the block plan and the entry point), and one
module per attention variant or extra head that needs its own (``mla.py``, ``mtp.py``),
registered below: ``ATTENTION_PLANS`` by ``ModelConfig.attention``, ``EXTRA_HEAD_PLANS``
by the type of the module an extra head adds around its block.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshfold.mesh import ParallelDims
from meshfold.models.llama import Attention, FeedForward, Transformer
from meshfold.models.deepseek.mtp import MTPModule
from meshfold.parallel.tp import mla, mtp
from meshfold.parallel.tp.collectives import TensorParallelGroup
from meshfold.parallel.tp.layers import (SequenceParallelPositionEmbedding, TensorParallelAttention,
                                         TensorParallelHeadNorm, VocabParallelEmbedding, VocabParallelLinear,
                                         VocabParallelOutput, fill_positions_hook)
from meshfold.parallel.tp.placement import distribute, parallelize_ffn, parallelize_norm, swap_class

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def kv_heads_split(n_kv_heads: int, tp: int) -> bool:
    """The rule for grouped-query attention: kv heads are split over tp when tp divides
    them, else (tp a multiple of n_kv_heads) replicated, each rank using one kv head."""
    return n_kv_heads % tp == 0


def parallelize_attention(attn: Attention, tp: TensorParallelGroup) -> None:
    split = kv_heads_split(attn.n_kv_heads, tp.size)
    for lin in (attn.wq, attn.wk, attn.wv):
        kv = lin is not attn.wq
        place = Shard(0) if (not kv or split) else Replicate()
        distribute(lin, "weight", tp, place)
        distribute(lin, "bias", tp, place)
    distribute(attn.wo, "weight", tp, Shard(1))
    distribute(attn.wo, "bias", tp, Replicate())
    distribute(attn, "sinks", tp, Shard(0))  # attention sinks: one per query head, split with them
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            distribute(norm, "weight", tp, Replicate())
            swap_class(norm, TensorParallelHeadNorm, tp=tp)
    kv_rows = None
    if not split:
        head = tp.rank * attn.n_kv_heads // tp.size
        kv_rows = (head * attn.head_dim, (head + 1) * attn.head_dim)
    swap_class(attn, TensorParallelAttention, tp=tp, kv_rows=kv_rows)


# The attention variants' plans, by ``ModelConfig.attention`` (one line each).
ATTENTION_PLANS = {
    "gqa": parallelize_attention,
    "mla": mla.parallelize_mla,
}

# The plans of what an extra head adds around its block, by module type (one line each).
EXTRA_HEAD_PLANS = {
    MTPModule: mtp.parallelize_depth,
}


def parallelize_block(block: nn.Module, tp: TensorParallelGroup, attention: str) -> None:
    """A decoder block's plan; ``attention``: ``ModelConfig.attention``, its variant's key."""
    for norm in (block.attention_norm, block.ffn_norm, block.post_attention_norm, block.post_ffn_norm):
        parallelize_norm(norm, tp)  # (the post norms are None unless the model has them)
    ATTENTION_PLANS[attention](block.attention, tp)
    if type(block.feed_forward) is FeedForward:
        parallelize_ffn(block.feed_forward, tp)


def parallelize_tensor(model: Transformer, dims: ParallelDims, cfg: Config) -> Transformer:
    """Apply tensor (and, with ``parallel.sp``, sequence) parallel to ``model`` in place.
    Works on a pipeline stage too (``tok_embeddings``/``norm``/``output`` may be None; under
    sp the hidden states a stage takes and returns are its 1/tp slice of the sequence)."""
    tp = TensorParallelGroup.from_dims(dims)
    vocab = cfg.model.vocab_size
    chunk = math.ceil(vocab / tp.size)

    for block in model.blocks():  # the trunk's, then the extra heads'
        parallelize_block(block, tp, cfg.model.attention)
    parallelize_norm(model.norm, tp)
    for module in list(model.modules()):  # what extra heads add around their blocks
        extra = EXTRA_HEAD_PLANS.get(type(module))
        if extra is not None:
            extra(module, tp)

    if model.tok_embeddings is not None:
        distribute(model.tok_embeddings, "weight", tp, Shard(0))
        swap_class(model.tok_embeddings, VocabParallelEmbedding, tp=tp, vocab_start=tp.rank * chunk, chunk=chunk)
    if model.pos_embeddings is not None:
        distribute(model.pos_embeddings, "weight", tp, Replicate())
        swap_class(model.pos_embeddings, SequenceParallelPositionEmbedding, tp=tp)
    if model.output is not None:
        distribute(model.output, "weight", tp, Shard(0))
        swap_class(model.output, VocabParallelLinear, head=VocabParallelOutput(tp, vocab, model.output))
    elif cfg.model.tie_embeddings and model.tok_embeddings is not None:
        # Tied weights: an unregistered head over the embedding's (vocab-sharded) weight,
        # so parameter names stay those of the one-process model.
        object.__setattr__(model, "output", VocabParallelOutput(tp, vocab, model.tok_embeddings))
    if tp.sp:
        model.register_forward_pre_hook(fill_positions_hook(tp), with_kwargs=True)
    return model
