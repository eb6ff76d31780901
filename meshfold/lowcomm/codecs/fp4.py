"""The 4-bit E3M0 format shared by the outer exchanges (Streaming DiLoCo's outer
gradients): the quantisation tables, quantise/dequantise, and the mean over a group with
only 4-bit data on the wire (fixed length, or deflated for very slow links)."""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.lowcomm.codecs.base import group_size, work_dtype

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
    wd = work_dtype(x.dtype)
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
    padded = torch.zeros(unit * math.ceil(x.numel() / unit), dtype=work_dtype(x.dtype), device=x.device)
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
    n = group_size(group)
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
    n = group_size(group)
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

