"""Context parallel: ring attention, Ulysses all-to-all and their hybrid, with document masks.

Every ``cp`` rank holds a slice of each sequence (``shard_batch``). Everything outside the
core attention is per-token, so only ``Attention.core`` needs the other ranks' tokens; it
is replaced by ``ContextParallelAttention``:

* ring (Liu et al., "Ring Attention"; Li et al., "Sequence Parallelism"): key/value blocks
  travel around the ring of ``R`` ranks with point-to-point sends that overlap the block
  computation; partial results are merged exactly with the log-sum-exp (online softmax)
  rule, and the backward recomputes the block probabilities from the saved log-sum-exp
  (flash-attention style) while the key/value gradients travel back around the ring.
* Ulysses (DeepSpeed-Ulysses): an all-to-all turns sequence-sharded q/k/v into
  head-sharded full sequences, attention runs locally, a second all-to-all turns the
  output back. Needs the (local) head count divisible by the Ulysses degree; key/value
  heads are split when the degree divides them and repeated when they divide it.
* hybrid (LightSeq / USP style): cp = ulysses x ring. Ulysses inside groups of adjacent
  ranks (the cheap links), ring across the groups.
* an attention variant may send its own payload on a pure ring instead of the expanded
  keys and values (``ATTENTION_ADAPTERS`` below, keyed by ``ModelConfig.attention``; latent
  attention's per-token latent: ``cp/mla.py``); Ulysses and hybrid move the expanded heads.

Causal load balance: with a contiguous split ring member i's queries see i+1 of the R
blocks, so the last rank does ~2x the mean work. With ``cp_balance`` the sequence is cut
into 2R chunks and ring member i holds chunks i and 2R-1-i: every member then has exactly
the same number of visible (query, key) pairs.

Document masks: a key is visible iff ``pos_k <= pos_q`` and both tokens belong to the same
packed document (``document_causal_mask`` in models/llama.py, the one-process semantics).
Attention runs in tiles (the balanced chunk by default); ``RingLayout`` classifies every
(query tile, key tile) pair once per forward: fully masked pairs are skipped, fully visible
ones run the fused kernel without a mask, diagonal ones as causal, and only partial ones
carry a (tile x tile) mask. Sliding-window and chunked layers skip pairs out of reach the
same way, and their ring sends a block only to the members that see some of it
(``RingLayout.need``: the direct ring). The kernels are the fused ones that return the log-sum-exp
(``models/attention_ops.py``: flash for CPU, flash / memory-efficient on CUDA).

The package: ``batch.py`` (which tokens a cp rank holds; the batch sharding), ``groups.py``
(the plan and the hybrid sub-groups), ``ring.py`` (ring attention and its tile layout),
``ulysses.py`` (the all-to-all), ``attention.py`` (the drop-in core attention: ring,
Ulysses or their hybrid), this module (applying it; the per-step balance metric),
``mla.py`` (latent attention's ring payload) and ``per_sequence.py`` (per-sequence
context parallel for the balanced data path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshfold.comm import all_gather_into_tensor
from meshfold.parallel.cp import mla
from meshfold.parallel.cp.attention import ContextParallelAttention, _MetaCache
from meshfold.parallel.cp.groups import ContextParallelPlan, build_plan

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def _keep(attention: nn.Module, plan: ContextParallelPlan) -> None:
    """Attention that sends its k/v heads: the core swap is all it needs."""


# What an attention variant changes beyond the core swap, by ``ModelConfig.attention`` (one line each).
ATTENTION_ADAPTERS = {
    "gqa": _keep,
    "mla": mla.send_latent_on_ring,
}


def apply_context_parallel(model: nn.Module, cfg: Config, dims) -> ContextParallelPlan:
    """Swap every block's core attention for the cp version; returns the shared plan."""
    plan = build_plan(cfg, dims)
    cache = _MetaCache(plan)
    for block in model.layers.values():
        core = block.attention.core  # its sliding window, softmax scale and chunk go with the swap
        block.attention.core = ContextParallelAttention(plan, cache, getattr(core, "window", 0),
                                                        getattr(core, "scale", None), getattr(core, "chunk", 0))
        ATTENTION_ADAPTERS[cfg.model.attention](block.attention, plan)
    return plan


def context_step_metrics(model: nn.Module) -> dict:
    """Trainer hook, once per step: ``cp_imbalance`` = max / mean over the cp ranks of the
    visible (query, key) entries each computed this step (1.0 = perfectly balanced)."""
    plans = {id(m.plan): m.plan for m in model.modules() if isinstance(m, ContextParallelAttention)}
    if not plans:
        return {}
    plans = list(plans.values())
    cp, group = plans[0].cp, plans[0].cp_group
    device = next((p.device for p in plans if p.device is not None), None)
    if device is None:  # no forward yet: the device the group computes on
        device = torch.device("cuda", torch.cuda.current_device()) if cp > 1 and \
            dist.get_backend(group) == "nccl" else torch.device("cpu")
    visible = torch.zeros(1, dtype=torch.float64, device=device)
    for p in plans:
        visible += p.work.visible_tensor(device)
        p.work.reset()
    if cp == 1:
        return {}
    work = torch.empty(cp, dtype=torch.float64, device=device)
    all_gather_into_tensor(work, visible, group, "cp")
    mean = float(work.mean())  # metrics: one read per step
    return {"cp_imbalance": float(work.max()) / mean if mean > 0 else 1.0}
