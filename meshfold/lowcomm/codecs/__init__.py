"""Gradient codecs for the per-step data-parallel path (``lowcomm.compression``), one
module per family, and the 4-bit format of Streaming DiLoCo's outer gradients (``fp4.py``).

Every codec works on a list of named local gradient tensors of one data-parallel group and
turns them, in place, into the group *mean* of what the codec lets through. Codecs with
error feedback keep, per rank and per tensor, what was not sent and add it to the next
step's gradient, so nothing is lost over steps:

    compensated = g + e_old          sent(compensated) + e_new = compensated   (exactly)

Every collective goes through ``meshfold.comm``, which records the bytes this rank sends under
dim ``"dp"`` (outer exchanges: ``"outer"``) from the real sizes of what goes on the wire
(packed bits, int32 indices, fp32 scales).

Codecs (docs/lowcomm.md has the equations), registered below by their
``lowcomm.compression`` name:
  powersgd  rank-r P Q^T with warm-started Q and error feedback (Vogels et al. 2019)
  topk      top-k of |accumulator| with error feedback, DGC momentum correction and
            exponential sparsity warm-up (Lin et al. 2018)
  onebit    1 bit per element plus one fp32 scale (mean |x|) per tensor, error feedback
            (the compressor of 1-bit Adam, Tang et al. 2021)
  lgreco    PowerSGD with a rank per layer chosen by a knapsack dynamic program under an
            error budget (Markov et al. 2024, L-GreCo)

A new codec is a module with a ``Codec`` subclass (``from_config`` reads its keys) and one
line in ``CODECS``.
"""

from __future__ import annotations

from meshfold.lowcomm.codecs.base import Codec
from meshfold.lowcomm.codecs.lgreco import LGreCo
from meshfold.lowcomm.codecs.powersgd import PowerSGD
from meshfold.lowcomm.codecs.sign import Sign
from meshfold.lowcomm.codecs.topk import TopK

# lowcomm.compression -> the codec class
CODECS: dict[str, type[Codec]] = {
    "powersgd": PowerSGD,
    "topk": TopK,
    "onebit": Sign,
    "lgreco": LGreCo,
}


def build_codec(kind: str, group, lc, seed: int = 0) -> Codec | None:
    """The codec ``kind`` names, or None (``none``: no compression)."""
    codec = CODECS.get(kind)
    return None if codec is None else codec.from_config(group, lc, seed)
