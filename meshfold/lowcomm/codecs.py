"""Gradient codecs for the per-step data-parallel path, and the 4-bit format of Streaming
DiLoCo's outer gradients.

Every codec works on a list of named local gradient tensors of one data-parallel group and
turns them, in place, into the group *mean* of what the codec lets through. Codecs with
error feedback keep, per rank and per tensor, what was not sent and add it to the next
step's gradient, so nothing is lost over steps:

    compensated = g + e_old          sent(compensated) + e_new = compensated   (exactly)

Every collective goes through ``meshfold.comm``, which records the bytes this rank sends under
dim ``"dp"`` (outer exchanges: ``"outer"``) from the real sizes of what goes on the wire
(packed bits, int32 indices, fp32 scales).

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
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.gpucheck import on_cuda

# Every buffer below is created on the device of the tensor being coded (``device=``), and
# the arithmetic runs there in the tensor's own precision (at least fp32): no host round
# trip, no float64 on the CPU. Only the optional deflate coding is host work by nature.

# --------------------------------------------------------------------------- helpers


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision the codecs compute in: the tensor's own, raised to fp32 for bf16/fp16."""
    return torch.promote_types(dtype, torch.float32)


def _all_reduce_mean(t: torch.Tensor, group, dim: str = "dp") -> torch.Tensor:
    n = _world(group)
    if n > 1:
        comm.all_reduce(t, group, dim)
        t.div_(n)
    return t


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool[N] -> uint8[ceil(N/8)], little-endian within a byte (on ``bits``' device)."""
    flat = bits.flatten().to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    weights = torch.ones(8, dtype=torch.uint8, device=bits.device) << torch.arange(8, dtype=torch.uint8,
                                                                                  device=bits.device)
    return (flat.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.flatten()[:n].bool()


# --------------------------------------------------------------------------- 4-bit E3M0

# FP4 "E3M0": 1 sign bit + 3 exponent bits, no mantissa. Code e=0 is zero, e=1..7 is
# 2^(e-7) times the block scale (the block's max |x|), so magnitudes {0, 1/64, .., 1/2, 1}.
FP4_LEVELS = torch.tensor([0.0] + [2.0 ** (e - 7) for e in range(1, 8)], dtype=torch.float64, device="cpu")
FP4_BLOCK = 128  # elements sharing one fp32 scale (0.25 extra bits per element)
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _fp4_tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels, midpoints) in ``dtype`` on ``device``, built once per pair (powers of two
    and 1.5 x powers of two: exact in every float format)."""
    key = (dtype, str(device))
    if key not in _TABLES:
        levels = torch.zeros(8, dtype=dtype, device=device)
        levels[1:] = torch.exp2(torch.arange(-6, 1, dtype=dtype, device=device))
        _TABLES[key] = (levels, (levels[1:] + levels[:-1]) / 2)
    return _TABLES[key]


def fp4_quantize(x: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (1-D, length a multiple of ``block``) -> (uint8 codes packed two per byte, fp32 scales).
    Rounds each |x|/scale to the nearest level in linear distance (ties round up). Runs on
    ``x``'s device in its precision (fp32 at least)."""
    wd = _work_dtype(x.dtype)
    xb = x.to(wd).view(-1, block)
    scale = xb.abs().amax(1).float()
    safe = scale.to(wd).clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    r = (xb.abs() / safe).clamp(max=1.0)
    _, mids = _fp4_tables(wd, x.device)
    exp = torch.bucketize(r, mids, right=True).to(torch.uint8)  # 0..7
    code = (exp | ((xb < 0).to(torch.uint8) << 3)).flatten()
    return (code[0::2] | (code[1::2] << 4)).contiguous(), scale


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Codes and scales back to values, in ``dtype`` (default: the scales' fp32)."""
    dtype = dtype or scale.dtype
    code = torch.stack([packed & 0xF, packed >> 4], 1).flatten()
    levels, _ = _fp4_tables(dtype, packed.device)
    mag = levels[(code & 7).long()]
    sign = 1 - 2 * ((code >> 3) & 1).to(dtype)
    return (sign * mag).view(-1, block).mul_(scale.to(dtype).unsqueeze(1)).flatten()


def fp4_bytes(numel: int, block: int = FP4_BLOCK) -> int:
    return numel // 2 + 4 * (numel // block)


def _padded_chunks(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``x`` in its work precision on its device, zero-padded to n equal chunks of whole
    FP4 blocks; the chunk length."""
    unit = FP4_BLOCK * n
    padded = torch.zeros(unit * math.ceil(x.numel() / unit), dtype=_work_dtype(x.dtype), device=x.device)
    padded[:x.numel()] = x.flatten()
    return padded, padded.numel() // n


def _sum_chunks(decoded: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of n equal chunks, added in rank order (the same order on every rank)."""
    parts = decoded.view(n, -1)
    total = parts[0].clone()
    for r in range(1, n):
        total += parts[r]
    return total


def fp4_all_reduce_mean(x: torch.Tensor, group, dim: str = "outer") -> torch.Tensor:
    """Mean of ``x`` (1-D, any float dtype) over ``group`` with only 4-bit data on the wire.

    Reduce-scatter phase: every rank quantises its vector, sends chunk j to rank j
    (all-to-all); rank j dequantises the n chunks and sums them in its work precision.
    All-gather phase: rank j re-quantises its summed chunk to 4 bits and all ranks gather
    the chunks. Sends 2 (n-1)/n of the 4-bit size, i.e. 1/8 of an fp32 ring all-reduce
    (plus scales); the comm layer records the bytes under ``dim``."""
    n = _world(group)
    if n == 1:
        return x.clone()
    numel = x.numel()
    padded, chunk = _padded_chunks(x, n)
    wd = padded.dtype
    codes, scales = fp4_quantize(padded)
    recv_codes, recv_scales = torch.empty_like(codes), torch.empty_like(scales)
    comm.all_to_all_single(recv_codes, codes, group, dim)
    comm.all_to_all_single(recv_scales, scales, group, dim)
    mine = _sum_chunks(fp4_dequantize(recv_codes, recv_scales, dtype=wd), n) / n
    my_codes, my_scales = fp4_quantize(mine)
    all_codes = torch.empty(my_codes.numel() * n, dtype=torch.uint8, device=x.device)
    all_scales = torch.empty(my_scales.numel() * n, dtype=torch.float32, device=x.device)
    comm.all_gather_into_tensor(all_codes, my_codes, group, dim)
    comm.all_gather_into_tensor(all_scales, my_scales, group, dim)
    return fp4_dequantize(all_codes, all_scales, dtype=wd)[:numel].to(x.dtype)


# Deflate is host work by nature (zlib): the codes cross to the host to be coded and the
# coded bytes go back to the device before they reach a collective. It is an opt-in coding
# for very slow links, where the link, not this copy, is the bottleneck.
def _deflate(codes: torch.Tensor) -> torch.Tensor:
    raw = codes.cpu().numpy().tobytes()
    return torch.frombuffer(bytearray(zlib.compress(raw, 6)), dtype=torch.uint8).to(codes.device)


def _inflate(payload: torch.Tensor, nbytes: int) -> torch.Tensor:
    raw = zlib.decompress(payload.cpu().numpy().tobytes())
    if len(raw) != nbytes:
        raise RuntimeError(f"deflated FP4 chunk decoded to {len(raw)} bytes, expected {nbytes}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(payload.device)


def _all_to_all_varlen(payloads: list[torch.Tensor], group, dim: str) -> tuple[list[torch.Tensor], int]:
    """uint8 payloads[j] to rank j, lengths vary (nothing is sent to oneself): the int64
    lengths first, then the bytes with uneven splits. Returns (what rank j sent us, own
    slot empty; bytes this rank sent, lengths included)."""
    me = dist.get_rank(group)
    device = payloads[0].device
    lengths = [0 if j == me else p.numel() for j, p in enumerate(payloads)]
    send_len = torch.tensor(lengths, dtype=torch.int64, device=device)
    recv_len = torch.empty_like(send_len)
    comm.all_to_all_single(recv_len, send_len, group, dim)
    recv_sizes = recv_len.tolist()  # variable lengths: the one host read this coding needs
    send = torch.cat([p[:0] if j == me else p for j, p in enumerate(payloads)])
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    comm.all_to_all_single(recv, send, group, dim, out_splits=recv_sizes, in_splits=lengths)
    sent = send.numel() + send_len.element_size() * (len(payloads) - 1)
    return list(recv.split(recv_sizes)), sent


def fp4_deflate_all_reduce_mean(x: torch.Tensor, group, dim: str = "outer") -> tuple[torch.Tensor, int]:
    """``fp4_all_reduce_mean`` with the packed 4-bit codes deflated (zlib, level 6) before
    they cross the link. Lossless, so the mean is bit-identical to the fixed-length
    exchange; the messages have variable length. Per phase, to each peer a rank sends an
    int64 length, its deflated codes for that peer and the matching fp32 block scales
    (raw). Returns (mean, bytes this rank sent): the sizes of the buffers handed to the
    collectives, excluding only the empty slot to itself (what the comm layer records)."""
    n = _world(group)
    if n == 1:
        return x.clone(), 0
    me = dist.get_rank(group)
    numel = x.numel()
    padded, chunk = _padded_chunks(x, n)
    wd = padded.dtype
    cb, sb = chunk // 2, chunk // FP4_BLOCK
    codes, scales = fp4_quantize(padded)
    # Reduce-scatter phase: rank j gets chunk j of everyone's codes (deflated) and scales.
    payloads = [_deflate(codes[j * cb:(j + 1) * cb]) if j != me else codes[:0] for j in range(n)]
    recv, sent = _all_to_all_varlen(payloads, group, dim)
    recv_scales = torch.empty_like(scales)
    comm.all_to_all_single(recv_scales, scales, group, dim)
    sent += scales.element_size() * sb * (n - 1)
    got = torch.cat([codes[me * cb:(me + 1) * cb] if r == me else _inflate(recv[r], cb) for r in range(n)])
    mine = _sum_chunks(fp4_dequantize(got, recv_scales, dtype=wd), n) / n
    my_codes, my_scales = fp4_quantize(mine)
    # All-gather phase: my deflated chunk to every peer (an all-to-all of one payload).
    mine_z = _deflate(my_codes)
    recv, sent_gather = _all_to_all_varlen([mine_z] * n, group, dim)
    all_scales = torch.empty(sb * n, dtype=torch.float32, device=x.device)
    comm.all_gather_into_tensor(all_scales, my_scales, group, dim)
    sent += sent_gather + my_scales.numel() * my_scales.element_size() * (n - 1)
    all_codes = torch.cat([my_codes if r == me else _inflate(recv[r], cb) for r in range(n)])
    return fp4_dequantize(all_codes, all_scales, dtype=wd)[:numel].to(x.dtype), sent


# --------------------------------------------------------------------------- codecs


class Codec:
    """Base: ``reduce(named)`` turns each local gradient into the group mean of what the
    codec transmits. ``state`` maps names to error-feedback (and other) buffers.

    ``reduce_async(named)`` returns a ``torch.futures.Future`` completed once the gradients
    hold the mean (what a DDP communication hook returns); the base class reduces at once."""

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

    def reduce_async(self, named: list[tuple[str, torch.Tensor]]) -> torch.futures.Future:
        self.reduce(named)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def wait(self) -> None:
        """Block until every reduction handed to ``reduce_async`` has finished."""

    def state_dict(self) -> dict:
        self.wait()
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

    Vectors (biases, norms) and matrices where r (n + m) >= n m go uncompressed, in the
    same all-reduce as every P of the call: two all-reduces per call whatever the number
    of matrices (one of the uncompressed tensors and all P, one of all Q).

    ``reduce_async`` (the DDP hook's path) on a GPU issues the call's collectives right
    there, on the thread running backward, in the order DDP calls the hook (the same bucket
    order on every rank, interleaved with backward's own collectives, e.g. ring attention's,
    in graph order): NCCL runs collectives of different communicators in the order each rank
    issued them, so a second issuing thread could order them differently on two ranks and
    deadlock. Its waits between the P and Q all-reduces are stream waits there, so backward
    is not held up on the host. On the host (gloo), where a wait blocks, the call runs on one
    communication thread and returns at once, so the exchange overlaps the rest of backward;
    one thread per codec keeps every rank's collectives in hook order (a ``then`` callback
    would issue the Q all-reduce from whichever thread completed the P all-reduce)."""

    def __init__(self, group, rank: int, seed: int = 0):
        super().__init__(group)
        self.rank = rank
        self.seed = seed
        self.ranks: dict[str, int] = {}  # per-layer rank override (L-GreCo)
        self._thread: ThreadPoolExecutor | None = None
        self._inflight: list = []

    def rank_of(self, name: str, shape) -> int:
        return self.ranks.get(name, self.rank)

    def compressible(self, t: torch.Tensor, r: int) -> bool:
        if t.ndim < 2 or r <= 0:
            return False
        n, m = _matrix(t).shape
        return r * (n + m) < n * m

    def reduce_async(self, named) -> torch.futures.Future:
        if self.n == 1 or (named and on_cuda(named[0][1])):
            return super().reduce_async(named)
        if self._thread is None:
            device = named[0][1].device if named else None
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="meshfold-powersgd",
                                              initializer=_bind_device, initargs=(device,))
        fut: torch.futures.Future = torch.futures.Future()

        def run():
            try:
                self.reduce(named)
                fut.set_result(None)
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(err)

        self._inflight = [f for f in self._inflight if not f.done()] + [self._thread.submit(run)]
        return fut

    def wait(self) -> None:
        for f in self._inflight:
            f.result()
        self._inflight = []

    def reduce(self, named):
        if not named:
            return
        dense, mats = [], []
        for name, g in named:
            r = self.rank_of(name, g.shape)
            (mats if self.compressible(g, r) else dense).append((name, g, r))
        work = [self._power_begin(name, g, r) for name, g, r in mats]
        # All uncompressed tensors and every P: one all-reduce.
        flat = torch.cat([g.reshape(-1) for _, g, _ in dense] + [w["p"].reshape(-1) for w in work])
        if flat.numel():
            _all_reduce_mean(flat, self.group)
        parts = flat.split([g.numel() for _, g, _ in dense] + [w["p"].numel() for w in work])
        for (_, g, _), part in zip(dense, parts):
            g.copy_(part.view_as(g))
        for w, part in zip(work, parts[len(dense):]):
            w["p"] = _orthogonalize(part.view_as(w["p"]))
            w["q"] = w["m"].t() @ w["p"]
        if not work:
            return
        # Every Q: one all-reduce.
        qflat = torch.cat([w["q"].reshape(-1) for w in work])
        _all_reduce_mean(qflat, self.group)
        for w, q in zip(work, qflat.split([w["q"].numel() for w in work])):
            self._power_end(w, q.view_as(w["q"]))

    def _power_begin(self, name: str, g: torch.Tensor, r: int) -> dict:
        mat = _matrix(g)
        m = mat.shape[1]
        err = self._buf(name, "error", mat)
        comp = mat + err
        slot = self.state.setdefault(name, {})
        q = slot.get("q")
        if q is None or q.shape != (m, r):
            # Drawn on the host once (the same on every device), then moved.
            gen = torch.Generator(device="cpu").manual_seed(self.seed * 7919 + (hash_name(name) % 100003))
            q = torch.randn(m, r, generator=gen, dtype=torch.float64, device="cpu")
            q = _orthogonalize(q.to(device=mat.device, dtype=mat.dtype))
        return {"name": name, "mat": mat, "m": comp, "p": comp @ q}

    def _power_end(self, w: dict, q: torch.Tensor) -> None:
        approx = w["p"] @ q.t()
        slot = self.state[w["name"]]
        slot["q"] = q.clone()
        slot["error"] = w["m"] - approx
        w["mat"].copy_(approx)


def _bind_device(device) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


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
    ``warmup`` steps. Values (the gradient's dtype on the wire) and int32 indices are
    all-gathered on the gradient's device; each rank sums the n sparse vectors there."""

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
        out = torch.zeros(numel, dtype=dtype, device=values.device)
        if self.n == 1:
            out[idx.long()] = values
            return out
        all_v = torch.empty(values.numel() * self.n, dtype=values.dtype, device=values.device)
        all_i = torch.empty(idx.numel() * self.n, dtype=idx.dtype, device=idx.device)
        comm.all_gather_into_tensor(all_v, values, self.group, "dp")
        comm.all_gather_into_tensor(all_i, idx, self.group, "dp")
        for v, i in zip(all_v.chunk(self.n), all_i.chunk(self.n)):  # rank order, as before
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
    all_bits = torch.empty(bits.numel() * n, dtype=torch.uint8, device=bits.device)
    all_scales = torch.empty(n, dtype=torch.float32, device=scale.device)
    comm.all_gather_into_tensor(all_bits, bits, group, "dp")
    comm.all_gather_into_tensor(all_scales, scale, group, "dp")
    total = torch.zeros_like(comp)
    for r, chunk in enumerate(all_bits.chunk(n)):
        total += sign_decompress(chunk, all_scales[r:r + 1], comp.numel(), comp.dtype)
    return (total / n).view_as(x)


class Sign(Codec):
    """1-bit sign compression with error feedback on every gradient tensor."""

    def reduce(self, named):
        for name, g in named:
            err = self._buf(name, "error", g.view(-1))
            g.copy_(sign_all_reduce_mean(name, g, err, self.group, self.n))


class LGreCo(PowerSGD):
    """PowerSGD whose rank is chosen per layer by L-GreCo's dynamic program.

    Every ``every`` steps (and at the first step; never in between) each rank estimates,
    for each matrix l and candidate rank r in {1, 2, 4, .., 2 * default} plus
    "uncompressed", the error of the best rank-r approximation of its compensated
    gradient, e(l, r) = ||M||^2 - sum_{i<=r} sigma_i^2, and the size s(l, r) = r (n_l + m_l)
    elements. The top singular values come from a seeded randomized range finder on the
    gradient's device in its precision (exact when min(n, m) is small enough for a plain
    SVD). The error table is averaged over the group in one all-reduce (so every rank
    solves the same problem) and read to the host once; then

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

    def _top_sigma2(self, mat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(squared top-k singular values, padded with zeros to k; ||mat||_F^2), on device."""
        energy = mat.pow(2).sum()
        n, m = mat.shape
        if min(n, m) <= 4 * k:
            s2 = torch.linalg.svdvals(mat) ** 2
        else:  # randomized range finder with two power iterations (Halko et al. 2011)
            gen = torch.Generator(device=mat.device).manual_seed(self.seed * 104729 + self.step)
            omega = torch.randn(m, k + 8, generator=gen, dtype=mat.dtype, device=mat.device)
            basis = _orthogonalize(mat @ omega)
            for _ in range(2):
                basis = _orthogonalize(mat @ _orthogonalize(mat.t() @ basis))
            s2 = torch.linalg.svdvals(basis.t() @ mat) ** 2
        out = torch.zeros(k, dtype=mat.dtype, device=mat.device)
        out[:min(k, s2.numel())] = s2[:k]
        return out, energy

    def choose_ranks(self, named) -> None:
        mats = [(name, g) for name, g in named if g.ndim >= 2]
        if not mats:
            return
        kmax = max(self.candidates)
        sizes, rows = [], []  # per layer: the options' (rank or -1 = dense, size); error row
        for name, g in mats:
            err = self.state.get(name, {}).get("error")
            mat = _matrix(g).to(_work_dtype(g.dtype))
            if err is not None:
                mat = mat + err
            n, m = mat.shape
            s2, energy = self._top_sigma2(mat, kmax)
            kept = torch.cumsum(s2, 0)
            opts = [(r, r * (n + m)) for r in self.candidates if r * (n + m) < n * m]
            idx = torch.tensor([r - 1 for r, _ in opts], dtype=torch.long, device=mat.device)
            row = torch.cat([(energy - kept[idx]).clamp(min=0), torch.zeros(1, dtype=mat.dtype, device=mat.device),
                             energy.reshape(1)])
            sizes.append(opts + [(-1, n * m)])
            rows.append(row)
        width = max(r.numel() for r in rows)
        table = torch.zeros(len(rows), width, dtype=rows[0].dtype, device=rows[0].device)
        for i, row in enumerate(rows):
            table[i, :row.numel()] = row
        _all_reduce_mean(table, self.group)
        host = table.cpu().tolist()  # one small read every ``every`` steps
        limit = self.budget * sum(host[i][len(opts)] for i, opts in enumerate(sizes))
        choice = knapsack_min_size([[s for _, s in opts] for opts in sizes],
                                   [host[i][:len(opts)] for i, opts in enumerate(sizes)], limit, self.bins)
        for (name, _), opts, c in zip(mats, sizes, choice):
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
