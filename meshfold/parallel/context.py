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

Causal load balance: with a contiguous split ring member i's queries see i+1 of the R
blocks, so the last rank does ~2x the mean work. With ``cp_balance`` the sequence is cut
into 2R chunks and ring member i holds chunks i and 2R-1-i: every member then has exactly
the same number of visible (query, key) pairs.

Document masks: a key is visible iff ``pos_k <= pos_q`` and both tokens belong to the same
packed document (``document_causal_mask`` in models/llama.py, the one-process semantics).
Attention is computed in tiles; a tile whose mask is empty is skipped (neither its scores
nor its backward are computed), a full tile is computed without a mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshfold.comm import ledger
from meshfold.config import Config, ConfigError, ModelConfig, ParallelConfig

_TAG_KV, _TAG_DKV = 51, 52


# --------------------------------------------------------------------------- layout


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def local_heads(model: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, key/value heads) one tensor-parallel rank holds: kv heads are split
    when tp divides them and replicated (one per rank) when they divide tp."""
    kv = model.kv_heads // tp if model.kv_heads % tp == 0 else 1
    return model.n_heads // tp, kv


def _ulysses_fits(model: ModelConfig, tp: int, degree: int) -> bool:
    heads, kv = local_heads(model, tp)
    return heads % degree == 0 and (kv % degree == 0 or degree % kv == 0)


def ulysses_degree(parallel: ParallelConfig, model: ModelConfig) -> int:
    """Ulysses group size: 1 for ring, cp for ulysses, ``cp_ulysses`` (or the largest
    divisor of cp below cp whose heads fit) for hybrid."""
    if parallel.cp_mode == "ring" or parallel.cp == 1:
        return 1
    if parallel.cp_mode == "ulysses":
        return parallel.cp
    if parallel.cp_ulysses:
        return parallel.cp_ulysses
    fits = [u for u in _divisors(parallel.cp) if u < parallel.cp and _ulysses_fits(model, parallel.tp, u)]
    return fits[-1]


def check_config(cfg: Config) -> None:
    """Context-parallel checks for ``config.validate`` (before any process group starts)."""
    p, m = cfg.parallel, cfg.model
    if p.cp_ulysses < 0:
        raise ConfigError(f"parallel.cp_ulysses must be >= 0 (0 = automatic), got {p.cp_ulysses}")
    if p.cp == 1:
        return
    if p.cp_mode == "hybrid" and p.cp_ulysses and p.cp % p.cp_ulysses:
        raise ConfigError(
            f"parallel.cp_ulysses = {p.cp_ulysses} must divide parallel.cp = {p.cp}; "
            f"choose one of {_divisors(p.cp)}"
        )
    degree = ulysses_degree(p, m)
    if degree > 1 and not _ulysses_fits(m, p.tp, degree):
        heads, kv = local_heads(m, p.tp)
        key = "parallel.cp" if p.cp_mode == "ulysses" else "parallel.cp_ulysses"
        fits = [u for u in _divisors(heads) if _ulysses_fits(m, p.tp, u)]
        raise ConfigError(
            f"parallel.cp_mode = {p.cp_mode} with Ulysses degree {degree}: each rank's {heads} query heads and "
            f"{kv} key/value heads (model.n_heads/n_kv_heads over tp = {p.tp}) must split evenly over it; "
            f"change {key} (Ulysses degree could be one of {fits}) or use parallel.cp_mode = ring"
        )


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
    """Score entries this rank computed (whole tiles) and the visible ones among them."""

    computed: int = 0
    visible: int = 0
    tiles: int = 0
    skipped_tiles: int = 0

    def reset(self) -> None:
        self.computed = self.visible = self.tiles = self.skipped_tiles = 0


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

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    @property
    def ring_rank(self) -> int:
        return self.cp_rank // self.ulysses

    def ring_peers(self) -> tuple[int, int]:
        """(next, previous) global ranks in the ring."""
        r, n = self.ring_rank, self.ring
        return (dist.get_global_rank(self.ring_group, (r + 1) % n),
                dist.get_global_rank(self.ring_group, (r - 1) % n))


_GROUPS: dict[tuple, dict] = {}  # hybrid sub-groups, made once per process (pipeline chunks share them)


def _new_groups(rank_lists: list[list[int]]) -> dict[tuple, dist.ProcessGroup]:
    """Create every group in the same order on every rank; keep the ones this rank is in."""
    key = tuple(map(tuple, rank_lists))
    if key not in _GROUPS:
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
    mesh = dims.mesh.mesh
    cp_axis = dims.mesh.mesh_dim_names.index("cp")
    rows = mesh.movedim(cp_axis, -1).reshape(-1, p.cp).tolist()
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


# --------------------------------------------------------------------------- tiled attention


def _tile_mask(qpos, qdoc, kpos, kdoc):
    mask = qpos.unsqueeze(-1) >= kpos.unsqueeze(-2)
    if qdoc is not None:
        mask &= qdoc.unsqueeze(-1) == kdoc.unsqueeze(-2)
    return mask


def _tiles(qmeta, kmeta, tile: int, work: AttentionWork | None):
    """Yield (q slice, k slice, mask or None) for every tile with a visible entry.

    The block's mask is built once and every tile's visible count read in one transfer
    (one host sync per block, not per tile)."""
    qpos, qdoc = qmeta
    kpos, kdoc = kmeta
    sq, sk = qpos.shape[1], kpos.shape[1]
    mask = _tile_mask(qpos, qdoc, kpos, kdoc)  # [b, sq, sk]
    q_starts, k_starts = range(0, sq, tile), range(0, sk, tile)
    if sq % tile == 0 and sk % tile == 0:
        counts = mask.view(mask.shape[0], sq // tile, tile, sk // tile, tile).sum((0, 2, 4)).tolist()
    else:
        counts = [[int(mask[:, i0:i0 + tile, j0:j0 + tile].sum()) for j0 in k_starts] for i0 in q_starts]
    for i, i0 in enumerate(q_starts):
        qs = slice(i0, min(i0 + tile, sq))
        for j, j0 in enumerate(k_starts):
            ks = slice(j0, min(j0 + tile, sk))
            visible = counts[i][j]
            full = mask.shape[0] * (qs.stop - qs.start) * (ks.stop - ks.start)
            if work is not None:
                work.tiles += 1
                work.skipped_tiles += int(visible == 0)
                work.computed += full if visible else 0
                work.visible += visible
            if visible:
                yield qs, ks, (None if visible == full else mask[:, None, None, qs, ks])


def _block_forward(qg, k, v, qmeta, kmeta, out, lse, scale, tile, work):
    """Merge attention of queries ``qg`` [b, hkv, g, sq, d] over keys/values k, v [b, hkv, sk, d]
    into the running normalised output ``out`` and log-sum-exp ``lse`` (in place)."""
    for qs, ks, mask in _tiles(qmeta, kmeta, tile, work):
        s = torch.matmul(qg[..., qs, :], k[:, :, None, ks, :].transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        blk_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - _finite(blk_lse).unsqueeze(-1))
        blk_out = torch.matmul(p, v[:, :, None, ks, :])
        old_lse = lse[..., qs]
        new_lse = torch.logaddexp(old_lse, blk_lse)
        safe = _finite(new_lse)
        w_old = torch.exp(old_lse - safe).unsqueeze(-1)
        w_blk = torch.exp(blk_lse - safe).unsqueeze(-1)
        out[..., qs, :] = out[..., qs, :] * w_old + blk_out * w_blk
        lse[..., qs] = new_lse


def _block_backward(qg, k, v, qmeta, kmeta, dout, delta, lse, dq, dkv, scale, tile):
    """Add this (query shard, key block) pair's contribution to dq and dkv = [dk, dv]."""
    for qs, ks, mask in _tiles(qmeta, kmeta, tile, None):
        q_t, k_t, v_t = qg[..., qs, :], k[:, :, None, ks, :], v[:, :, None, ks, :]
        s = torch.matmul(q_t, k_t.transpose(-1, -2)) * scale
        p = torch.exp(s - _finite(lse[..., qs]).unsqueeze(-1))
        if mask is not None:
            p = p.masked_fill(~mask, 0.0)
        do_t = dout[..., qs, :]
        dkv[1][:, :, ks] += torch.matmul(p.transpose(-1, -2), do_t).sum(2)
        dp = torch.matmul(do_t, v_t.transpose(-1, -2))
        ds = p * (dp - delta[..., qs].unsqueeze(-1)) * scale
        dq[..., qs, :] += torch.matmul(ds, k_t)
        dkv[0][:, :, ks] += torch.matmul(ds.transpose(-1, -2), q_t).sum(2)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row with no visible key yet) -> 0, so exp(-inf - 0) = 0 instead of NaN."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _exchange(send: torch.Tensor, recv: torch.Tensor, peers: tuple[int, int], tag: int, group) -> list:
    """Post the send to the next ring member and the receive from the previous one."""
    nxt, prev = peers
    ledger().add_sent("cp", send.numel() * send.element_size())
    return [dist.isend(send, nxt, group=group, tag=tag), dist.irecv(recv, prev, group=group, tag=tag)]


