"""Gradient codecs for the per-step data-parallel path, and the 4-bit format of Streaming
DiLoCo's outer gradients.

Every codec works on a list of named local gradient tensors of one data-parallel group and
turns them, in place, into the group *mean* of what the codec lets through. Codecs with
error feedback keep, per rank and per tensor, what was not sent and add it to the next
step's gradient, so nothing is lost over steps:

    compensated = g + e_old          sent(compensated) + e_new = compensated   (exactly)

Each codec records the bytes this rank sends in the comm ledger under dim ``"dp"``, with the
real sizes of what goes on the wire (packed bits, int32 indices, fp32 scales).

Codecs (docs/lowcomm.md has the equations):
  PowerSGD  rank-r P Q^T with warm-started Q and error feedback (Vogels et al. 2019)
  TopK      top-k of |accumulator| with error feedback, DGC momentum correction and
            exponential sparsity warm-up (Lin et al. 2018)
  Sign      1 bit per element plus one fp32 scale (mean |x|) per tensor, error feedback
            (the compressor of 1-bit Adam, Tang et al. 2021)
  LGreCo    PowerSGD with a rank per layer chosen by a knapsack dynamic program under an
            error budget (Markov et al. 2024, L-GreCo)
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from meshfold.comm import ledger

# --------------------------------------------------------------------------- helpers


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _all_reduce_mean(t: torch.Tensor, group) -> torch.Tensor:
    n = _world(group)
    if n > 1:
        ledger().record("dp", "all_reduce", t.numel() * t.element_size(), n)
        dist.all_reduce(t, group=group)
        t.div_(n)
    return t


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool[N] -> uint8[ceil(N/8)], little-endian within a byte."""
    n = bits.numel()
    padded = torch.zeros(8 * math.ceil(n / 8), dtype=torch.uint8)
    padded[:n] = bits.flatten().to(torch.uint8)
    weights = (2 ** torch.arange(8, dtype=torch.uint8))
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.flatten()[:n].bool()


# --------------------------------------------------------------------------- 4-bit E3M0

# FP4 "E3M0": 1 sign bit + 3 exponent bits, no mantissa. Code e=0 is zero, e=1..7 is
# 2^(e-7) times the block scale (the block's max |x|), so magnitudes {0, 1/64, .., 1/2, 1}.
FP4_LEVELS = torch.tensor([0.0] + [2.0 ** (e - 7) for e in range(1, 8)], dtype=torch.float64)
FP4_BLOCK = 128  # elements sharing one fp32 scale (0.25 extra bits per element)


