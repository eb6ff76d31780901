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
* latent attention (``models/mla.py``): on a pure ring the per-token latent (kv_rank + rope
  values) travels instead of the expanded keys and values, each step expanding it locally
  (``_latent_ring_attend``); Ulysses and hybrid move the expanded heads.

Causal load balance: with a contiguous split ring member i's queries see i+1 of the R
blocks, so the last rank does ~2x the mean work. With ``cp_balance`` the sequence is cut
into 2R chunks and ring member i holds chunks i and 2R-1-i: every member then has exactly
the same number of visible (query, key) pairs.

Document masks: a key is visible iff ``pos_k <= pos_q`` and both tokens belong to the same
packed document (``document_causal_mask`` in models/llama.py, the one-process semantics).
Attention runs in tiles (the balanced chunk by default); ``RingLayout`` classifies every
(query tile, key tile) pair once per forward: fully masked pairs are skipped, fully visible
ones run the fused kernel without a mask, diagonal ones as causal, and only partial ones
carry a (tile x tile) mask. The kernels are the fused ones that return the log-sum-exp
(``models/attention_ops.py``: flash for CPU, flash / memory-efficient on CUDA).
"""

from __future__ import annotations

import math
import types
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from meshfold.comm import all_gather_into_tensor, all_to_all_single, exchange, wait_all
from meshfold.errors import ConfigError
from meshfold.models.attention_ops import attention_backward, attention_forward, document_attention, pick_kernel
from meshfold.models.mla import MLAttention
from meshfold.models.moe import has_values
from meshfold.parallel.config import ulysses_degree

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


# --------------------------------------------------------------------------- layout


def token_indices(seq_len: int, cp: int, cp_rank: int, ulysses: int = 1, balance: bool = True) -> torch.Tensor:
    """The sequence positions cp rank ``cp_rank`` holds.

    cp rank = ring_member * ulysses + ulysses_rank. A ring member's share is either one
    contiguous block of seq_len/R or (balanced) chunks m and 2R-1-m of seq_len/(2R); the
    Ulysses ranks of that member split the share contiguously, so after the all-to-all
    each of them holds exactly its member's share."""
    ring = cp // ulysses
    member, sub = divmod(cp_rank, ulysses)
    pieces = 2 * ring if (balance and ring > 1) else ring
    need = pieces * ulysses  # every Ulysses rank gets an equal part of every piece's share
    if seq_len % need:
        raise ConfigError(
            f"sequence length {seq_len} is not divisible by {need} (parallel.cp = {cp}); "
            f"choose a model.seq_len that is a multiple of {need}"
        )
    if pieces == ring:
        share = torch.arange(member * seq_len // ring, (member + 1) * seq_len // ring)
    else:
        c = seq_len // pieces
        share = torch.cat([torch.arange(member * c, (member + 1) * c),
                           torch.arange((pieces - 1 - member) * c, (pieces - member) * c)])
    n = share.numel() // ulysses
    return share[sub * n: (sub + 1) * n]


# --------------------------------------------------------------------------- plan and groups


@dataclass
class AttentionWork:
    """Score entries this rank computed (whole tiles) and the visible ones among them. The
    visible entries of partial tiles stay a device tensor (no host read in the step)."""

    computed: int = 0
    visible_known: int = 0
    tiles: int = 0
    skipped_tiles: int = 0
    visible_partial: torch.Tensor | None = None

    def add(self, layout) -> None:
        self.computed += layout.computed
        self.visible_known += layout.visible_known
        self.tiles += layout.tiles
        self.skipped_tiles += layout.skipped
        if layout.partial:
            part = layout.partial_visible()
            self.visible_partial = part if self.visible_partial is None else self.visible_partial + part

    def visible_tensor(self, device) -> torch.Tensor:
        out = torch.full((1,), float(self.visible_known), dtype=torch.float64, device=device)
        return out if self.visible_partial is None else out + self.visible_partial.to(device)

    @property
    def visible(self) -> int:
        """Visible entries (reads the device count: for tests and reports, not the step)."""
        return int(self.visible_tensor(torch.device("cpu")).item())

    def reset(self) -> None:
        self.computed = self.visible_known = self.tiles = self.skipped_tiles = 0
        self.visible_partial = None


@dataclass
class ContextParallelPlan:
    cp: int
    ulysses: int
    balance: bool
    cp_rank: int
    cp_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    tile: int = 0  # tokens per attention tile; 0 = seq_len / (2 max(cp, 4)) (set on first use)
    work: AttentionWork = field(default_factory=AttentionWork)
    count_work: bool = True  # off for forwards without grad (evaluation)
    kernel: str = "auto"  # "math": the explicit reference kernel instead of the fused ones
    device: torch.device | None = None  # where attention ran (for the per-step metric)

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    @property
    def ring_rank(self) -> int:
        return self.cp_rank // self.ulysses



_GROUPS: dict[tuple, dict] = {}  # hybrid sub-groups, made once per process (pipeline chunks share them)


def _new_groups(rank_lists: list[list[int]]) -> dict[tuple, dist.ProcessGroup]:
    """Create every group in the same order on every rank; keep the ones this rank is in.
    Made again once destroyed (a process group re-initialised by live recovery, or the
    test pool's clean-up between tasks): every rank destroys them together."""
    key = tuple(map(tuple, rank_lists))
    live = dist.distributed_c10d._world.pg_map
    if key not in _GROUPS or any(g not in live for g in _GROUPS[key].values()):
        _GROUPS[key] = _make_groups(rank_lists)
    return _GROUPS[key]


def _make_groups(rank_lists: list[list[int]]) -> dict[tuple, dist.ProcessGroup]:
    me = dist.get_rank()
    mine = {}
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if me in ranks:
            mine[tuple(ranks)] = group
    return mine


def build_plan(cfg: Config, dims) -> ContextParallelPlan:
    """The plan for this rank from the mesh: the cp group, and for hybrid the Ulysses
    (adjacent cp ranks) and ring (stride = Ulysses degree) sub-groups."""
    p = cfg.parallel
    degree = ulysses_degree(p, cfg.model)
    cp_group = dims.group("cp")
    cp_rank = dims.rank("cp")
    if degree == 1:
        return ContextParallelPlan(p.cp, 1, p.cp_balance, cp_rank, cp_group, None, cp_group)
    if degree == p.cp:
        return ContextParallelPlan(p.cp, degree, p.cp_balance, cp_rank, cp_group, cp_group, None)
    rows = dims.rank_lists("cp")
    ring = p.cp // degree
    uly_lists = [row[g * degree:(g + 1) * degree] for row in rows for g in range(ring)]
    ring_lists = [row[u::degree] for row in rows for u in range(degree)]
    uly = _new_groups(uly_lists)
    rings = _new_groups(ring_lists)
    (uly_group,) = uly.values()
    (ring_group,) = rings.values()
    return ContextParallelPlan(p.cp, degree, p.cp_balance, cp_rank, cp_group, uly_group, ring_group)


# --------------------------------------------------------------------------- batches


def shard_batch(batch: dict[str, torch.Tensor], plan: ContextParallelPlan) -> dict[str, torch.Tensor]:
    """This cp rank's slice of every [batch, seq] tensor, plus the matching ``positions``."""
    inputs = batch["inputs"]
    bsz, seq = inputs.shape
    idx = token_indices(seq, plan.cp, plan.cp_rank, plan.ulysses, plan.balance).to(inputs.device)
    out = {k: (v[:, idx].contiguous() if v.dim() >= 2 and v.shape[1] == seq else v) for k, v in batch.items()}
    if "positions" not in batch:
        out["positions"] = idx.unsqueeze(0).expand(bsz, -1).contiguous()
    return out


def shard_for_context_parallel(batch: dict[str, torch.Tensor], cfg: Config, dims) -> dict[str, torch.Tensor]:
    """Trainer hook: the batch unchanged without cp, else this rank's sequence slice."""
    if dims.size("cp") == 1:
        return batch
    degree = ulysses_degree(cfg.parallel, cfg.model)
    plan = ContextParallelPlan(dims.size("cp"), degree, cfg.parallel.cp_balance, dims.rank("cp"), None, None, None)
    return shard_batch(batch, plan)


# --------------------------------------------------------------------------- block layout

_EMPTY, _FULL, _CAUSAL, _PARTIAL = 0, 1, 2, 3


def _tile_mask(qpos, qdoc, kpos, kdoc):
    mask = qpos.unsqueeze(-1) >= kpos.unsqueeze(-2)
    if qdoc is not None:
        mask &= qdoc.unsqueeze(-1) == kdoc.unsqueeze(-2)
    return mask


def _tile_view(x: torch.Tensor, tile: int, fill) -> torch.Tensor:
    """[..., s] -> [..., n_tiles, tile], a ragged last tile padded with ``fill``."""
    pad = (-x.shape[-1]) % tile
    if pad:
        x = torch.cat([x, x.new_full(x.shape[:-1] + (pad,), fill)], -1)
    return x.unflatten(-1, (-1, tile))


class RingLayout:
    """Which (query tile, key tile) pairs of every ring step need which kernel, decided once
    per forward from every member's (positions, doc ids) and shared by all layers: empty
    pairs are skipped, fully visible ones run without a mask, diagonal ones as causal, and
    only the rest build a (tile x tile) mask. One small device-to-host read per forward
    (the codes), none per block."""

    def __init__(self, meta: torch.Tensor, use_doc: bool, ring_rank: int, tile: int):
        self.meta, self.use_doc, self.tile = meta, use_doc, tile
        R, _, b, s = meta.shape
        self.R, self.r, self.b, self.s = R, ring_rank, b, s
        self.n = -(-s // tile)
        big = torch.iinfo(torch.int64).max
        pos, doc = meta[:, 0], meta[:, 1]
        pmin, pmax = _tile_view(pos, tile, big).amin(-1), _tile_view(pos, tile, -big).amax(-1)  # [R, b, n]
        dmin, dmax = _tile_view(doc, tile, big).amin(-1), _tile_view(doc, tile, -big).amax(-1)
        qmin, qmax = pmin[ring_rank, :, :, None], pmax[ring_rank, :, :, None]  # [b, nq, 1]
        kmin, kmax = pmin[:, :, None, :], pmax[:, :, None, :]  # [R, b, 1, nk]
        empty = qmax < kmin
        full = qmin >= kmax
        ptiles = _tile_view(pos, tile, -1)  # [R, b, n, tile]
        increasing = (ptiles[..., 1:] > ptiles[..., :-1]).all(-1)  # [R, b, n]
        causal = (ptiles[ring_rank, :, :, None] == ptiles[:, :, None]).all(-1) & increasing[ring_rank, :, :, None]
        if use_doc:
            qdmin, qdmax = dmin[ring_rank, :, :, None], dmax[ring_rank, :, :, None]
            kdmin, kdmax = dmin[:, :, None, :], dmax[:, :, None, :]
            empty |= (qdmax < kdmin) | (kdmax < qdmin)
            one_doc = (qdmin == qdmax) & (kdmin == kdmax) & (qdmin == kdmin)
            full &= one_doc
            causal &= one_doc
        code = empty.new_full(empty.shape[:1] + empty.shape[2:], _PARTIAL, dtype=torch.int8)  # where meta is
        code = torch.where(causal.all(1), _CAUSAL, code)
        code = torch.where(full.all(1), _FULL, code)
        code = torch.where(empty.all(1), _EMPTY, code)
        codes = code.tolist()  # [R members][nq][nk]: the one host read
        # steps[t]: (q tile, k tile, code, first) for key member (r - t) % R; ``first``: the
        # first block for these query rows (its output is copied, not merged).
        self.steps, seen = [], set()
        self.tiles = self.skipped = self.computed = self.visible_known = 0
        self.partial: list[tuple[int, int, int]] = []
        for t in range(R):
            j = (ring_rank - t) % R
            tasks = []
            for i in range(self.n):
                for jj in range(self.n):
                    c = codes[j][i][jj]
                    self.tiles += 1
                    if c == _EMPTY:
                        self.skipped += 1
                        continue
                    tq, tk = self._len(i), self._len(jj)
                    self.computed += b * tq * tk
                    if c == _FULL:
                        self.visible_known += b * tq * tk
                    elif c == _CAUSAL:
                        self.visible_known += b * tq * (tq + 1) // 2
                    else:
                        self.partial.append((t, i, jj))
                    tasks.append((i, jj, c, i not in seen))
                    seen.add(i)
            self.steps.append(tasks)
        self._partial_visible: torch.Tensor | None = None

    def _len(self, i: int) -> int:
        return min(self.tile, self.s - i * self.tile)

    def rows(self, i: int) -> slice:
        return slice(i * self.tile, min((i + 1) * self.tile, self.s))

    def mask(self, t: int, i: int, j: int) -> torch.Tensor:
        """bool [b, 1, tq, tk] of query tile i against key tile j of ring step t."""
        member = (self.r - t) % self.R
        qs, ks = self.rows(i), self.rows(j)
        q, k = self.meta[self.r], self.meta[member]
        m = _tile_mask(q[0][:, qs], q[1][:, qs] if self.use_doc else None,
                       k[0][:, ks], k[1][:, ks] if self.use_doc else None)
        return m.unsqueeze(1)

    def partial_visible(self) -> torch.Tensor:
        """Visible entries of the partial tiles, a device scalar (counted once per forward)."""
        if self._partial_visible is None:
            total = torch.zeros((), dtype=torch.float64, device=self.meta.device)
            for t, i, j in self.partial:
                total = total + self.mask(t, i, j).sum()
            self._partial_visible = total
        return self._partial_visible


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row with no visible key yet) -> 0, so exp(-inf - 0) = 0 instead of NaN."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _merge(out, lse, rows, o, lse_blk, first: bool) -> None:
    """Fold a block's (normalised output, log-sum-exp) into the running ones, in place."""
    if first:
        out[:, :, rows] = o
        lse[:, :, rows] = lse_blk
        return
    old = lse[:, :, rows]
    new = torch.logaddexp(old, lse_blk)
    safe = _finite(new)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - safe).unsqueeze(-1)
                       + o * torch.exp(lse_blk - safe).unsqueeze(-1))
    lse[:, :, rows] = new


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads [b, hkv, s, d] -> [b, hkv * groups, s, d] (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


# --------------------------------------------------------------------------- ring attention


class _HeadsPayload:
    """What travels on the ring for ordinary attention: the k and v heads, [2, b, hkv, s, d]
    stacked (one message) when their widths match, else [b, hkv, s, dk + dv] side by side
    (latent attention expanded before a Ulysses all-to-all: k is nope + rope wide, v not)."""

    params: tuple = ()

    def __init__(self, k, v, heads: int):
        self.dk, self.dv = k.shape[-1], v.shape[-1]
        self.groups = heads // k.shape[2]
        self.stacked = self.dk == self.dv

    def pack(self, k, v):
        if self.stacked:
            return torch.stack([k, v]).transpose(2, 3).contiguous()
        return torch.cat([k, v], -1).transpose(1, 2).contiguous()

    def unpack(self, cur):
        k, v = (cur[0], cur[1]) if self.stacked else (x.contiguous() for x in cur.split([self.dk, self.dv], -1))
        return _expand(k, self.groups), _expand(v, self.groups)

    def open(self, cur):
        """Backward: (k, v) for the block kernels and the step's gradient accumulator."""
        kx, vx = self.unpack(cur)
        acc = torch.promote_types(cur.dtype, torch.float32)
        return kx, vx, torch.zeros(cur.shape, dtype=acc, device=cur.device)

    def add(self, state, ks, dk, dv):
        if self.stacked:
            state[0][:, :, ks] += _reduce_groups(dk, self.groups)
            state[1][:, :, ks] += _reduce_groups(dv, self.groups)
        else:
            state[:, :, ks, :self.dk] += _reduce_groups(dk, self.groups)
            state[:, :, ks, self.dk:] += _reduce_groups(dv, self.groups)

    def close(self, state, param_grads):
        return state  # already the payload's gradient

    def grads(self, dcur, k, v):
        dk, dv = (dcur[0], dcur[1]) if self.stacked else dcur.split([self.dk, self.dv], -1)
        return dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


class _LatentPayload:
    """What travels on the ring for latent attention (``models/mla.py``): the per-token
    latent [b, s, kv_rank + rope] (the normed compressed kv and the RoPE'd shared key),
    expanded into per-head k and v by ``expand`` at every ring step, forward and backward.
    Its gradient travels back the same way; ``expand``'s parameters (``wkv_b``) get theirs
    locally, through autograd of the re-run expansion, under the forward's autocast."""

    def __init__(self, expand, params: tuple, device_type: str):
        self.expand, self.params = expand, params
        self.device_type = device_type
        self.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        self.leaf = self.kx = self.vx = None

    def pack(self, latent, _):
        return latent.contiguous()

    def unpack(self, cur):
        k, v = self.expand(cur)
        return k.transpose(1, 2), v.transpose(1, 2)

    def open(self, cur):
        enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled):
            self.leaf = cur.detach().requires_grad_()
            self.kx, self.vx = self.unpack(self.leaf)
        acc = torch.promote_types(self.kx.dtype, torch.float32)
        state = [torch.zeros(x.shape, dtype=acc, device=cur.device) for x in (self.kx, self.vx)]
        return self.kx.detach(), self.vx.detach(), state

    def add(self, state, ks, dk, dv):
        state[0][:, :, ks] += dk
        state[1][:, :, ks] += dv

    def close(self, state, param_grads):
        got = torch.autograd.grad((self.kx, self.vx), (self.leaf, *self.params),
                                  (state[0].to(self.kx.dtype), state[1].to(self.vx.dtype)), allow_unused=True)
        for i, g in enumerate(got[1:]):
            if g is not None:
                param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
        self.leaf = self.kx = self.vx = None
        return got[0].to(torch.promote_types(got[0].dtype, torch.float32))

    def grads(self, dcur, k, v):
        return dcur.to(k.dtype), None


