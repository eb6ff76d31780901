"""Sizes the runtime picks that the planner prices (pure: no torch, so both use one rule):
the chunked cross-entropy's chunk (``parallel/loss.py`` is the computation) and the
dimension FSDP2 shards a stacked expert weight on.

Expert weights. Under expert parallel each rank's routed experts are stacked weights
``[E_l, out, in]`` (E_l = E / (ep tp) local experts) that get their own FSDP2 group over the
``edp`` ranks (``parallel/ep/plan.py``). FSDP2 shards dim 0 by default and pads it: each rank holds
ceil(E_l / edp) experts, so with E_l < edp (e.g. deepseek-moe-16b at ep 8, tp 2 over 256
data-parallel ranks: E_l = 4, edp = 32) every rank holds a whole expert, edp/E_l = 8 times
its even share, and the all-gathers and reduce-scatters move that padded size.

FSDP2 (torch 2.13, ``fully_shard(shard_placement_fn=...)``) can shard any dimension but
refuses uneven sharding of a dimension other than 0 (``_fsdp_param.py``: "FSDP does not
support uneven sharding on dim d"), so the choice is:

* dim 0 when edp divides E_l (whole experts per rank, no padding);
* otherwise the first of the other dimensions (out, then in) that edp divides: no padding;
* otherwise dim 0, padded (the only uneven sharding FSDP2 accepts).
"""

from __future__ import annotations

from collections.abc import Sequence

# --------------------------------------------------------------------------- the loss's chunk

CHUNK_ELEMENTS = 1 << 25  # logits per chunk on an accelerator: the loss's one fp32 scratch is 128 MiB
# On a host a chunk that stays in cache wins: loss and gradient of 2,048 x 8,192 fp32 logits
# took 58-61 ms at 2^20 against 80-91 ms at 2^25 on this machine's CPU (2^16: 68-84 ms).
HOST_CHUNK_ELEMENTS = 1 << 20


def chunk_elements(device_type: str) -> int:
    """Logits per chunk of the chunked cross-entropy on ``device_type``."""
    return HOST_CHUNK_ELEMENTS if device_type == "cpu" else CHUNK_ELEMENTS


# --------------------------------------------------------------------------- FSDP2's dim-0 padding


def fsdp_row_padding(rows: int, n: int) -> int:
    """Rows FSDP2 adds to a parameter's dim 0 of ``rows`` to shard it over ``n`` ranks: it
    pads dim 0 to a multiple of n, each rank holding ceil(rows / n) (a MoE router's E rows over
    more ranks than experts: Mixtral's 8 rows over 32 ranks, one each)."""
    return -(-rows // n) * n - rows if n > 1 else 0


def router_padding(m, n: int) -> int:
    """Elements FSDP2's dim-0 padding adds to one MoE layer's router (weight [E, dim], the bias
    [E] with ``moe_bias``) sharded over ``n`` ranks (``models/moe.py``)."""
    return fsdp_row_padding(m.moe_experts, n) * (m.dim + (1 if m.moe_bias else 0)) if m.moe_experts else 0


# --------------------------------------------------------------------------- stacked expert weights under FSDP2


def expert_shard_dim(shape: Sequence[int], edp: int, avoid: Sequence[int] = ()) -> int:
    """The dimension of a local stacked expert weight ``shape`` = (E_l, out, in) that FSDP2
    shards over ``edp`` ranks: the one that wastes least (see the module docstring), never one
    of ``avoid`` (a dimension tensor parallel already splits: expert tp)."""
    if edp <= 1 or shape[0] % edp == 0:
        return 0
    for d in range(1, len(shape)):
        if shape[d] % edp == 0 and d not in avoid:
            return d
    return 0


def expert_shard_padding(shape: Sequence[int], edp: int, avoid: Sequence[int] = ()) -> float:
    """Bytes every rank holds (and every collective moves) relative to the even share, for
    the dimension :func:`expert_shard_dim` picks: 1.0 when the sharding is even, else
    edp ceil(E_l / edp) / E_l (dim 0 padded)."""
    d = expert_shard_dim(shape, edp, avoid)
    n = shape[d]
    return edp * -(-n // edp) / n if edp > 1 and n else 1.0