def fp4_quantize(x: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (1-D, length a multiple of ``block``) -> (uint8 codes packed two per byte, fp32 scales).
    Rounds each |x|/scale to the nearest level in linear distance (ties round up)."""
    xb = x.double().view(-1, block)
    scale = xb.abs().amax(1).float()
    safe = scale.double().clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    r = (xb.abs() / safe).clamp(max=1.0)
    mids = (FP4_LEVELS[1:] + FP4_LEVELS[:-1]) / 2
    exp = torch.bucketize(r, mids, right=True).to(torch.uint8)  # 0..7
    code = exp | ((xb < 0).to(torch.uint8) << 3)
    code = code.flatten()
    return (code[0::2] | (code[1::2] << 4)).contiguous(), scale


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
    code = torch.stack([packed & 0xF, packed >> 4], 1).flatten()
    mag = FP4_LEVELS.to(dtype)[(code & 7).long()]
    sign = 1 - 2 * ((code >> 3) & 1).to(dtype)
    return (sign * mag).view(-1, block).mul_(scale.to(dtype).unsqueeze(1)).flatten()


def fp4_bytes(numel: int, block: int = FP4_BLOCK) -> int:
    return numel // 2 + 4 * (numel // block)


def _padded_chunks(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``x`` as float64, zero-padded to n equal chunks of whole FP4 blocks; the chunk length."""
    unit = FP4_BLOCK * n
    padded = torch.zeros(unit * math.ceil(x.numel() / unit), dtype=torch.float64)
    padded[:x.numel()] = x.double()
    return padded, padded.numel() // n


def fp4_all_reduce_mean(x: torch.Tensor, group, dim: str | None = "outer") -> torch.Tensor:
    """Mean of ``x`` (1-D, any float dtype) over ``group`` with only 4-bit data on the wire.

    Reduce-scatter phase: every rank quantises its vector, sends chunk j to rank j
    (all-to-all); rank j dequantises the n chunks and sums them in float64. All-gather
    phase: rank j re-quantises its summed chunk to 4 bits and all ranks gather the chunks.
    Sends 2 (n-1)/n of the 4-bit size, i.e. 1/8 of an fp32 ring all-reduce (plus scales)."""
    n = _world(group)
    if n == 1:
        return x.clone()
    numel = x.numel()
    padded, chunk = _padded_chunks(x, n)
    codes, scales = fp4_quantize(padded)
    recv_codes, recv_scales = torch.empty_like(codes), torch.empty_like(scales)
    dist.all_to_all_single(recv_codes, codes, group=group)
    dist.all_to_all_single(recv_scales, scales, group=group)
    if dim:
        ledger().record(dim, "all_to_all", fp4_bytes(padded.numel()), n)
    mine = torch.zeros(chunk, dtype=torch.float64)
    cb, sb = chunk // 2, chunk // FP4_BLOCK
    for r in range(n):  # sum in float64: the "higher precision" of the reduction
        mine += fp4_dequantize(recv_codes[r * cb:(r + 1) * cb], recv_scales[r * sb:(r + 1) * sb])
    mine /= n
    my_codes, my_scales = fp4_quantize(mine)
    all_codes = torch.empty(cb * n, dtype=torch.uint8)
    all_scales = torch.empty(sb * n, dtype=torch.float32)
    dist.all_gather_into_tensor(all_codes, my_codes, group=group)
    dist.all_gather_into_tensor(all_scales, my_scales, group=group)
    if dim:
        ledger().record(dim, "all_gather", fp4_bytes(padded.numel()), n)
    return fp4_dequantize(all_codes, all_scales)[:numel].to(x.dtype)


def _deflate(codes: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(zlib.compress(codes.numpy().tobytes(), 6)), dtype=torch.uint8)


def _inflate(payload: torch.Tensor, nbytes: int) -> torch.Tensor:
    raw = zlib.decompress(payload.numpy().tobytes())
    if len(raw) != nbytes:
        raise RuntimeError(f"deflated FP4 chunk decoded to {len(raw)} bytes, expected {nbytes}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _all_to_all_varlen(payloads: list[torch.Tensor], group) -> tuple[list[torch.Tensor], int]:
    """uint8 payloads[j] to rank j, lengths vary (nothing is sent to oneself): the int64
    lengths first, then the bytes with uneven splits. Returns (what rank j sent us, own
    slot empty; bytes this rank sent, lengths included)."""
    me = dist.get_rank(group)
    send_len = torch.tensor([0 if j == me else p.numel() for j, p in enumerate(payloads)], dtype=torch.int64)
    recv_len = torch.empty_like(send_len)
    dist.all_to_all_single(recv_len, send_len, group=group)
    send = torch.cat([p[:0] if j == me else p for j, p in enumerate(payloads)])
    recv = torch.empty(int(recv_len.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_len.tolist(), input_split_sizes=send_len.tolist(),
                           group=group)
    sent = send.numel() + send_len.element_size() * (len(payloads) - 1)
    return list(recv.split(recv_len.tolist())), sent


def fp4_deflate_all_reduce_mean(x: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """``fp4_all_reduce_mean`` with the packed 4-bit codes deflated (zlib, level 6) before
    they cross the link. Lossless, so the mean is bit-identical to the fixed-length
    exchange; the messages have variable length. Per phase, to each peer a rank sends an
    int64 length, its deflated codes for that peer and the matching fp32 block scales
    (raw). Returns (mean, bytes this rank sent): the sizes of the buffers handed to the
    collectives, excluding only the empty slot to itself (the ledger's "bytes leaving")."""
    n = _world(group)
    if n == 1:
        return x.clone(), 0
    me = dist.get_rank(group)
    numel = x.numel()
    padded, chunk = _padded_chunks(x, n)
    cb, sb = chunk // 2, chunk // FP4_BLOCK
    codes, scales = fp4_quantize(padded)
    # Reduce-scatter phase: rank j gets chunk j of everyone's codes (deflated) and scales.
    payloads = [_deflate(codes[j * cb:(j + 1) * cb]) if j != me else codes[:0] for j in range(n)]
    recv, sent = _all_to_all_varlen(payloads, group)
    recv_scales = torch.empty_like(scales)
    dist.all_to_all_single(recv_scales, scales, group=group)
    sent += scales.element_size() * sb * (n - 1)
    mine = torch.zeros(chunk, dtype=torch.float64)
    for r in range(n):  # sum in float64, as in the fixed-length exchange
        rc = codes[me * cb:(me + 1) * cb] if r == me else _inflate(recv[r], cb)
        mine += fp4_dequantize(rc, recv_scales[r * sb:(r + 1) * sb])
    mine /= n
    my_codes, my_scales = fp4_quantize(mine)
    # All-gather phase: my deflated chunk to every peer (an all-to-all of one payload).
    mine_z = _deflate(my_codes)
    recv, sent_gather = _all_to_all_varlen([mine_z] * n, group)
    all_scales = torch.empty(sb * n, dtype=torch.float32)
    dist.all_gather_into_tensor(all_scales, my_scales, group=group)
    sent += sent_gather + my_scales.numel() * my_scales.element_size() * (n - 1)
    all_codes = torch.cat([my_codes if r == me else _inflate(recv[r], cb) for r in range(n)])
    return fp4_dequantize(all_codes, all_scales)[:numel].to(x.dtype), sent


# --------------------------------------------------------------------------- codecs


class Codec:
    """Base: ``reduce(named)`` turns each local gradient into the group mean of what the
    codec transmits. ``state`` maps names to error-feedback (and other) buffers."""

    def __init__(self, group):
        self.group = group
        self.n = _world(group)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.step = 0

    def step_begin(self) -> None:
        """Call once per optimizer step, before the step's ``reduce`` calls."""
        self.step += 1

    def reduce(self, named: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"step": self.step, "state": {k: {n: t.clone() for n, t in v.items()} for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        self.state = {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()}

    def _buf(self, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
        slot = self.state.setdefault(name, {})
        if key not in slot:
            slot[key] = torch.zeros_like(like)
        return slot[key]


def _matrix(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1)


def _orthogonalize(p: torch.Tensor) -> torch.Tensor:
    # Gram-Schmidt via QR (reduced), deterministic on every rank for identical input.
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


class PowerSGD(Codec):
    """Rank-r PowerSGD with error feedback and warm start (one power iteration per step):

        M = G + E;  P = M Q;  P <- mean_ranks(P);  P <- orth(P);  Q = M^T P;
        Q <- mean_ranks(Q);  G_hat = P Q^T;  E <- M - G_hat

    Vectors (biases, norms) and matrices where r (n + m) >= n m go uncompressed."""

    def __init__(self, group, rank: int, seed: int = 0):
        super().__init__(group)
        self.rank = rank
        self.seed = seed
        self.ranks: dict[str, int] = {}  # per-layer rank override (L-GreCo)

    def rank_of(self, name: str, shape) -> int:
        return self.ranks.get(name, self.rank)

    def compressible(self, t: torch.Tensor, r: int) -> bool:
        if t.ndim < 2 or r <= 0:
            return False
        n, m = _matrix(t).shape
        return r * (n + m) < n * m

    def reduce(self, named):
        dense = []
        for name, g in named:
            r = self.rank_of(name, g.shape)
            if not self.compressible(g, r):
                dense.append(g)
                continue
            self._power_step(name, g, r)
        if dense:
            flat = torch.cat([d.flatten() for d in dense])
            _all_reduce_mean(flat, self.group)
            offset = 0
            for d in dense:
                d.copy_(flat[offset: offset + d.numel()].view_as(d))
                offset += d.numel()

    def _power_step(self, name: str, g: torch.Tensor, r: int) -> None:
        mat = _matrix(g)
        n, m = mat.shape
        err = self._buf(name, "error", mat)
        mat_comp = mat + err
        slot = self.state.setdefault(name, {})
        q = slot.get("q")
        if q is None or q.shape != (m, r):
            gen = torch.Generator().manual_seed(self.seed * 7919 + (hash_name(name) % 100003))
            q = torch.randn(m, r, generator=gen, dtype=torch.float64).to(mat.dtype)
            q = _orthogonalize(q)
        p = mat_comp @ q
        _all_reduce_mean(p, self.group)
        p = _orthogonalize(p)
        q = mat_comp.t() @ p
        _all_reduce_mean(q, self.group)
        approx = p @ q.t()
        slot["q"] = q
        slot["error"] = mat_comp - approx
        mat.copy_(approx)


def hash_name(name: str) -> int:
    """A process-independent hash (Python's str hash is salted per process)."""
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % (2 ** 31 - 1)
    return h


class TopK(Codec):
    """Top-k sparsification with error feedback and DGC's momentum correction:

        u <- m u + g          (momentum correction; m = 0 gives plain error feedback)
        v <- v + u            (accumulate)
        S = top-k(|v|);  send v[S];  v[S] <- 0;  u[S] <- 0   (momentum factor masking)

    Warm-up (DGC): the kept fraction decays exponentially from 25% to ``ratio`` over
    ``warmup`` steps. Values (fp32 on the wire as the gradient's dtype) and int32 indices are
    all-gathered; each rank sums the n sparse vectors and divides by n."""

    def __init__(self, group, ratio: float, momentum: float = 0.0, warmup: int = 0):
        super().__init__(group)
        self.ratio, self.momentum, self.warmup = ratio, momentum, warmup

    def current_ratio(self) -> float:
        if self.warmup <= 0 or self.step > self.warmup:
            return self.ratio
        start = 0.25
        frac = (self.step - 1) / max(1, self.warmup)
        return max(self.ratio, start * (self.ratio / start) ** frac)

    def reduce(self, named):
        ratio = self.current_ratio()
        for name, g in named:
            flat = g.view(-1)
            u = self._buf(name, "momentum", flat)
            v = self._buf(name, "error", flat)
            if self.momentum:
                u.mul_(self.momentum).add_(flat)
                v.add_(u)
            else:
                v.add_(flat)
            k = max(1, int(round(ratio * flat.numel())))
            idx = v.abs().topk(k, sorted=False).indices
            values = v[idx].clone()
            v[idx] = 0
            if self.momentum:
                u[idx] = 0
            flat.copy_(self._gather_sum(values, idx.to(torch.int32), flat.numel(), flat.dtype) / self.n)

    def _gather_sum(self, values, idx, numel, dtype) -> torch.Tensor:
        out = torch.zeros(numel, dtype=dtype)
        if self.n == 1:
            out[idx.long()] = values
            return out
        all_v = [torch.empty_like(values) for _ in range(self.n)]
        all_i = [torch.empty_like(idx) for _ in range(self.n)]
        dist.all_gather(all_v, values, group=self.group)
        dist.all_gather(all_i, idx, group=self.group)
        size = values.numel() * values.element_size() + idx.numel() * idx.element_size()
        ledger().record("dp", "all_gather", size * self.n, self.n)
        for v, i in zip(all_v, all_i):
            out.index_add_(0, i.long(), v)
        return out


def sign_compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (packed sign bits, fp32 scale = mean |x|); decodes to scale * sign(x)."""
    return pack_bits(x.flatten() >= 0), x.abs().mean().float().reshape(1)


def sign_decompress(bits: torch.Tensor, scale: torch.Tensor, numel: int, dtype) -> torch.Tensor:
    signs = unpack_bits(bits, numel).to(dtype) * 2 - 1
    return signs * scale.to(dtype)


def sign_all_reduce_mean(name: str, x: torch.Tensor, error: torch.Tensor, group, n: int) -> torch.Tensor:
    """1-bit mean with error feedback: compensate, compress, carry the residual in ``error``
    (updated in place), all-gather bits + scales, return the mean of the decoded vectors."""
    comp = x.flatten() + error
    bits, scale = sign_compress(comp)
    error.copy_(comp - sign_decompress(bits, scale, comp.numel(), comp.dtype))
    if n == 1:
        return sign_decompress(bits, scale, comp.numel(), comp.dtype).view_as(x)
    all_bits = torch.empty(bits.numel() * n, dtype=torch.uint8)
    all_scales = torch.empty(n, dtype=torch.float32)
    dist.all_gather_into_tensor(all_bits, bits, group=group)
    dist.all_gather_into_tensor(all_scales, scale, group=group)
    ledger().record("dp", "all_gather", (bits.numel() + 4) * n, n)
    total = torch.zeros_like(comp)
    for r in range(n):
        total += sign_decompress(all_bits[r * bits.numel():(r + 1) * bits.numel()], all_scales[r:r + 1],
                                 comp.numel(), comp.dtype)
    return (total / n).view_as(x)


class Sign(Codec):
    """1-bit sign compression with error feedback on every gradient tensor."""

    def reduce(self, named):
        for name, g in named:
            err = self._buf(name, "error", g.view(-1))
            g.copy_(sign_all_reduce_mean(name, g, err, self.group, self.n))


class LGreCo(PowerSGD):
    """PowerSGD whose rank is chosen per layer by L-GreCo's dynamic program.

    Every ``every`` steps (and at the first step) each rank measures, for each matrix l and
    candidate rank r in {1, 2, 4, .., 2 * default} plus "uncompressed", the error of the best
    rank-r approximation of its compensated gradient, e(l, r) = sum_{i>r} sigma_i^2 (exact,
    from an SVD), and the size s(l, r) = r (n_l + m_l) elements. The error table is averaged
    over the group (so every rank solves the same problem), then

        minimise sum_l s(l, r_l)  subject to  sum_l e(l, r_l) <= budget * sum_l ||M_l||^2

    is solved by a knapsack DP over the error axis discretised into ``bins`` steps (errors
    rounded *up*, so the budget always holds)."""

    def __init__(self, group, default_rank: int, budget: float, every: int = 50, bins: int = 200, seed: int = 0):
        super().__init__(group, default_rank, seed)
        self.budget, self.every, self.bins = budget, every, bins
        self.candidates = sorted({1, 2, 4, 8, 16, 32, 2 * default_rank} - {0})
        self.candidates = [r for r in self.candidates if r <= max(1, 2 * default_rank)]

    def reduce(self, named):
        if (self.step - 1) % self.every == 0:
            self.choose_ranks(named)
        super().reduce(named)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "ranks": dict(self.ranks)}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.ranks = dict(sd.get("ranks", {}))

    def choose_ranks(self, named) -> None:
        mats = [(name, g) for name, g in named if g.ndim >= 2]
        if not mats:
            return
        options: list[list[tuple[int, int]]] = []  # per layer: (rank or -1 = dense, size)
        errors = []
        energies = []
        for name, g in mats:
            err = self.state.get(name, {}).get("error")
            mat = _matrix(g) + (err if err is not None else 0)
            n, m = mat.shape
            sigma2 = torch.linalg.svdvals(mat.double()) ** 2
            row_opts, row_err = [], []
            for r in self.candidates:
                if r * (n + m) < n * m:
                    row_opts.append((r, r * (n + m)))
                    row_err.append(float(sigma2[r:].sum()))
            row_opts.append((-1, n * m))
            row_err.append(0.0)
            options.append(row_opts)
            errors.append(row_err)
            energies.append(float(sigma2.sum()))
        width = max(len(r) for r in errors)
        table = torch.zeros(len(errors) + 1, width, dtype=torch.float64)
        for i, row in enumerate(errors):
            table[i, :len(row)] = torch.tensor(row)
        table[-1, 0] = sum(energies)
        _all_reduce_mean(table, self.group)
        limit = self.budget * float(table[-1, 0])
        choice = knapsack_min_size([[s for _, s in opts] for opts in options],
                                   [table[i, :len(opts)].tolist() for i, opts in enumerate(options)],
                                   limit, self.bins)
        for (name, _), opts, c in zip(mats, options, choice):
            r = opts[c][0]
            self.ranks[name] = 0 if r == -1 else r  # 0: not compressible -> dense all-reduce


def knapsack_min_size(sizes: list[list[int]], errors: list[list[float]], limit: float, bins: int) -> list[int]:
    """Pick one option per layer minimising total size with total error <= ``limit``.
    Errors are discretised up to multiples of limit / bins; each layer must offer a
    zero-error option (dense), so a solution always exists."""
    unit = limit / bins if limit > 0 else 0.0
    inf = float("inf")
    best = [0.0] + [inf] * bins  # best[b]: min size with discretised error exactly b
    picks: list[list[list[int]]] = []
    for lsizes, lerrs in zip(sizes, errors):
        new = [inf] * (bins + 1)
        arg = [-1] * (bins + 1)
        for o, (s, e) in enumerate(zip(lsizes, lerrs)):
            cost = 0 if e <= 0 else (math.ceil(e / unit) if unit > 0 else bins + 1)
            if cost > bins:
                continue
            for b in range(bins + 1 - cost):
                if best[b] + s < new[b + cost]:
                    new[b + cost] = best[b] + s
                    arg[b + cost] = o
        picks.append([arg, best])
        best = new
    # Backtrack from the cheapest reachable error level.
    b = min(range(bins + 1), key=lambda i: best[i])
    choice = []
    for (arg, prev), lsizes, lerrs in zip(reversed(picks), reversed(sizes), reversed(errors)):
        o = arg[b]
        choice.append(o)
        e = lerrs[o]
        b -= 0 if e <= 0 else math.ceil(e / unit)
    return list(reversed(choice))


def build_codec(kind: str, group, lc, seed: int = 0) -> Codec | None:
    if kind == "powersgd":
        return PowerSGD(group, lc.powersgd_rank, seed)
    if kind == "topk":
        return TopK(group, lc.topk_ratio, lc.dgc_momentum, lc.dgc_warmup_steps)
    if kind == "onebit":
        return Sign(group)
    if kind == "lgreco":
        return LGreCo(group, lc.powersgd_rank, lc.lgreco_error_budget, lc.lgreco_every, seed=seed)
    return None
