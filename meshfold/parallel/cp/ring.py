"""Ring attention: key/value blocks travel around the ring with point-to-point sends that
overlap the block computation, merged exactly by log-sum-exp; the backward sends the
key/value gradients back around the ring. ``RingLayout`` decides once per forward which
(query tile, key tile) pairs are skipped, run unmasked, causal, or with a mask. See
``parallel/cp/plan.py`` for the whole picture."""

from __future__ import annotations

import math

import torch

from meshfold.comm import exchange, wait_all
from meshfold.models.attention_ops import attention_backward, attention_forward
from meshfold.parallel.cp.groups import ContextParallelPlan

_EMPTY, _FULL, _CAUSAL, _PARTIAL = 0, 1, 2, 3


def _tile_mask(qpos, qdoc, kpos, kdoc, window: int = 0, chunk: int = 0):
    gap = qpos.unsqueeze(-1) - kpos.unsqueeze(-2)
    mask = gap >= 0
    if window:  # a sliding window: the `window` latest keys, the query's own included
        mask &= gap < window
    if chunk:  # chunked (block-local) attention: keys of the query's own chunk of positions
        mask &= torch.div(qpos, chunk, rounding_mode="floor").unsqueeze(-1) == \
            torch.div(kpos, chunk, rounding_mode="floor").unsqueeze(-2)
    if qdoc is not None:
        mask &= qdoc.unsqueeze(-1) == kdoc.unsqueeze(-2)
    return mask


def _tile_view(x: torch.Tensor, tile: int, fill) -> torch.Tensor:
    """[..., s] -> [..., n_tiles, tile], a ragged last tile padded with ``fill``."""
    pad = (-x.shape[-1]) % tile
    if pad:
        x = torch.cat([x, x.new_full(x.shape[:-1] + (pad,), fill)], -1)
    return x.unflatten(-1, (-1, tile))


def _out_of_reach(qmin, qmax, kmin, kmax, window: int, chunk: int) -> torch.Tensor:
    """Tile pairs (per-tile position minima and maxima, broadcast) with no key any query
    could see by position alone: all keys in the future, all ``window`` or more behind, or
    (chunked) all in other chunks."""
    empty = qmax < kmin
    if window:
        empty |= qmin - kmax >= window
    if chunk:
        qcmin, qcmax, kcmin, kcmax = (torch.div(x, chunk, rounding_mode="floor") for x in (qmin, qmax, kmin, kmax))
        empty |= (qcmax < kcmin) | (kcmax < qcmin)
    return empty


class _Sent(list):
    """An exchange's works, holding what it sends (picked tiles are made for the send) until
    they are waited on."""

    def __init__(self, works: list, sends: list):
        super().__init__(works)
        self.sends = sends