class _RingAttention(torch.autograd.Function):
    """Exact attention of this rank's queries over every ring member's keys/values.

    q [b, s, H, d], k/v [b, s, Hkv, d] (this member's tokens); ``meta`` [R, 2, b, s] holds
    every member's (positions, doc ids). With R = 1 it is plain tiled attention."""

    @staticmethod
    def forward(ctx, q, k, v, meta, use_doc, plan: ContextParallelPlan):
        # The block math runs in (at least) float32 whatever autocast is active outside.
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, meta, use_doc, plan)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, q, k, v, meta, use_doc, plan: ContextParallelPlan):
        b, s, heads, d = q.shape
        hkv = k.shape[2]
        cdt = torch.promote_types(q.dtype, torch.float32)
        scale = 1.0 / math.sqrt(d)
        qg = q.permute(0, 2, 1, 3).reshape(b, hkv, heads // hkv, s, d).to(cdt)
        cur = torch.stack([k, v]).permute(0, 1, 3, 2, 4).to(cdt).contiguous()  # [2, b, hkv, s, d]
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        R, r = plan.ring, plan.ring_rank
        tile = plan.tile or s
        metas = [_member_meta(meta, j, use_doc) for j in range(R)]
        peers = plan.ring_peers() if R > 1 else None
        for t in range(R):
            reqs, nxt = [], None
            if t < R - 1:  # the next block travels while this one is computed
                nxt = torch.empty_like(cur)
                reqs = _exchange(cur, nxt, peers, _TAG_KV, plan.ring_group)
            _block_forward(qg, cur[0], cur[1], metas[r], metas[(r - t) % R], out, lse, scale, tile,
                           plan.work if plan.count_work else None)
            for req in reqs:
                req.wait()
            if nxt is not None:
                cur = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta, ctx.use_doc, ctx.plan = meta, use_doc, plan
        return out.reshape(b, heads, s, d).permute(0, 2, 1, 3).to(q.dtype)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan: ContextParallelPlan = ctx.plan
        b, s, heads, d = q.shape
        hkv = k.shape[2]
        cdt = out.dtype
        scale = 1.0 / math.sqrt(d)
        qg = q.permute(0, 2, 1, 3).reshape(b, hkv, heads // hkv, s, d).to(cdt)
        dout = grad_out.permute(0, 2, 1, 3).reshape(b, hkv, heads // hkv, s, d).to(cdt)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qg)
        cur = torch.stack([k, v]).permute(0, 1, 3, 2, 4).to(cdt).contiguous()
        R, r = plan.ring, plan.ring_rank
        tile = plan.tile or s
        metas = [_member_meta(ctx.meta, j, ctx.use_doc) for j in range(R)]
        peers = plan.ring_peers() if R > 1 else None
        send_acc: list = []  # (request, tensor): the tensor must outlive its send
        dkv = None
        # The gradient of member j's keys/values travels with them: every rank adds its
        # part and passes it on; after R hops it is back at j, complete.
        for t in range(R):
            reqs, nxt, acc_in, acc_req = [], None, None, []
            if t < R - 1:
                nxt = torch.empty_like(cur)
                reqs = _exchange(cur, nxt, peers, _TAG_KV, plan.ring_group)
            if t > 0:
                acc_in = torch.empty_like(cur)
                acc_req = [dist.irecv(acc_in, peers[1], group=plan.ring_group, tag=_TAG_DKV)]
            dkv = torch.zeros_like(cur)
            _block_backward(qg, cur[0], cur[1], metas[r], metas[(r - t) % R], dout, delta, lse, dq, dkv, scale, tile)
            for req in acc_req:
                req.wait()
            if acc_in is not None:
                dkv += acc_in
            for req, _ in send_acc:
                req.wait()
            if R > 1:
                ledger().add_sent("cp", dkv.numel() * dkv.element_size())
                send_acc = [(dist.isend(dkv, peers[0], group=plan.ring_group, tag=_TAG_DKV), dkv)]
            for req in reqs:
                req.wait()
            if nxt is not None:
                cur = nxt
        if R > 1:
            dkv = torch.empty_like(cur)
            dist.irecv(dkv, peers[1], group=plan.ring_group, tag=_TAG_DKV).wait()
            for req, _ in send_acc:
                req.wait()
        dq = dq.reshape(b, heads, s, d).permute(0, 2, 1, 3).to(q.dtype)
        dk, dv = (x.permute(0, 2, 1, 3).to(k.dtype) for x in dkv)
        return dq, dk, dv, None, None, None


def _member_meta(meta: torch.Tensor, j: int, use_doc: bool):
    return meta[j, 0], (meta[j, 1] if use_doc else None)


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
    ledger().record("cp", "all_to_all", send.numel() * send.element_size(), n)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


# --------------------------------------------------------------------------- the module


class _MetaCache:
    """Every cp rank's (positions, doc ids), gathered once per forward: all layers get the
    same tensors, so the cache is keyed by their identity."""

    def __init__(self, plan: ContextParallelPlan):
        self.plan = plan
        self.key: tuple | None = None
        self.value: torch.Tensor | None = None

    def get(self, positions: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        if self.key is not None and self.key[0] is positions and self.key[1] is doc_ids:
            return self.value
        plan = self.plan
        docs = doc_ids if doc_ids is not None else torch.zeros_like(positions)
        local = torch.stack([positions, docs]).to(torch.int64).contiguous()  # [2, b, s]
        parts = [local]
        if plan.cp > 1:
            parts = [torch.empty_like(local) for _ in range(plan.cp)]
            ledger().record("cp", "all_gather", local.numel() * local.element_size() * plan.cp, plan.cp)
            dist.all_gather(parts, local, group=plan.cp_group)
        u = plan.ulysses
        # Ring member j holds the tokens of cp ranks j*U .. j*U+U-1 (after the all-to-all).
        members = [torch.cat(parts[j * u:(j + 1) * u], dim=-1) for j in range(plan.ring)]
        self.key, self.value = (positions, doc_ids), torch.stack(members)
        return self.value


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

    def forward(self, q, k, v, positions=None, doc_ids=None):
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
        if u > 1:
            heads, kv = q.shape[2], k.shape[2]
            if heads % u or (kv % u and u % kv):
                raise ValueError(f"Ulysses degree {u} does not split {heads} query / {kv} key-value heads")
            if kv % u:  # fewer kv heads than ranks: repeat them so each rank gets its group's head
                k, v = k.repeat_interleave(u // kv, dim=2), v.repeat_interleave(u // kv, dim=2)
            q, k, v = (_AllToAll.apply(t, 2, 1, plan.ulysses_group) for t in (q, k, v))
        out = _RingAttention.apply(q, k, v, meta, doc_ids is not None, plan)
        if u > 1:
            out = _AllToAll.apply(out, 1, 2, plan.ulysses_group)
        return out


def apply_context_parallel(model: nn.Module, cfg: Config, dims) -> ContextParallelPlan:
    """Swap every block's core attention for the cp version; returns the shared plan."""
    plan = build_plan(cfg, dims)
    cache = _MetaCache(plan)
    for block in model.layers.values():
        block.attention.core = ContextParallelAttention(plan, cache)
    model.cp_plan = plan
    return plan


def context_step_metrics(model: nn.Module) -> dict:
    """Trainer hook, once per step: ``cp_imbalance`` = max / mean over the cp ranks of the
    visible (query, key) entries each computed this step (1.0 = perfectly balanced)."""
    plans = {id(m.plan): m.plan for m in model.modules() if isinstance(m, ContextParallelAttention)}
    if not plans:
        return {}
    plans = list(plans.values())
    visible = torch.tensor([float(sum(p.work.visible for p in plans))], dtype=torch.float64)
    for p in plans:
        p.work.reset()
    cp, group = plans[0].cp, plans[0].cp_group
    if cp == 1:
        return {}
    parts = [torch.zeros_like(visible) for _ in range(cp)]
    ledger().record("cp", "all_gather", 8 * cp, cp)
    dist.all_gather(parts, visible, group=group)
    work = torch.cat(parts)
    mean = float(work.mean())
    return {"cp_imbalance": float(work.max()) / mean if mean > 0 else 1.0}
