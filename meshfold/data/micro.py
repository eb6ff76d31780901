"""Micro-batches: how many one data-parallel rank runs per step, and the one splitter.

Torch-free on purpose (slicing only), so the config checks and the planner can share the
count with the trainer and the pipeline.
"""

from __future__ import annotations


def micro_batch_count(local: int, micro_batch: int = 0, pp: int = 1, pp_microbatches: int = 0) -> int:
    """Micro-batches per step for ``local`` sequences on one data-parallel rank:
    ``local / micro_batch`` (``micro_batch = 0``: one); under pipeline parallel
    ``pp_microbatches``, or at least ``pp`` of them. ``config.validate`` checks that it divides."""
    n = local // (micro_batch or local)
    if pp > 1:
        return pp_microbatches or max(pp, n)
    return n


def split_micro_batches(batch: dict, n: int) -> list[dict]:
    """``n`` equal micro-batches of rows; a batch with ``micro_sizes`` (``data.balance``:
    one flat ``[1, sum T_m]`` row) is cut along the sequence into those sizes instead."""
    if "micro_sizes" in batch:
        out, start = [], 0
        for size in batch["micro_sizes"]:
            out.append({k: v[:, start: start + size] for k, v in batch.items() if k != "micro_sizes"})
            start += size
        return out
    size = batch["inputs"].shape[0] // n
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(n)]
