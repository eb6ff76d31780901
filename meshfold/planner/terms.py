"""The layer terms: what the cost model computes once per (tp, sp, cp, ep, micro-batch,
recompute) and prices every layout with (``layer.py`` builds them), typed by what they
measure: seconds (``LayerTimes``), collective calls and bytes (``LayerTraffic``),
parameters (``LayerParams``) and kept activation bytes (``LayerActivations``); per block
kind (dense / MoE: the key is ``ModelConfig.is_moe_layer``'s) a ``BlockTerms``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class BlockTerms(NamedTuple):
    """One block of a kind, for one micro-batch on one device."""

    fwd: float  # seconds forward, with the tp/cp/ep communication it waits for
    bwd: float  # seconds backward, with what the recompute policy re-runs
    params: float  # parameters on the device
    compute_fwd: float  # seconds of the forward's GEMMs and attention core alone
    ep_sent: float  # bytes the expert all-to-alls send (ring convention), recompute included


class TpCalls(NamedTuple):
    """Tensor-parallel collectives per micro-batch of one place (a block, the first or the
    last stage's extra work): calls, activation bytes sent, and the gradient elements of
    replicated weights summed over tp (priced in ``counts.tp_grad_bytes`` each)."""

    calls: float
    sent: float
    weights: float


@dataclass(frozen=True, eq=False)
class LayerTimes:
    """Seconds per micro-batch on one device."""

    out_fwd: float  # the output layer and loss, forward
    out_bwd: float  # ... and backward
    tp_ar: float  # one all-reduce of a block's b x s x h activations over tp, with its call
    cp_fwd: float  # a block's context-parallel exchange left exposed, forward
    loss_t: float  # one of the loss's all-reduces of per-token scalars over tp
    norm_t: float  # (sp) the all-reduce of the replicated norm weights' gradients
    # tp around the blocks in ``tp_ar`` units, (forward, backward): the embedding's
    # reduction, the output layer's input; per block, sp's re-gather in backward
    emb_ops: tuple
    out_ops: tuple
    layer_regather: float


@dataclass(frozen=True, eq=False)
class LayerTraffic:
    """Collective calls and bytes (ring convention) per micro-batch on one device."""

    tp_layer: TpCalls  # per block
    tp_moe: TpCalls  # per MoE block, on top of ``tp_layer``
    tp_first: TpCalls  # the first stage's embedding
    tp_last: TpCalls  # the last stage's output layer, loss and final norm
    cp_sent: float  # bytes a block's cp exchange sends, forward and backward
    cp_sent_rec: float  # ... again under full/op recompute
    cp_sent_sel: float  # ... again under selective recompute
    cp_calls: tuple  # a block's cp calls: (forward and backward, full/op recompute's, selective's)
    p2p_bytes: float  # one pipeline send of a micro-batch's activations


@dataclass(frozen=True, eq=False)
class LayerParams:
    """Parameters per device outside ``BlockTerms.params``."""

    expert_p: float  # (ep > 1) one MoE block's routed experts: their own FSDP group
    emb: float  # the embedding's (and an untied output layer's) rows on this tp rank
    pos_emb: float  # learned positions, whole on every tp rank
    final_norm: float


@dataclass(frozen=True, eq=False)
class LayerActivations:
    """Activation bytes one block keeps for backward, per micro-batch on one device."""

    act_kinds: dict  # per block kind, under the layout's recompute policy
    act_full: float  # without recompute (full recompute's working set)
    act_kept: float  # under the recompute policy (op's working set: act_full - act_kept)


@dataclass(frozen=True, eq=False)
class LayerTerms:
    """Everything ``CostModel`` prices a layout from, per layer terms key (``layer.py``)."""

    kinds: dict  # {is_moe: BlockTerms}
    tokens: int  # tokens of one micro-batch on one device (b x s / cp)
    time: LayerTimes
    traffic: LayerTraffic
    params: LayerParams
    acts: LayerActivations
