"""Whole-parameter ownership for ZeRO-1 under Muon (Megatron's layer-wise distributed
optimizer): which data-parallel rank keeps the state of, and updates, each parameter.
Torch-free: the runtime (``zero_one.py``) and the planner (``planner/optimizer.py``)
apply the same rule, so the planner's memory and gather bytes are the runtime's.

The rule: Muon's matrices first, largest first (registration order among equals), each to
the least-loaded rank (the lowest among equals); then the other parameters (AdamW's)
likewise on top of those loads. Loads are global element counts, the same on every rank
of a tensor-parallel group, so tp peers agree on their owners even where tp splits a
dimension unevenly. The matrices alone are balanced, so Muon's momentum and Newton-Schulz
work fall by the group size; AdamW's parameters then even out the gather."""

from __future__ import annotations


def assign_owners(sizes: list[int], muon: list[bool], n: int) -> list[int]:
    """The owner rank (0 .. n-1) of each parameter of ``sizes`` elements (``muon``: a Muon
    matrix or a stack of them)."""
    loads = [0] * n
    owners = [0] * len(sizes)
    for kind in (True, False):
        order = sorted((i for i in range(len(sizes)) if muon[i] == kind), key=lambda i: (-sizes[i], i))
        for i in order:
            r = min(range(n), key=lambda k: (loads[k], k))
            owners[i] = r
            loads[r] += sizes[i]
    return owners


def gather_segment(local_sizes: list[int], owners: list[int], n: int) -> int:
    """Elements each rank contributes to the all-gather of the updated parameters: the
    largest rank's local elements (the others padded to it)."""
    loads = [0] * n
    for size, r in zip(local_sizes, owners):
        loads[r] += size
    return max(loads) if loads else 0
