"""Honest activation-memory accounting on any device: the bytes autograd keeps for the
backward pass, counted through saved-tensor hooks.

Counted once per storage (views share), parameters excluded (they are model state, not
activations). Inputs that activation checkpointing keeps to recompute from are counted
too: ``parallel/recompute.py`` reports them here, because the checkpoint holds them through
a closure that the saved-tensor hooks never see.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> int:
    """Identity of the storage (views share it); valid for fake tensors too (dry-run)."""
    return t.untyped_storage()._cdata


class SavedActivationCounter:
    def __init__(self, model: nn.Module | None = None):
        self.param_storages = set()
        if model is not None:
            # DTensor parameters (FSDP2, tensor parallel): their local shard's storage.
            self.param_storages = {_storage_key(p.to_local() if hasattr(p, "to_local") else p)
                                   for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = _storage_key(t)
        if ptr in self.param_storages or ptr in self.seen:
            return
        self.seen.add(ptr)
        self.bytes += storage.nbytes()

    def _pack(self, t):
        self.add(t)
        return t


_ACTIVE: list[SavedActivationCounter] = []


def note_checkpoint_inputs(args) -> None:
    """Called by recomputation wrappers with the inputs they keep alive."""
    for counter in _ACTIVE:
        for a in args:
            counter.add(a)


@contextlib.contextmanager
def count_saved_activations(model: nn.Module | None = None):
    counter = SavedActivationCounter(model)
    _ACTIVE.append(counter)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter._pack, lambda t: t):
            yield counter
    finally:
        _ACTIVE.remove(counter)
