"""The drop-in for ``CoreAttention`` on a context-parallel rank: ring attention, Ulysses
(whole sequences after an all-to-all) or their hybrid (Ulysses inside groups, ring
across them), with every rank's positions and document ids gathered once per micro-batch
(``_MetaCache``). See ``parallel/cp/plan.py`` for the whole picture."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from meshfold.comm import all_gather_into_tensor
from meshfold.models.attention_ops import chunk_ids, document_attention, sdpa, window_attention
from meshfold.models.moe_experts import has_values
from meshfold.parallel.cp.batch import default_members
from meshfold.parallel.cp.groups import ContextParallelPlan
from meshfold.parallel.cp.ring import RingLayout, ring_attention
from meshfold.parallel.cp.ulysses import _AllToAll


class _MetaCache:
    """Every cp rank's (positions, doc ids) and the ring layout, made once per micro-batch
    and chunk: all layers get the same tensors, so entries are keyed by their identity. An
    entry lives as long as its micro-batch's positions tensor: a pipeline runs other
    micro-batches through the chunk, and recomputation reruns a micro-batch's forward in
    its backward, before the micro-batch comes back, and neither gathers again."""

    def __init__(self, plan: ContextParallelPlan):
        self.plan = plan
        self.entries: dict[tuple[int, int], list] = {}  # (id(positions), id(doc ids)) -> [value, layout]
        self.current: list | None = None

    @torch.compiler.disable  # host bookkeeping and a collective, once per micro-batch: eager under compile
    def get(self, positions: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        key = (id(positions), id(doc_ids))
        entry = self.entries.get(key)
        if entry is None:
            plan = self.plan
            docs = doc_ids if doc_ids is not None else torch.zeros_like(positions)
            local = torch.stack([positions, docs]).to(torch.int64).contiguous()  # [2, b, s]
            parts = local.unsqueeze(0)
            if plan.cp > 1:
                parts = torch.empty((plan.cp * 2,) + local.shape[1:], dtype=local.dtype, device=local.device)
                all_gather_into_tensor(parts, local, plan.cp_group, "cp")  # concatenated along dim 0
            u = plan.ulysses
            # Ring member j holds the tokens of cp ranks j*U .. j*U+U-1 (after the all-to-all).
            members = parts.view(plan.ring, u, 2, *local.shape[1:]).permute(0, 2, 3, 1, 4).flatten(-2)
            entry = self.entries[key] = [members.contiguous(), {}]  # the ring layouts, by (window, chunk)
            # An entry lives while both keyed tensors do: ids are reused once a tensor is gone, and
            # the default positions outlive every batch, so the doc ids' death must end it too
            for keyed in (positions, doc_ids):
                if keyed is not None:
                    weakref.finalize(keyed, self.entries.pop, key, None)
        self.current = entry
        return entry[0]

    def ring_layout(self, use_doc: bool, window: int = 0, chunk: int = 0) -> RingLayout:
        """The micro-batch's ring layout for layers with this sliding ``window`` and ``chunk``
        (0: none)."""
        layouts, key = self.current[1], (window, chunk)
        if key not in layouts:
            meta = self.current[0]
            if has_values(meta):
                layouts[key] = RingLayout(meta, use_doc, self.plan.ring_rank, self.plan.tile, window, chunk)
            else:  # a dry-run's fake batch: the default positions, no documents (its host read
                # would have no values to read), laid out on real tensors
                with unset_fake_temporarily():
                    meta = default_members(self.plan, *meta.shape[2:])
                    layouts[key] = RingLayout(meta, False, self.plan.ring_rank, self.plan.tile, window, chunk)
        return layouts[key]

    def chunk_runs(self, use_doc: bool, chunk: int) -> torch.Tensor:
        """Ulysses' whole sequences under a chunked layer: the runs it attends within (a new
        run where the document or the chunk changes), one tensor per micro-batch and chunk, so
        every chunked layer shares its document plan."""
        layouts, key = self.current[1], ("runs", use_doc, chunk)
        if key not in layouts:
            meta = self.current[0]
            layouts[key] = chunk_ids(meta[0, 1] if use_doc else None, meta[0, 0], chunk)
        return layouts[key]


class ContextParallelAttention(nn.Module):
    """Drop-in for ``CoreAttention`` on a cp rank: [b, s_local, heads, hd] in and out, with the
    layer's sliding ``window`` (0: none) and softmax ``scale`` (None: 1/sqrt(d)) of the core it
    replaces, its ``chunk`` (chunked attention, 0: none), and the block's attention sinks when
    it passes them."""

    def __init__(self, plan: ContextParallelPlan, cache: _MetaCache, window: int = 0, scale: float | None = None,
                 chunk: int = 0):
        super().__init__()
        self.plan = plan
        self.cache = cache
        self.window, self.scale, self.chunk = window, scale, chunk

    def _arange(self, bsz: int, seq: int, device) -> torch.Tensor:
        """Default positions, one tensor per shape, so the metadata cache keeps hitting."""
        cached = getattr(self, "_positions", None)
        if cached is None or cached.shape != (bsz, seq) or cached.device != device:
            self._positions = torch.arange(seq, device=device).expand(bsz, -1)
        return self._positions

    def forward(self, q, k, v, positions=None, doc_ids=None, payload=None, sinks=None):
        """``payload`` (ring only): what travels instead of the k/v heads, an attention
        variant's own; ``k`` is then what it packs, ``v`` None (``ring_attention``)."""
        if positions is None and self.plan.cp == 1:  # one rank holds the whole sequence
            positions = self._arange(q.shape[0], q.shape[1], q.device)
        if positions is None:
            raise ValueError("context parallel attention needs the token positions of the local slice "
                             "(shard batches with meshfold.parallel.cp.batch.shard_batch)")
        plan = self.plan
        plan.count_work = torch.is_grad_enabled()
        meta = self.cache.get(positions, doc_ids)
        if plan.tile == 0:  # the balanced chunk S/(2cp); at least 4 tiles per sequence side
            plan.tile = max(1, meta.shape[-1] * plan.ring // (2 * max(plan.cp, 4)))
        u = plan.ulysses
        if payload is not None:
            if u > 1:
                raise ValueError("a variant's own payload travels on the ring only; expand it before a Ulysses "
                                 "all-to-all")
            use_doc = doc_ids is not None
            return ring_attention(q, k, None, meta, use_doc, plan,
                                  self.cache.ring_layout(use_doc, self.window, self.chunk), payload=payload,
                                  scale=self.scale, sinks=sinks)
        if u > 1:
            heads, kv = q.shape[2], k.shape[2]
            if heads % u or (kv % u and u % kv):
                raise ValueError(f"Ulysses degree {u} does not split {heads} query / {kv} key-value heads")
            if kv % u:  # fewer kv heads than ranks: repeat them so each rank gets its group's head
                k, v = k.repeat_interleave(u // kv, dim=2), v.repeat_interleave(u // kv, dim=2)
            q, k, v = (_AllToAll.apply(t, 2, 1, plan.ulysses_group) for t in (q, k, v))
            if sinks is not None:  # this rank's heads after the exchange: its group index's share
                part = sinks.shape[0] // u
                sinks = sinks[plan.cp_rank % u * part:(plan.cp_rank % u + 1) * part]
        use_doc = doc_ids is not None
        if u > 1 and plan.ring == 1 and self.chunk:  # Ulysses, chunked: within each (document's) chunk
            runs = self.cache.chunk_runs(use_doc, self.chunk)
            out = document_attention(q, k, v, meta[0, 0], runs, key=runs, scale=self.scale, sinks=sinks)
        elif u > 1 and plan.ring == 1:  # Ulysses: whole sequences, the ordinary fused attention
            out = _whole_sequence_attention(q, k, v, meta, use_doc, self.window, self.scale, sinks)
        else:
            out = ring_attention(q, k, v, meta, use_doc, plan, self.cache.ring_layout(use_doc, self.window, self.chunk),
                                 scale=self.scale, sinks=sinks)
        if u > 1:
            out = _AllToAll.apply(out, 1, 2, plan.ulysses_group)
        return out


def _whole_sequence_attention(q, k, v, meta: torch.Tensor, use_doc: bool, window: int = 0,
                              scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of whole, in-order sequences [b, S, heads, d]: causal SDPA, or per-document
    attention without an S x S mask (its windows planned once per forward: ``meta``, the
    cached [1, 2, b, S] positions and doc ids, is the same tensor in every layer); a sliding
    ``window``, a softmax ``scale`` and ``sinks`` as the core attention takes them."""
    if window:
        return window_attention(q, k, v, window, meta[0, 0], meta[0, 1] if use_doc else None, scale, sinks, key=meta)
    if use_doc:
        return document_attention(q, k, v, meta[0, 0], meta[0, 1], key=meta, scale=scale, sinks=sinks)
    if scale is not None or sinks is not None:
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, scale=scale, sinks=sinks)
        return out.transpose(1, 2)
    dv = v.shape[-1]
    if dv < q.shape[-1]:  # v narrower than q/k (latent attention's): zero-padded to the q/k width so the fused (flash)
        # kernels run (they want one width; exact: the output's extra columns are zeros)
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)[..., :dv]
