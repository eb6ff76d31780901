"""1-bit sign compression: 1 bit per element plus one fp32 scale (mean |x|) per tensor,
with error feedback; the compressor of 1-bit Adam (Tang et al. 2021, ``onebit_adam.py``)."""

from __future__ import annotations

import torch

from meshfold import comm
from meshfold.lowcomm.codecs.base import Codec


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

    @classmethod
    def from_config(cls, group, lc, seed: int = 0) -> Sign:
        return cls(group)

    def reduce(self, named):
        for name, g in named:
            err = self._buf(name, "error", g.view(-1))
            g.copy_(sign_all_reduce_mean(name, g, err, self.group, self.n))

