"""Batches prepared off the critical path.

``Prefetcher`` builds the local batch of the next steps in a background thread while the
current step computes: reading the memory-mapped windows, document ids, collation, the
context-parallel slice and, on GPU, pinning the memory so the copy to the device is
asynchronous (``non_blocking``). Which batch a step gets never depends on the
prefetcher: the sampler runs in the trainer's thread; the prefetcher is told the indices
of the steps ahead (peeked by saving and restoring the sampler's state) and keys its
work by them, so a checkpoint reload or a changed sampler only costs a miss, computed
in the step as without prefetching.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from meshfold.models.attention_ops import run_starts

# The batch's document run starts, kept on the host (the one key not moved to the device):
# the flash varlen kernel's plan needs them on the host, where the batch was made.
HOST_RUN_STARTS = "doc_run_starts_host"
HOST_POSITIONS = "positions_host"  # the positions' host copy (chunked attention's runs found on the host too)


def peek(sampler, k: int) -> list[torch.Tensor]:
    """The global indices the next ``k`` ``sampler.next()`` calls will return, with the
    sampler left as it was."""
    state = sampler.state_dict()
    try:
        return [sampler.next() for _ in range(k)]
    finally:
        sampler.load_state_dict(state)


def with_host_run_starts(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The host batch with its document run starts (for the flash varlen kernel's plan, found
    here instead of read back from the GPU once per micro-batch)."""
    if "doc_ids" in batch:
        batch[HOST_RUN_STARTS] = run_starts(batch["doc_ids"], batch.get("positions"))
        if "positions" in batch:
            batch[HOST_POSITIONS] = batch["positions"]
    return batch


def to_device(batch: dict[str, torch.Tensor], device: torch.device, non_blocking: bool = False) -> dict:
    """Every tensor of the batch on ``device``, but the run starts, which stay on the host."""
    return {k: v if k in (HOST_RUN_STARTS, HOST_POSITIONS) else v.to(device, non_blocking=non_blocking)
            for k, v in batch.items()}


class Prefetcher:
    def __init__(self, make: Callable[[torch.Tensor], dict[str, torch.Tensor]], depth: int, device: torch.device):
        self.make, self.depth, self.device = make, depth, device
        self.pin = device.type == "cuda"
        self.pool: ThreadPoolExecutor | None = None  # started on first use; close() stops it
        self.pending: dict[bytes, Future] = {}
        self.wait_s = 0.0  # time the last get() waited for its batch

    def _build(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = self.make(indices)
        if self.pin:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return with_host_run_starts(batch)

    def get(self, indices: torch.Tensor, upcoming: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch for ``indices`` on the device; starts building ``upcoming`` ones."""
        start = time.perf_counter()
        fut = self.pending.pop(_key(indices), None)
        batch = fut.result() if fut is not None else self._build(indices)
        self.wait_s = time.perf_counter() - start
        if self.depth > 0:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="meshfold-data")
            keep = {}
            for idx in upcoming[: self.depth]:
                key = _key(idx)
                keep[key] = self.pending.pop(key, None) or self.pool.submit(self._build, idx.clone())
            for stale in self.pending.values():
                stale.cancel()
            self.pending = keep
        return to_device(batch, self.device, self.pin)

    def close(self) -> None:
        if self.pool is not None:
            for fut in self.pending.values():
                fut.cancel()
            self.pending = {}
            self.pool.shutdown(wait=True)
            self.pool = None


def _key(indices: torch.Tensor) -> bytes:
    return indices.numpy().tobytes()