class _RingAttention(torch.autograd.Function):
    """Exact attention of this rank's queries over every ring member's keys/values.

    q [b, s, H, d], k/v [b, s, Hkv, d] (this member's tokens), or, for latent attention, k
    the latent [b, s, r] and v None; ``payload`` says what travels and how it becomes the
    step's keys and values (``_HeadsPayload``, ``_LatentPayload``). Each (query tile, key tile)
    pair runs a fused kernel that returns its log-sum-exp (``models/attention_ops``); the
    blocks are merged by log-sum-exp in float32 (float64 for float64 inputs). Keys/values
    travel in their own (compute) dtype; the next block's exchange is posted before the
    current block is computed. With R = 1 it is tiled attention with block skipping.

    Message order (no tags: p2p matches in issue order per peer pair, as on NCCL). Every
    rank issues, towards its next ring neighbour, kv(0), dkv(0), kv(1), dkv(1), ..,
    kv(R-2), dkv(R-2), dkv(R-1) in the backward and kv(0) .. kv(R-2) in the forward, and
    posts the matching receives from its previous neighbour in the same order."""

    @staticmethod
    def forward(ctx, q, k, v, layout: RingLayout, plan: ContextParallelPlan, payload, *params):
        b, s, heads, d = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        scale = 1.0 / math.sqrt(d)
        qt = q.transpose(1, 2)
        cur = payload.pack(k, v)  # what travels, in the compute dtype
        out = None  # [b, heads, s, dv] once v's width is known
        lse = torch.full((b, heads, s), float("-inf"), dtype=acc, device=q.device)
        R = layout.R
        nxt_peer, prev_peer = (plan.ring_rank + 1) % R, (plan.ring_rank - 1) % R
        auxes = []  # each block's kernel state (CUDA: philox seed/offset, lse width), for its backward
        for t in range(R):
            works, nxt = [], None
            if t < R - 1:  # the next block travels while this one is computed
                nxt = torch.empty_like(cur)
                works = exchange([(cur, nxt_peer)], [(nxt, prev_peer)], plan.ring_group, "cp")
            kx, vx = payload.unpack(cur)
            if out is None:
                out = torch.zeros(b, heads, s, vx.shape[-1], dtype=acc, device=q.device)
            for i, j, code, first in layout.steps[t]:
                qs, ks = layout.rows(i), layout.rows(j)
                mask = layout.mask(t, i, j) if code == _PARTIAL else None
                o, lse_blk, aux = attention_forward(qt[:, :, qs], kx[:, :, ks], vx[:, :, ks], causal=code == _CAUSAL,
                                                    mask=mask, scale=scale, kernel=plan.kernel)
                auxes.append(aux)
                _merge(out, lse, qs, o, lse_blk, first)
            wait_all(works)
            if nxt is not None:
                cur = nxt
        # The output in the compute dtype, rows [b, s, heads, d] contiguous: what the fused
        # backward takes (as flash attention's), and what the caller's output projection
        # saves too (a view), so the block keeps one copy of it, not an fp32 one besides.
        result = out.transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.layout, ctx.plan, ctx.auxes, ctx.payload = layout, plan, auxes, payload
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        layout: RingLayout = ctx.layout
        plan: ContextParallelPlan = ctx.plan
        b, s, heads, d = q.shape
        payload = ctx.payload
        param_grads = [None] * len(payload.params)
        acc = lse.dtype
        scale = 1.0 / math.sqrt(d)
        qt, dout = q.transpose(1, 2), grad_out.to(q.dtype).transpose(1, 2)
        out_k, lse_k = out.transpose(1, 2), _finite(lse)  # the final rows: P = exp(S - lse_final)
        dq = torch.zeros(b, heads, s, d, dtype=acc, device=q.device)
        cur = payload.pack(k, v)
        R = layout.R
        nxt_peer, prev_peer = (plan.ring_rank + 1) % R, (plan.ring_rank - 1) % R
        incoming, acc_works, dkv = None, [], None
        auxes = iter(ctx.auxes)
        # The gradient of member j's keys/values travels with them: every rank adds its part
        # and passes it on; after R hops it is back at j, complete.
        for t in range(R):
            works, nxt = [], None
            if t < R - 1:
                nxt = torch.empty_like(cur)
                works = exchange([(cur, nxt_peer)], [(nxt, prev_peer)], plan.ring_group, "cp")
            kx, vx, state = payload.open(cur)
            for i, j, code, _ in layout.steps[t]:
                qs, ks = layout.rows(i), layout.rows(j)
                mask = layout.mask(t, i, j) if code == _PARTIAL else None
                # The forward's kernel state of this block, kept (not the forward re-run): the
                # fused backwards take the final out and lse, which the merge reconstructed.
                aux = next(auxes)
                dq_t, dk_t, dv_t = attention_backward(dout[:, :, qs], qt[:, :, qs], kx[:, :, ks], vx[:, :, ks],
                                                      out_k[:, :, qs], lse_k[:, :, qs], aux, causal=code == _CAUSAL,
                                                      mask=mask, scale=scale)
                dq[:, :, qs] += dq_t
                payload.add(state, ks, dk_t, dv_t)
            dkv = payload.close(state, param_grads)  # this step's gradient of what travels
            if R > 1:
                wait_all(acc_works)
                if incoming is not None:
                    dkv += incoming
                incoming = torch.empty_like(dkv)
                acc_works = exchange([(dkv, nxt_peer)], [(incoming, prev_peer)], plan.ring_group, "cp")
            wait_all(works)
            if nxt is not None:
                cur = nxt
        if R > 1:
            wait_all(acc_works)
            dkv = incoming
        dk, dv = payload.grads(dkv, k, v)
        return (dq.transpose(1, 2).to(q.dtype), dk, dv, None, None, None, *param_grads)


