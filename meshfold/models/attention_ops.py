"""Fused attention kernels that return the log-sum-exp, and attention over packed documents.

Ring attention (``parallel/cp/ring.py``) computes attention block by block and merges the
blocks with their log-sum-exp, and its backward feeds the *final* output and log-sum-exp
back into each block's fused backward (the flash-attention rule: P = exp(S - lse_final)).
That needs the kernels one level below ``F.scaled_dot_product_attention``, which hides the
log-sum-exp. ``attention_forward`` / ``attention_backward`` pick one by device and dtype:

==========  =================================  ==========================================
device      no mask (full or causal block)     partial block (mask)
==========  =================================  ==========================================
CPU         ``_scaled_dot_product_flash_attention_for_cpu`` (fp64/fp32/bf16, additive mask)
CUDA        ``_scaled_dot_product_flash_attention`` (fp16/bf16)   ``_efficient_attention`` (fp32/fp16/bf16, bias)
otherwise   ``math``: explicit matmul / logsumexp (the exact reference; CUDA float64)
==========  =================================  ==========================================

Layouts: q [b, h, sq, d], k/v [b, h, sk, d] (key/value heads already repeated for grouped
queries), mask bool [b or 1, 1, sq, sk] (True = visible). ``lse`` is returned in
float32 (float64 for float64 inputs), [b, h, sq], with -inf for a row that sees no key.

``document_attention`` is per-document causal attention for packed rows without an S x S
mask: the row is cut into query tiles; each tile attends only to the key window from the
start of its first token's document to its own end (documents are contiguous), tiles with
equal windows are batched into one fused call with a small per-tile mask. Work is about
S * (tile + document length) instead of S^2 / 2. ``chunk_attention`` (chunked, block-local
attention) is the same with chunk boundaries as document boundaries.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from meshfold.gpucheck import on_cuda

KERNELS = ("auto", "math")  # "math" forces the reference path (tests compare the two)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def pick_kernel(q: torch.Tensor, masked: bool, kernel: str = "auto") -> str:
    """Which implementation runs a block: cpu_flash, cuda_flash, cuda_efficient or math."""
    if kernel == "math":
        return "math"
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and not masked:
            return "cuda_flash"
        if q.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return "cuda_efficient"
    return "math"


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def attention_forward(q, k, v, *, causal: bool, mask: torch.Tensor | None, scale: float, kernel: str = "auto"):
    """(out in q.dtype, lse, aux for the backward) of one block. The fused kernels want one
    head width for q, k and v: a narrower v (latent attention's) is zero-padded to it and
    the output's extra columns (zeros) dropped, which is exact."""
    if v.shape[-1] != q.shape[-1]:
        width = max(q.shape[-1], v.shape[-1])
        out, lse, aux = attention_forward(_pad_last(q, width), _pad_last(k, width), _pad_last(v, width),
                                          causal=causal, mask=mask, scale=scale, kernel=kernel)
        return out[..., :v.shape[-1]], lse, aux
    kind = pick_kernel(q, mask is not None, kernel)
    aux = (kind,)
    if kind == "cpu_flash":
        bias = None if mask is None else _additive(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    elif kind == "cuda_flash":
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        aux = (kind, cq, ck, mq, mk, seed, offset)
    elif kind == "cuda_efficient":
        bias = None if mask is None else _additive(mask, q.dtype).expand(q.shape[0], q.shape[1], -1, -1)
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale)
        aux = (kind, seed, offset, lse.shape[-1])
        lse = lse[..., : q.shape[2]]  # padded to a multiple of the kernel's row block
    else:
        out, lse = _math_forward(q, k, v, causal, mask, scale)
    if mask is not None:  # the fused kernels report lse 0 (not -inf) for a row with no visible key
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse, aux


def attention_backward(dout, q, k, v, out, lse, aux, *, causal: bool, mask: torch.Tensor | None, scale: float):
    """(dq, dk, dv) of one block, given the *final* out (q.dtype) and lse (finite) of its rows.
    Unequal head widths padded as in ``attention_forward`` (zero columns of out and dout add
    nothing to rowsum(dout * out))."""
    if v.shape[-1] != q.shape[-1]:
        width, dq_w, dv_w = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
        dq, dk, dv = attention_backward(_pad_last(dout, width), _pad_last(q, width), _pad_last(k, width),
                                        _pad_last(v, width), _pad_last(out, width), lse, aux, causal=causal,
                                        mask=mask, scale=scale)
        return dq[..., :dq_w], dk[..., :dq_w], dv[..., :dv_w]
    kind = aux[0]
    if kind == "cpu_flash":
        bias = None if mask is None else _additive(mask, q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    if kind == "cuda_flash":
        _, cq, ck, mq, mk, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale)
    if kind == "cuda_efficient":
        _, seed, offset, width = aux
        bias = None if mask is None else _additive(mask, q.dtype).expand(q.shape[0], q.shape[1], -1, -1)
        lse_k = F.pad(lse.float(), (0, width - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse_k, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return _math_backward(dout, q, k, v, out, lse, causal, mask, scale)


def _visible(causal, mask, sq, sk, device):
    if causal:
        tri = torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
        return tri if mask is None else mask & tri
    return mask


def _math_forward(q, k, v, causal, mask, scale):
    acc = _acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    vis = _visible(causal, mask, q.shape[2], k.shape[2], q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.matmul(p, v.to(acc)).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, mask, scale):
    acc = _acc_dtype(q.dtype)
    qa, ka, va, da = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    p = torch.exp(torch.matmul(qa, ka.transpose(-1, -2)) * scale - lse.to(acc).unsqueeze(-1))
    vis = _visible(causal, mask, q.shape[2], k.shape[2], q.device)
    if vis is not None:
        p = p.masked_fill(~vis, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), da)
    dp = torch.matmul(da, va.transpose(-1, -2))
    delta = (da * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return torch.matmul(ds, ka).to(q.dtype), torch.matmul(ds.transpose(-1, -2), qa).to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------- attention sinks


class _SinkAttention(torch.autograd.Function):
    """Attention whose softmax denominator also holds exp(sink) per head (a learned logit
    with a zero value: gpt-oss's sinks), through the fused kernels' log-sum-exp, no mask:
    lse = logaddexp(lse_keys, sink), out = out_keys * exp(lse_keys - lse) (= sigmoid(lse_keys
    - sink)). Backward is the kernels' own with that final out and lse (P = exp(S - lse) is
    then the sink-aware softmax), and d sink = -sum over queries of exp(sink - lse) *
    rowsum(dout * out) (the sink's score gradient, its value being zero)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, mask, scale):
        out, lse, aux = attention_forward(q, k, v, causal=causal, mask=mask, scale=scale)
        sink = sinks.to(lse.dtype).view(1, -1, 1)
        total = torch.logaddexp(lse, sink)
        out = (out.to(total.dtype) * torch.exp(lse - total).unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, total, sinks, mask)
        ctx.aux, ctx.causal, ctx.scale = aux, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, total, sinks, mask = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = attention_backward(dout, q, k, v, out, total, ctx.aux, causal=ctx.causal, mask=mask,
                                        scale=ctx.scale)
        delta = (dout.to(total.dtype) * out.to(total.dtype)).sum(-1)
        dsink = -(torch.exp(sinks.to(total.dtype).view(1, -1, 1) - total) * delta).sum((0, 2))
        return dq, dk, dv, dsink.to(sinks.dtype), None, None, None


def sdpa(q, k, v, *, causal: bool = False, mask: torch.Tensor | None = None, scale: float | None = None,
         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (q [b, H, sq, d], k/v [b, Hkv, sk, d], bool ``mask``
    True = visible) with optional attention sinks ``sinks`` [H] (``_SinkAttention``: the fused
    kernels and their log-sum-exp; grouped kv heads repeated for them)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1], scale=scale)
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if mask is not None and causal:
        mask = mask & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        causal = False
    return _SinkAttention.apply(q, k, v, sinks, causal, mask, scale or attention_scale(q.shape[-1]))


# --------------------------------------------------------------------------- packed documents


def document_windows(doc_ids: torch.Tensor, tile: int) -> torch.Tensor:
    """[b, n_tiles] how many earlier tiles each query tile's keys reach back (documents are
    contiguous runs of equal ids, so a tile needs keys from its first token's document start)."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, -1)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.where(starts, idx, 0).cummax(-1).values  # index where each token's document starts
    first = doc_start[:, ::tile]  # document start of each tile's first token
    return (torch.arange(0, s, tile, device=doc_ids.device) // tile) - first // tile


DOCUMENT_TILE = 256  # query tile of document attention (256 measured fastest on CPU at seq 4096)


class DocumentPlan:
    """What ``document_attention`` needs of a micro-batch's documents, made once and shared by
    every layer (they all see the same ``doc_ids``/``positions``): for the flash varlen kernel
    (CUDA) the document runs, for the tile path the query tiles grouped by how far back their
    keys reach, with their gather indices and (tile x window) masks. Each is made on first
    use, with its one host read, never inside a layer's own work."""

    def __init__(self, doc_ids: torch.Tensor, positions: torch.Tensor | None, tile: int):
        b, s = doc_ids.shape
        self.tile = min(tile, s)
        self.pad = (-s) % self.tile
        self.n = (s + self.pad) // self.tile
        if positions is None:
            positions = torch.arange(s, device=doc_ids.device).expand(b, -1)
        self.doc_ids, self.positions = doc_ids, positions
        self._groups = self._runs = None

    def prepare(self, flash: bool) -> "DocumentPlan":
        """Make now (before the layers) what the kernel path will read: the runs for flash
        varlen, else the tile groups."""
        _ = self.runs if flash else self.groups
        return self

    @property
    def groups(self) -> list[tuple]:
        """The tile path's query tiles grouped by window: (flat tile indices, key rows, key
        tile spans, mask [m, 1, tile, (w+1)*tile]), made on first use."""
        if self._groups is None:
            self._groups = self._tile_groups()
        return self._groups

    def _tile_groups(self) -> list[tuple]:
        doc_ids, positions, tile, n, pad = self.doc_ids, self.positions, self.tile, self.n, self.pad
        b, device = doc_ids.shape[0], doc_ids.device
        if pad:  # pad tokens form their own document: they see only each other, nobody sees them
            doc_ids = torch.cat([doc_ids, (doc_ids.min() - 1).expand(b, pad)], 1)
            positions = F.pad(positions, (0, pad))
        reach = document_windows(doc_ids, tile).flatten()  # [b * n], exact: tile i reaches tiles i-w..i
        pt, dt = positions.reshape(b, n, tile), doc_ids.reshape(b, n, tile)
        groups = []
        fake = is_fake(reach)  # the dry-run's tensors carry no values: every tile reaches one tile back
        for w in [1] if fake else torch.unique(reach).tolist():  # the one host read
            sel = torch.arange(b * n, device=device) if fake else (reach == w).nonzero().squeeze(1)
            row, ti = (sel // n).unsqueeze(1), sel % n
            span = (ti.unsqueeze(1) + torch.arange(-w, 1, device=device)).clamp(min=0)  # key tiles [m, w + 1]
            kd, kp = dt[row, span].flatten(1, 2), pt[row, span].flatten(1, 2)
            mask = ((dt.reshape(b * n, tile)[sel].unsqueeze(-1) == kd.unsqueeze(-2))
                    & (pt.reshape(b * n, tile)[sel].unsqueeze(-1) >= kp.unsqueeze(-2)))
            groups.append((sel, row, span, mask.unsqueeze(1)))
        return groups

    @property
    def runs(self) -> tuple[torch.Tensor, int]:
        """The flash varlen kernel's view of the micro-batch: (cumulative run starts over the
        flattened rows, int32 on the device, and the longest run). A run is a stretch of one
        document with rising positions; rows end runs. One host read (the run starts, a
        [b * s] bool copy), made on first use."""
        if self._runs is None:
            doc_ids = self.doc_ids
            b, s = doc_ids.shape
            host = _noted_starts(doc_ids)  # the data loader's, made on the host: no read
            if host is None:
                host = run_starts(doc_ids, self.positions).flatten().cpu()  # the one host read
            else:
                host = host.flatten()
            if is_fake(host):  # the dry-run's tensors carry no values: one run per row
                cu, longest = torch.arange(0, b * s + 1, s, dtype=torch.int32), s
            else:
                cu = torch.cat([host.nonzero().squeeze(1), torch.tensor([b * s])]).to(torch.int32)
                longest = int((cu[1:] - cu[:-1]).max())
            self._runs = (cu.to(doc_ids.device, non_blocking=True), longest)
        return self._runs


def run_starts(doc_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """[b, s] bool: where a run of one document with rising positions begins (row starts too)."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    if positions is not None:
        starts[:, 1:] |= positions[:, 1:] <= positions[:, :-1]
    return starts


_NOTED: list[tuple] = []  # (weakref to a micro-batch's doc_ids on the device, its run starts on the host)


def note_run_starts(doc_ids: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor | None = None) -> None:
    """The run starts of the device tensor ``doc_ids``, computed on the host by whoever moved
    it there (the data loader), with the positions' host copy where it has one: the plan
    then needs no device read for them (nor ``chunk_ids``' for its runs)."""
    _NOTED.append((weakref.ref(doc_ids), starts, positions))
    del _NOTED[:-_PLANS_KEPT]


def _noted(doc_ids: torch.Tensor) -> tuple | None:
    return next(((starts, pos) for ref, starts, pos in reversed(_NOTED) if ref() is doc_ids), None)


def _noted_starts(doc_ids: torch.Tensor) -> torch.Tensor | None:
    noted = _noted(doc_ids)
    return None if noted is None else noted[0]


_PLANS: list[tuple] = []  # (weakref to the key tensor, weakref to positions or None, tile, plan), newest last
_PLANS_KEPT = 8  # micro-batches in flight at once (pipeline schedules, recompute in backward)


def document_plan(doc_ids: torch.Tensor, positions: torch.Tensor | None, tile: int = DOCUMENT_TILE,
                  key: torch.Tensor | None = None) -> DocumentPlan:
    """The plan of these tensors (by identity: a micro-batch's layers share them), made on
    first use. ``key``: the tensor whose identity stands for (doc_ids, positions) when those
    are fresh views of it on every call (context parallel's gathered metadata)."""
    anchor = key if key is not None else doc_ids
    for ref, pref, t, plan in reversed(_PLANS):
        if ref() is anchor and t == tile and (pref is None if positions is None or key is not None
                                              else pref() is positions):
            return plan
    plan = DocumentPlan(doc_ids, positions, tile)
    pref = None if positions is None or key is not None else weakref.ref(positions)
    _PLANS.append((weakref.ref(anchor), pref, tile, plan))
    del _PLANS[:-_PLANS_KEPT]
    return plan


@torch.compiler.disable  # compiled blocks call it eagerly: its plan lookup and group loop are Python
def document_attention(q, k, v, positions: torch.Tensor | None, doc_ids: torch.Tensor, tile: int = DOCUMENT_TILE,
                       key: torch.Tensor | None = None, scale: float | None = None,
                       sinks: torch.Tensor | None = None):
    """Causal attention within each packed document (``document_causal_mask`` semantics for
    contiguous documents); q [b, s, H, d], k/v [b, s, Hkv, d] -> [b, s, H, d]. Differentiable
    (plain fused SDPA calls, one per distinct window size, each with a tile-sized mask). No
    host read: the windows come from the micro-batch's ``document_plan``. ``scale``: the
    softmax scale (None = 1/sqrt(d)); ``sinks`` [H]: attention sinks (``sdpa``)."""
    b, s, heads, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]  # latent attention: v's head size differs from q/k's
    plan = document_plan(doc_ids, positions, tile, key)
    if flash_varlen_ok(q, q.dtype, d, dv):
        cu, longest = plan.runs
        out = _FlashVarlen.apply(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, longest,
                                scale or attention_scale(d), sinks)
        return out.view(b, s, heads, dv)
    tile, pad, n = plan.tile, plan.pad, plan.n
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    qt = q.reshape(b * n, tile, heads, d)
    kt, vt = k.reshape(b, n, tile, hkv, d), v.reshape(b, n, tile, hkv, dv)
    out = q.new_empty(b * n, tile, heads, dv)
    # CUDA's fused kernel for masked calls (memory-efficient) takes no grouped kv heads: with
    # them SDPA falls back to the math kernel, so the window's k/v are repeated per query head
    # (a window-sized copy); the CPU kernel takes grouped heads with a mask
    repeat = heads // hkv if heads != hkv and on_cuda(q) else 1
    for sel, row, span, mask in plan.groups:
        kw, vw = kt[row, span].flatten(1, 2), vt[row, span].flatten(1, 2)
        if repeat > 1:
            kw, vw = kw.repeat_interleave(repeat, dim=2), vw.repeat_interleave(repeat, dim=2)
        o = sdpa(qt[sel].transpose(1, 2), kw.transpose(1, 2), vw.transpose(1, 2), mask=mask, scale=scale, sinks=sinks)
        out = out.index_copy(0, sel, o.transpose(1, 2))
    return out.view(b, s + pad, heads, dv)[:, :s]


_WINDOW_MASKS: list[tuple] = []  # (weakref to the anchor tensor or None, key, mask), newest last


@torch.compiler.disable  # its cache lookup is Python: traced, a compiled block would keep the first micro-batch's mask
def window_mask(sq: int, window: int, device, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [b or 1, 1, sq, sq] sliding-window causal mask: a key is visible when it is at
    most ``window - 1`` positions before the query (and in its document with ``doc_ids``).
    Made once per shape and window, or once per micro-batch (``doc_ids``/``positions`` by
    identity) and window, and shared by every windowed layer: never one mask per layer."""
    anchor = key if key is not None else doc_ids if doc_ids is not None else positions
    key = (sq, window, str(device))
    for ref, k, mask in reversed(_WINDOW_MASKS):
        if k == key and (ref is None if anchor is None else ref is not None and ref() is anchor):
            return mask
    pos = positions if positions is not None else torch.arange(sq, device=device).unsqueeze(0)
    gap = pos.unsqueeze(-1) - pos.unsqueeze(-2)
    mask = (gap >= 0) & (gap < window)
    if doc_ids is not None:
        mask = mask & (doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2))
    mask = mask.unsqueeze(1)
    _WINDOW_MASKS.append((None if anchor is None else weakref.ref(anchor), key, mask))
    del _WINDOW_MASKS[:-_PLANS_KEPT]
    return mask


def window_attention(q, k, v, window: int, positions: torch.Tensor | None = None,
                     doc_ids: torch.Tensor | None = None, scale: float | None = None,
                     sinks: torch.Tensor | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
    """Sliding-window causal attention, q [b, s, H, d], k/v [b, s, Hkv, d] -> [b, s, H, dv].
    On CUDA in fp16/bf16 (``flash_varlen_ok``): flash attention's own window
    (``window_size_left = window - 1``) over each row, or over each document's run with
    ``doc_ids`` (the varlen kernel: a window restarts with its document), no mask, the key
    tiles outside the band skipped. Else one fused SDPA call with the shared banded mask
    (``window_mask``; CPU: the flash kernel, CUDA fp32: the memory-efficient one). ``key``: the
    tensor whose identity stands for (doc_ids, positions) when they are fresh views of it on
    every call (context parallel's gathered metadata), as ``document_plan`` takes it."""
    b, s, heads, d = q.shape
    if flash_varlen_ok(q, q.dtype, d, v.shape[-1]):
        if doc_ids is not None:
            cu, longest = document_plan(doc_ids, positions, key=key).runs
        else:  # one run per row (made on the device: no host read)
            cu, longest = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device), s
        out = _FlashVarlen.apply(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, longest,
                                 scale or attention_scale(d), sinks, window)
        return out.view(b, s, heads, v.shape[-1])
    if doc_ids is None and positions is None and s > 2 * window:
        return banded_window_attention(q, k, v, window, scale, sinks)
    mask = window_mask(q.shape[1], window, q.device, positions, doc_ids, key)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return sdpa(q, k, v, mask=mask, scale=scale, sinks=sinks).transpose(1, 2)


WINDOW_TILE = 128  # query tile of the banded window path (on CPU: 3.2-3.6x full causal at window 1,024 of 8,192)

_BANDS: list[tuple] = []  # ((tile, reach, n, window, device), mask), newest last


def _band_mask(tile: int, reach: int, n: int, window: int, device) -> torch.Tensor:
    """[n, 1, tile, (reach + 1) tile] bool: query t of tile i sees key j of its key span
    (tiles i - reach .. i) when 0 <= gap < window, gap = reach * tile + t - j; the first
    tiles' spans start before the row (zero keys): those are hidden. Made once per shape."""
    key = (tile, reach, n, window, str(device))
    for k, mask in _BANDS:
        if k == key:
            return mask
    t = torch.arange(tile, device=device).unsqueeze(-1)
    j = torch.arange((reach + 1) * tile, device=device)
    gap = reach * tile + t - j
    band = (gap >= 0) & (gap < window)
    first_real = ((reach - torch.arange(n, device=device)).clamp(min=0) * tile).view(n, 1, 1)
    mask = (band & (j >= first_real)).unsqueeze(1)
    _BANDS.append((key, mask))
    del _BANDS[:-_PLANS_KEPT]
    return mask


@torch.compiler.disable  # as window_mask: its band cache lookup is Python, run eagerly in compiled blocks
def banded_window_attention(q, k, v, window: int, scale: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Sliding-window causal attention over plain rows without a fused windowed kernel (the
    CPU): queries in tiles of ``WINDOW_TILE``, each attending only the key tiles its window
    reaches (one fused SDPA call over all tiles with one band mask), so the work is
    S x (window + tile) instead of the S x S a banded mask over the whole row computes."""
    b, s, heads, d = q.shape
    hkv, dv = k.shape[2], v.shape[-1]
    tile = min(WINDOW_TILE, window)
    reach = -(-(window - 1) // tile)  # key tiles before the query's own
    n = -(-s // tile)
    pad = n * tile - s
    qt = F.pad(q, (0, 0, 0, 0, 0, pad)).reshape(b * n, tile, heads, d).transpose(1, 2)
    # keys: reach zero tiles before the row, so tile i's span is padded rows [i, i + reach]
    kp, vp = (F.pad(t, (0, 0, 0, 0, reach * tile, pad)) for t in (k, v))
    span = (reach + 1) * tile
    kt, vt = (t.unfold(1, span, tile).permute(0, 1, 4, 2, 3).reshape(b * n, span, hkv, t.shape[-1]).transpose(1, 2)
              for t in (kp, vp))
    mask = _band_mask(tile, reach, n, window, q.device).repeat(b, 1, 1, 1)
    out = sdpa(qt, kt, vt, mask=mask, scale=scale, sinks=sinks)  # [b n, H, tile, dv]
    return out.transpose(1, 2).reshape(b, n * tile, heads, dv)[:, :s]


_CHUNK_IDS: list[tuple] = []  # (weakref to the anchor tensor, chunk, ids), newest last


@torch.compiler.disable  # compiled blocks call it eagerly: its lookup by identity is Python
def chunk_ids(doc_ids: torch.Tensor | None, positions: torch.Tensor, chunk: int) -> torch.Tensor:
    """[b, s] ids of the runs a chunked layer attends within: a new run where the document
    or the chunk (``position // chunk``) changes, so chunk boundaries are document boundaries
    and ``document_attention`` computes chunked attention. On the device, no host read; made
    once per micro-batch (``doc_ids``, else ``positions``, by identity) and chunk size, and
    shared by every chunked layer (their document plan with it)."""
    anchor = doc_ids if doc_ids is not None else positions
    for ref, c, ids in reversed(_CHUNK_IDS):
        if c == chunk and ref() is anchor:
            return ids
    block = torch.div(positions, chunk, rounding_mode="floor")
    starts = torch.zeros_like(block, dtype=torch.bool)
    starts[:, 1:] = block[:, 1:] != block[:, :-1]
    if doc_ids is not None:
        starts[:, 1:] |= doc_ids[:, 1:] != doc_ids[:, :-1]
    ids = starts.long().cumsum(1)
    noted = _noted(doc_ids) if doc_ids is not None else None
    if noted is not None:
        # the loader's host copies give the runs' starts on the host too: no read back (a batch
        # noted without positions has the default ones, 0..s-1, as sequence parallel fills them)
        host_pos = noted[1] if noted[1] is not None else torch.arange(positions.shape[1]).expand_as(noted[0])
        host_block = torch.div(host_pos, chunk, rounding_mode="floor")
        host_starts = noted[0].clone()
        host_starts[:, 1:] |= host_block[:, 1:] != host_block[:, :-1]
        note_run_starts(ids, host_starts)
    _CHUNK_IDS.append((weakref.ref(anchor), chunk, ids))
    del _CHUNK_IDS[:-_PLANS_KEPT]
    return ids


def chunk_attention(q, k, v, chunk: int, positions: torch.Tensor | None = None,
                    doc_ids: torch.Tensor | None = None, scale: float | None = None,
                    tile: int = DOCUMENT_TILE) -> torch.Tensor:
    """Chunked (block-local) causal attention: a query sees the earlier keys of its own chunk
    of ``chunk`` positions (``position // chunk`` equal; Llama 4's ``attention_chunk_size``)
    and of its document. q [b, s, H, d], k/v [b, s, Hkv, d] -> [b, s, H, dv]; never an S x S
    mask. Contiguous positions without documents: the row is reshaped into its chunks and
    run as one causal fused call over [b * s / chunk] rows (zero keys padded at the end are
    after every real query: unseen); otherwise chunk boundaries join the document boundaries
    (``chunk_ids``) and ``document_attention`` runs it per tile."""
    b, s, heads, d = q.shape
    if doc_ids is None and positions is None:
        width = min(chunk, s)
        pad = (-s) % width
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        n = (s + pad) // width
        qc, kc, vc = (t.reshape(b * n, width, t.shape[2], t.shape[3]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=heads != k.shape[2], scale=scale)
        return out.transpose(1, 2).reshape(b, s + pad, heads, v.shape[-1])[:, :s]
    rising = positions if positions is not None else torch.arange(s, device=q.device).expand(b, -1)
    return document_attention(q, k, v, positions, chunk_ids(doc_ids, rising, chunk), tile, scale=scale)


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


FLASH_VARLEN = True  # packed documents through flash-attention's varlen kernel on CUDA (benchmarks switch it)


def flash_varlen_ok(x: torch.Tensor, dtype: torch.dtype, qk_dim: int, v_dim: int) -> bool:
    """Whether packed documents go to flash-attention's varlen kernel: on CUDA (``x``'s
    device) in fp16/bf16, equal q and v head sizes up to 256. It takes grouped kv heads
    natively and no mask, so it computes only the documents' causal triangles (the tile path
    adds a tile per query tile, a mask and, on CUDA, kv heads repeated per query head for the
    memory-efficient kernel)."""
    return (FLASH_VARLEN and on_cuda(x) and dtype in (torch.float16, torch.bfloat16)
            and qk_dim == v_dim and qk_dim <= 256 and qk_dim % 8 == 0)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the next matmul on ``x`` computes in (autocast's, when it is on)."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


class _FlashVarlen(torch.autograd.Function):
    """Causal attention within each run of ``cu`` (flattened [tokens, heads, d] layout);
    ``sinks`` [H]: attention sinks; ``window`` > 0: each query's ``window`` latest keys only
    (flash attention's ``window_size_left = window - 1``, right 0)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, longest, scale, sinks=None, window=0):
        ctx.band = dict(window_size_left=window - 1, window_size_right=0) if window else {}
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale, **ctx.band)
        if sinks is not None:  # lse [H, tokens]: the sink joins it (``_SinkAttention``'s rule)
            total = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
            out = (out.to(lse.dtype) * torch.exp(lse - total).t().unsqueeze(-1)).to(q.dtype)
            lse = total
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused, sinks)
        ctx.longest, ctx.scale = longest, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu, cu, ctx.longest, ctx.longest, 0.0, True, rng, unused,
            scale=ctx.scale, **ctx.band)
        dsink = None
        if sinks is not None:
            delta = (dout.float() * out.float()).sum(-1).t()  # [H, tokens]
            dsink = -(torch.exp(sinks.float()[:, None] - lse) * delta).sum(1).to(sinks.dtype)
        return dq, dk, dv, None, None, None, dsink, None