class RingLayout:
    """Which (query tile, key tile) pairs of every ring step need which kernel, decided once
    per forward from every member's (positions, doc ids) and shared by all layers: empty
    pairs are skipped, fully visible ones run without a mask, diagonal ones as causal, and
    only the rest build a (tile x tile) mask. One small device-to-host read per forward
    (the codes), none per block. ``window`` > 0 (a sliding-window layer's): pairs whose
    every key is ``window`` or more positions behind every query are empty too (skipped,
    never computed), and a pair is fully visible or causal only when all its keys are
    inside the window; ``chunk`` > 0 (a chunked layer's): likewise for keys outside the
    query's chunk of positions.

    Windowed and chunked layers also skip communication: ``need[q][k]`` (the same on every
    member: it comes from every member's positions alone) says whether member q's queries
    see any of member k's keys. Then the ring is *direct*: at step t member r sends its own
    block to member r + t if that one needs it and receives member r - t's block if it needs
    it, so a block no one needs is never sent (with the load-balanced layout a window shorter
    than a chunk needs only the two neighbours). Otherwise ``need`` is None and the blocks
    are relayed to the next neighbour, every step."""

    def __init__(self, meta: torch.Tensor, use_doc: bool, ring_rank: int, tile: int, window: int = 0,
                 chunk: int = 0):
        self.meta, self.use_doc, self.tile, self.window, self.chunk = meta, use_doc, tile, window, chunk
        R, _, b, s = meta.shape
        self.R, self.r, self.b, self.s = R, ring_rank, b, s
        self.n = -(-s // tile)
        big = torch.iinfo(torch.int64).max
        pos, doc = meta[:, 0], meta[:, 1]
        pmin, pmax = _tile_view(pos, tile, big).amin(-1), _tile_view(pos, tile, -big).amax(-1)  # [R, b, n]
        dmin, dmax = _tile_view(doc, tile, big).amin(-1), _tile_view(doc, tile, -big).amax(-1)
        qmin, qmax = pmin[ring_rank, :, :, None], pmax[ring_rank, :, :, None]  # [b, nq, 1]
        kmin, kmax = pmin[:, :, None, :], pmax[:, :, None, :]  # [R, b, 1, nk]
        empty = _out_of_reach(qmin, qmax, kmin, kmax, window, chunk)
        full = qmin >= kmax
        ptiles = _tile_view(pos, tile, -1)  # [R, b, n, tile]
        increasing = (ptiles[..., 1:] > ptiles[..., :-1]).all(-1)  # [R, b, n]
        causal = (ptiles[ring_rank, :, :, None] == ptiles[:, :, None]).all(-1) & increasing[ring_rank, :, :, None]
        if window:
            inside = qmax - kmin < window
            full &= inside
            causal &= inside
        if chunk:
            lo, hi = torch.minimum(qmin, kmin), torch.maximum(qmax, kmax)
            one_chunk = torch.div(lo, chunk, rounding_mode="floor") == torch.div(hi, chunk, rounding_mode="floor")
            full &= one_chunk
            causal &= one_chunk
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
        reach = None
        if (window or chunk) and R > 1:  # which key tiles of which member some query of which member sees
            reach = _out_of_reach(pmin[:, None, :, :, None], pmax[:, None, :, :, None], pmin[None, :, :, None, :],
                                  pmax[None, :, :, None, :], window, chunk).all(2).all(2).logical_not()  # [Rq, Rk, nk]
            code = torch.cat([code.flatten(), reach.flatten().to(code.dtype)])
        codes = code.tolist()  # [R members][nq][nk] (and the reach): the one host read
        self.need: list[list[bool]] | None = None
        self.need_tiles: list[list[list[int]]] = []
        if reach is not None:
            n, n2 = self.n, self.n * self.n
            flat, codes = codes[R * n2:], [[codes[m * n2 + i * n:m * n2 + (i + 1) * n] for i in range(n)]
                                           for m in range(R)]
            self.need_tiles = [[[j for j in range(n) if flat[(q * R + k) * n + j]] for k in range(R)] for q in range(R)]
            self.need = [[bool(tiles) for tiles in row] for row in self.need_tiles]
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
            if tasks and self.need is not None and not self.need[ring_rank][j]:
                raise AssertionError(f"ring step {t}: member {ring_rank} computes tiles of member {j}'s block "
                                     "that its reach says it never receives")
            self.steps.append(tasks)
        self._partial_visible: torch.Tensor | None = None

    def post(self, t: int, own: torch.Tensor, held: torch.Tensor, group, dim: int | None) -> tuple[list, tuple]:
        """Post the exchange that brings step t's block (member r - t's): relayed, the block
        held at step t - 1 goes on to the next member; direct (``need``), the key tiles of
        this member's own block that member r + t sees go to it, and those of member r - t's
        that this one sees come in (``dim``: the payload's token dimension; None: whole
        blocks). Returns the works and what ``arrived`` takes once they are done. Both sides
        derive the same answer from ``need_tiles``, so sends and receives always pair up, in
        the same order per peer pair."""
        R, r = self.R, self.r
        if self.need is None:
            nxt = torch.empty_like(held)
            return exchange([(held, (r + 1) % R)], [(nxt, (r - 1) % R)], group, "cp"), (nxt, None)
        to, frm = (r + t) % R, (r - t) % R
        sends = [(self._pick(own, self.need_tiles[to][r], dim), to)] if self.need[to][r] else []
        tiles = self.need_tiles[r][frm] if self.need[r][frm] else None
        nxt = None if tiles is None else own.new_empty(self._part_shape(own, tiles, dim))
        return _Sent(exchange(sends, [(nxt, frm)] if nxt is not None else [], group, "cp"), sends), (nxt, tiles)

    def arrived(self, got: tuple, own: torch.Tensor, dim: int | None) -> torch.Tensor | None:
        """The step's whole block from what ``post`` received (tiles no query here sees: zeros)."""
        if got is None:  # (the last step: nothing more comes)
            return None
        part, tiles = got
        if tiles is None or dim is None or len(tiles) == self.n:
            return part
        return self.add_part(own.new_zeros(own.shape), part, tiles, dim)

    def post_grad(self, t: int, grad: torch.Tensor | None, like: torch.Tensor, group, dim: int | None) -> tuple:
        """Direct ring, backward: step t's gradient of member r - t's block (its seen tiles)
        goes straight back to it, and the part of this member's own block's gradient computed
        by member r + t comes in (when that one used it)."""
        R, r = self.R, self.r
        to, frm = (r - t) % R, (r + t) % R
        tiles = self.need_tiles[frm][r] if self.need[frm][r] else None
        incoming = None if tiles is None else like.new_empty(self._part_shape(like, tiles, dim))
        sends = [(self._pick(grad, self.need_tiles[r][to], dim), to)] if grad is not None else []
        return _Sent(exchange(sends, [(incoming, frm)] if incoming is not None else [], group, "cp"), sends), \
            (incoming, tiles)

    def _runs(self, tiles: list[int]) -> list[tuple[int, int]]:
        """(first token, tokens) of the contiguous runs of these key tiles."""
        runs: list[tuple[int, int]] = []
        for j in tiles:
            start, length = j * self.tile, self._len(j)
            if runs and sum(runs[-1]) == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((start, length))
        return runs

    def _pick(self, x: torch.Tensor, tiles: list[int], dim: int | None) -> torch.Tensor:
        if dim is None or len(tiles) == self.n:
            return x
        return torch.cat([x.narrow(dim, a, n) for a, n in self._runs(tiles)], dim)

    def _part_shape(self, x: torch.Tensor, tiles: list[int], dim: int | None) -> tuple:
        if dim is None or len(tiles) == self.n:
            return tuple(x.shape)
        return tuple(x.shape[:dim]) + (sum(n for _, n in self._runs(tiles)),) + tuple(x.shape[dim + 1:])

    def add_part(self, whole: torch.Tensor, part: torch.Tensor, tiles: list[int] | None, dim: int | None):
        """``whole`` (a block-sized tensor) plus ``part`` on its tiles, in place."""
        if tiles is None or dim is None or len(tiles) == self.n:
            return whole.add_(part)
        offset = 0
        for a, n in self._runs(tiles):
            whole.narrow(dim, a, n).add_(part.narrow(dim, offset, n))
            offset += n
        return whole

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
                       k[0][:, ks], k[1][:, ks] if self.use_doc else None, self.window, self.chunk)
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