def ring_attention(q, k, v, meta: torch.Tensor, use_doc: bool, plan: ContextParallelPlan,
                   layout: RingLayout | None = None, expand=None, params: tuple = ()) -> torch.Tensor:
    """Ring attention of the local q/k/v [b, s, heads, d] over the ring of ``plan``; ``meta``
    [R, 2, b, s] holds every member's (positions, doc ids). With ``expand``, ``k`` is a
    latent [b, s, r] (``v`` None) that travels instead and ``expand(latent) -> (k, v)``
    (using ``params``) makes each step's keys and values."""
    if layout is None:
        layout = RingLayout(meta, use_doc, plan.ring_rank, plan.tile or meta.shape[-1])
    if plan.count_work:
        plan.work.add(layout)
    plan.device = q.device
    if expand is None:
        return _RingAttention.apply(q, k, v, layout, plan, _HeadsPayload(k, v, q.shape[2]))
    return _RingAttention.apply(q, k, None, layout, plan, _LatentPayload(expand, params, q.device.type), *params)


# --------------------------------------------------------------------------- Ulysses all-to-all


class _AllToAll(torch.autograd.Function):
    """Split ``scatter_dim`` over the group, concatenate what arrives along ``gather_dim``.
    The backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.args = (scatter_dim, gather_dim, group)
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, group = ctx.args
        return _all_to_all(grad, gather_dim, scatter_dim, group), None, None, None


def _all_to_all(x, scatter_dim, gather_dim, group):
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, group, "cp")
    return torch.cat(recv.unbind(0), dim=gather_dim)


# --------------------------------------------------------------------------- the module


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
            entry = self.entries[key] = [members.contiguous(), None]
            weakref.finalize(positions, self.entries.pop, key, None)  # (ids are reused once it is gone)
        self.current = entry
        return entry[0]

    def ring_layout(self, use_doc: bool) -> RingLayout:
        entry = self.current
        if entry[1] is None:
            if has_values(entry[0]):
                entry[1] = RingLayout(entry[0], use_doc, self.plan.ring_rank, self.plan.tile)
            else:  # a dry-run's fake batch: the default positions, no documents (its host read
                # would have no values to read), laid out on real tensors
                with unset_fake_temporarily():
                    meta = default_members(self.plan, *entry[0].shape[2:])
                    entry[1] = RingLayout(meta, False, self.plan.ring_rank, self.plan.tile)
        return entry[1]


def default_members(plan: ContextParallelPlan, bsz: int, member_len: int) -> torch.Tensor:
    """What ``_MetaCache.get`` gathers for a batch with default positions and no document
    ids: [ring, 2 (positions, docs), bsz, member_len]."""
    seq = member_len * plan.ring
    pos = torch.stack([torch.cat([token_indices(seq, plan.cp, j * plan.ulysses + k, plan.ulysses, plan.balance)
                                  for k in range(plan.ulysses)]) for j in range(plan.ring)])
    pos = pos[:, None].expand(-1, bsz, -1)
    return torch.stack([pos, torch.zeros_like(pos)], 1).contiguous()


class ContextParallelAttention(nn.Module):
    """Drop-in for ``CoreAttention`` on a cp rank: [b, s_local, heads, hd] in and out."""

    def __init__(self, plan: ContextParallelPlan, cache: _MetaCache):
        super().__init__()
        self.plan = plan
        self.cache = cache

    def _arange(self, bsz: int, seq: int, device) -> torch.Tensor:
        """Default positions, one tensor per shape, so the metadata cache keeps hitting."""
        cached = getattr(self, "_positions", None)
        if cached is None or cached.shape != (bsz, seq) or cached.device != device:
            self._positions = torch.arange(seq, device=device).expand(bsz, -1)
        return self._positions

    def forward(self, q, k, v, positions=None, doc_ids=None, expand=None, params: tuple = ()):
        """``expand`` (ring only): ``k`` is latent attention's latent, ``v`` None (``ring_attention``)."""
        if positions is None and self.plan.cp == 1:  # one rank holds the whole sequence
            positions = self._arange(q.shape[0], q.shape[1], q.device)
        if positions is None:
            raise ValueError("context parallel attention needs the token positions of the local slice "
                             "(shard batches with meshfold.parallel.context.shard_batch)")
        plan = self.plan
        plan.count_work = torch.is_grad_enabled()
        meta = self.cache.get(positions, doc_ids)
        if plan.tile == 0:  # the balanced chunk S/(2cp); at least 4 tiles per sequence side
            plan.tile = max(1, meta.shape[-1] * plan.ring // (2 * max(plan.cp, 4)))
        u = plan.ulysses
        if expand is not None:
            if u > 1:
                raise ValueError("a latent (expand) travels on the ring only; expand it before a Ulysses all-to-all")
            use_doc = doc_ids is not None
            return ring_attention(q, k, None, meta, use_doc, plan, self.cache.ring_layout(use_doc),
                                  expand=expand, params=params)
        if u > 1:
            heads, kv = q.shape[2], k.shape[2]
            if heads % u or (kv % u and u % kv):
                raise ValueError(f"Ulysses degree {u} does not split {heads} query / {kv} key-value heads")
            if kv % u:  # fewer kv heads than ranks: repeat them so each rank gets its group's head
                k, v = k.repeat_interleave(u // kv, dim=2), v.repeat_interleave(u // kv, dim=2)
            q, k, v = (_AllToAll.apply(t, 2, 1, plan.ulysses_group) for t in (q, k, v))
        if u > 1 and plan.ring == 1:  # Ulysses: whole sequences, the ordinary fused attention
            out = _whole_sequence_attention(q, k, v, meta, doc_ids is not None)
        else:
            out = ring_attention(q, k, v, meta, doc_ids is not None, plan, self.cache.ring_layout(doc_ids is not None))
        if u > 1:
            out = _AllToAll.apply(out, 1, 2, plan.ulysses_group)
        return out


def _whole_sequence_attention(q, k, v, meta: torch.Tensor, use_doc: bool) -> torch.Tensor:
    """Attention of whole, in-order sequences [b, S, heads, d]: causal SDPA, or per-document
    attention without an S x S mask (its windows planned once per forward: ``meta``, the
    cached [1, 2, b, S] positions and doc ids, is the same tensor in every layer)."""
    if use_doc:
        return document_attention(q, k, v, meta[0, 0], meta[0, 1], key=meta)
    dv = v.shape[-1]
    if dv < q.shape[-1]:  # latent attention: v zero-padded to the q/k width so the fused (flash)
        # kernels run (they want one width; exact: the output's extra columns are zeros)
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)[..., :dv]


def apply_context_parallel(model: nn.Module, cfg: Config, dims) -> ContextParallelPlan:
    """Swap every block's core attention for the cp version; returns the shared plan."""
    plan = build_plan(cfg, dims)
    cache = _MetaCache(plan)
    for block in model.layers.values():
        block.attention.core = ContextParallelAttention(plan, cache)
        if isinstance(block.attention, MLAttention) and plan.ulysses == 1:
            block.attention.attend = types.MethodType(_latent_ring_attend, block.attention)
    return plan


def _latent_ring_attend(self: MLAttention, q, latent, positions=None, doc_ids=None):
    """``MLAttention.attend`` under ring cp: the latent (kv_rank + rope values per token, in
    the compute dtype, which is all ``wkv_b`` reads of it) travels on the ring instead of
    the expanded keys and values; each step expands it (``expand``, ``wkv_b``) locally.
    Through the core module, so selective recompute still wraps it."""
    if torch.is_autocast_enabled(latent.device.type):
        latent = latent.to(torch.get_autocast_dtype(latent.device.type))
    return self.core(q, latent, None, positions=positions, doc_ids=doc_ids, expand=self.expand,
                     params=tuple(self.wkv_b.parameters()))


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