class _HeadsPayload:
    """What travels on the ring by default: the k and v heads, [2, b, hkv, s, d] stacked (one
    message) when their widths match, else [b, hkv, s, dk + dv] side by side (k wider than
    v, as latent attention's expanded heads before a Ulysses all-to-all).

    A payload's protocol (a variant's own, such as ``cp/mla.py``'s, keeps it): ``params``
    (parameters its ``unpack`` uses, whose gradients the ring returns), ``pack(k, v)`` (what
    travels), ``unpack(cur)`` (a step's k, v), and for backward ``open(cur)`` (k, v and a
    gradient accumulator), ``add``, ``close`` (the gradient of what travels) and ``grads``
    (the gradients of the ring's k and v inputs); optionally ``token_dim``, the token
    dimension of what travels and of its gradient, so a direct ring sends only the key tiles
    seen."""

    params: tuple = ()

    def __init__(self, k, v, heads: int):
        self.dk, self.dv = k.shape[-1], v.shape[-1]
        self.groups = heads // k.shape[2]
        self.stacked = self.dk == self.dv
        self.token_dim = 3 if self.stacked else 2  # (of what travels and of its gradient)

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


class _RingAttention(torch.autograd.Function):
    """Exact attention of this rank's queries over every ring member's keys/values.

    q [b, s, H, d], k/v [b, s, Hkv, d] (this member's tokens), or what a variant's own
    payload packs in k and v None; ``payload`` says what travels and how it becomes the
    step's keys and values (``_HeadsPayload``; latent attention's in ``cp/mla.py``). Each (query tile, key tile)
    pair runs a fused kernel that returns its log-sum-exp (``models/attention_ops``); the
    blocks are merged by log-sum-exp in float32 (float64 for float64 inputs). Keys/values
    travel in their own (compute) dtype; the next block's exchange is posted before the
    current block is computed. With R = 1 it is tiled attention with block skipping.
    ``scale``: the softmax scale; ``sinks`` [H] or None: attention sinks, folded into the
    merged log-sum-exp once every block is in (``attention_ops._SinkAttention``'s rule), so
    each block's backward sees the sink-aware final out and lse.

    Message order (no tags: p2p matches in issue order per peer pair, as on NCCL). Every
    rank issues, towards its next ring neighbour, kv(0), dkv(0), kv(1), dkv(1), ..,
    kv(R-2), dkv(R-2), dkv(R-1) in the backward and kv(0) .. kv(R-2) in the forward, and
    posts the matching receives from its previous neighbour in the same order. Windowed and
    chunked layers' direct ring (``RingLayout.need``): at step t the block goes to member
    r + t and the gradient back to member r - t, only where needed; both sides read the same
    ``need`` and issue in step order (the block's exchange, then the gradient's), so every
    peer pair's messages still match in order."""

    @staticmethod
    def forward(ctx, q, k, v, layout: RingLayout, plan: ContextParallelPlan, payload, scale, sinks, *params):
        b, s, heads, d = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        qt = q.transpose(1, 2)
        own = cur = payload.pack(k, v)  # what travels, in the compute dtype
        dim = getattr(payload, "token_dim", None)  # (a direct ring sends only the key tiles seen)
        out = None  # [b, heads, s, dv] once v's width is known
        lse = torch.full((b, heads, s), float("-inf"), dtype=acc, device=q.device)
        R = layout.R
        auxes = []  # each block's kernel state (CUDA: philox seed/offset, lse width), for its backward
        for t in range(R):
            works, nxt = [], None
            if t < R - 1:  # the next block travels while this one is computed
                works, nxt = layout.post(t + 1, own, cur, plan.ring_group, dim)
            if cur is None:  # a direct ring's step whose block no query here sees: nothing came
                wait_all(works)
                cur = layout.arrived(nxt, own, dim)
                continue
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
            if t < R - 1:
                cur = layout.arrived(nxt, own, dim)
        if sinks is not None:  # lse' = logaddexp(lse, sink), out' = out exp(lse - lse')
            total = torch.logaddexp(lse, sinks.to(acc).view(1, -1, 1))
            out = out * torch.exp(lse - total).unsqueeze(-1)
            lse = total
        # The output in the compute dtype, rows [b, s, heads, d] contiguous: what the fused
        # backward takes (as flash attention's), and what the caller's output projection
        # saves too (a view), so the block keeps one copy of it, not an fp32 one besides.
        result = out.transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.layout, ctx.plan, ctx.auxes, ctx.payload, ctx.scale = layout, plan, auxes, payload, scale
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        layout: RingLayout = ctx.layout
        plan: ContextParallelPlan = ctx.plan
        b, s, heads, d = q.shape
        payload = ctx.payload
        param_grads = [None] * len(payload.params)
        acc = lse.dtype
        scale = ctx.scale
        qt, dout = q.transpose(1, 2), grad_out.to(q.dtype).transpose(1, 2)
        out_k, lse_k = out.transpose(1, 2), _finite(lse)  # the final rows: P = exp(S - lse_final)
        dq = torch.zeros(b, heads, s, d, dtype=acc, device=q.device)
        own = cur = payload.pack(k, v)
        dim = getattr(payload, "token_dim", None)
        R = layout.R
        nxt_peer, prev_peer = (plan.ring_rank + 1) % R, (plan.ring_rank - 1) % R
        incoming, acc_works, dkv = None, [], None
        auxes = iter(ctx.auxes)
        # Relayed: the gradient of member j's keys/values travels with them: every rank adds
        # its part and passes it on; after R hops it is back at j, complete. Direct: each
        # member's part goes straight back to j, which sums them.
        for t in range(R):
            works, nxt = [], None
            if t < R - 1:
                works, nxt = layout.post(t + 1, own, cur, plan.ring_group, dim)
            if cur is None:  # (direct) no block this step: only the gradients of earlier steps move
                incoming, acc_works, dkv = _direct_grad_step(layout, plan, t, None, dkv, incoming, acc_works, dim)
                wait_all(works)
                cur = layout.arrived(nxt, own, dim)
                continue
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
            grad = payload.close(state, param_grads)  # this step's gradient of what travels
            if layout.need is not None:
                incoming, acc_works, dkv = _direct_grad_step(layout, plan, t, grad, dkv, incoming, acc_works, dim)
            elif R > 1:
                dkv = grad
                wait_all(acc_works)
                if incoming is not None:
                    dkv += incoming
                incoming = torch.empty_like(dkv)
                acc_works = exchange([(dkv, nxt_peer)], [(incoming, prev_peer)], plan.ring_group, "cp")
            else:
                dkv = grad
            wait_all(works)
            if t < R - 1:
                cur = layout.arrived(nxt, own, dim)
        if layout.need is not None:
            wait_all(acc_works)
            if incoming is not None and incoming[0] is not None:
                layout.add_part(dkv, *incoming, dim)
        elif R > 1:
            wait_all(acc_works)
            dkv = incoming
        dk, dv = payload.grads(dkv, k, v)
        dsink = None
        if sinks is not None:  # -sum over queries of exp(sink - lse') rowsum(dout * out')
            delta = (dout.to(acc) * out_k.to(acc)).sum(-1)
            dsink = -(torch.exp(sinks.to(acc).view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sinks.dtype)
        return (dq.transpose(1, 2).to(q.dtype), dk, dv, None, None, None, None, dsink, *param_grads)


def _direct_grad_step(layout: RingLayout, plan: ContextParallelPlan, t: int, grad, total, incoming, works, dim):
    """A direct ring's backward step t: ``grad`` (None: no block this step) goes back to its
    member, this member's own part from member r + t comes in; ``total`` sums this member's
    block's gradient (step 0's part first, then each arrival once its exchange is done).
    Returns (incoming: (part, tiles) or None, works, total)."""
    if t == 0:
        return None, [], grad
    new_works, new_incoming = layout.post_grad(t, grad, total, plan.ring_group, dim)
    wait_all(works)  # the previous step's arrival: added now, one receive buffer in flight at a time
    if incoming is not None and incoming[0] is not None:
        layout.add_part(total, *incoming, dim)
    return new_incoming, new_works, total


def ring_attention(q, k, v, meta: torch.Tensor, use_doc: bool, plan: ContextParallelPlan,
                   layout: RingLayout | None = None, payload=None, scale: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Ring attention of the local q/k/v [b, s, heads, d] over the ring of ``plan``; ``meta``
    [R, 2, b, s] holds every member's (positions, doc ids). With ``payload`` (a variant's own,
    see ``_HeadsPayload``), ``k`` is what it packs (``v`` None) and it travels instead of the
    heads, each step making its keys and values. ``scale``: the softmax scale (None =
    1/sqrt(q's head width)); ``sinks`` [heads]: attention sinks; a sliding window is the
    ``layout``'s."""
    if layout is None:
        layout = RingLayout(meta, use_doc, plan.ring_rank, plan.tile or meta.shape[-1])
    if plan.count_work:
        plan.work.add(layout)
    plan.device = q.device
    if payload is None:
        payload = _HeadsPayload(k, v, q.shape[2])
    return _RingAttention.apply(q, k, v, layout, plan, payload, scale or 1.0 / math.sqrt(q.shape[-1]), sinks,
                                *payload.params)
