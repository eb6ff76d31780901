"""Honest activation-memory accounting on any device: the bytes autograd keeps for the
backward pass, counted through saved-tensor hooks.

Counted once per storage (views share), parameters excluded (they are model state, not
activations; FSDP2's gathered unsharded parameters too, whose views (``weight.t()``)
autograd saves: FSDP2 frees them after forward under ZeRO-3 and re-gathers for backward). Inputs that activation checkpointing keeps to recompute from are counted
too: ``parallel/recompute.py`` reports them here, because the checkpoint holds them through
a closure that the saved-tensor hooks never see.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def _storage_key(t: torch.Tensor) -> int:
    """Identity of the storage (views share it); valid for fake tensors too (dry-run)."""
    return t.untyped_storage()._cdata


def _param_keys(p: torch.Tensor) -> set[int]:
    """The storages of a parameter's local data: a DTensor's local shard; a wrapper subclass
    (torchao's MXFP8 weight wrapper) also its inner tensors, which the ops it runs save."""
    t = p.to_local() if hasattr(p, "to_local") else p
    inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else []
    return {_storage_key(x) for x in [t, *inner] if isinstance(x, torch.Tensor)}


class SavedActivationCounter:
    def __init__(self, model: nn.Module | None = None):
        self.param_storages = set()
        self.fsdp_params = []
        if model is not None:
            # DTensor parameters (FSDP2, tensor parallel): their local shard's storage.
            self.param_storages = {k for p in model.parameters() for k in _param_keys(p)}
            # FSDP2's gathered (unsharded) parameters, allocated at each all-gather: model
            # state (freed after forward under ZeRO-3, re-gathered for backward), not activations
            self.fsdp_params = [fp for m in model.modules() if isinstance(m, FSDPModule)
                                for fp in _fsdp_params(m)]
        self.seen: set[int] = set()
        self.alive: list = []  # the storages counted, kept while counting: their keys stay theirs
        self.bytes = 0
        self.tag = None  # what the bytes are counted under (a pipeline chunk: ``activation_tag``)
        self.by_tag: dict = {}

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if torch._C._current_graph_task_id() != -1:
            return  # saved inside a backward (recomputation, the loss's chunks): freed within it
        storage = t.untyped_storage()
        ptr = _storage_key(t)
        if ptr in self.param_storages or ptr in self.seen:
            return
        if self.fsdp_params and ptr in self._gathered_storages():
            return
        self.seen.add(ptr)
        self.alive.append(storage)  # (a freed storage's address can come back as another's)
        self.bytes += storage.nbytes()
        self.by_tag[self.tag] = self.by_tag.get(self.tag, 0) + storage.nbytes()

    def _gathered_storages(self) -> set[int]:
        # (a DTensor parameter's unsharded form is a DTensor: expert or tensor parallel)
        return {k for fp in self.fsdp_params if (u := getattr(fp, "_unsharded_param", None)) is not None
                for k in _param_keys(u)}

    def _pack(self, t):
        self.add(t)
        return t


def _fsdp_params(module: nn.Module) -> list:
    group = module._get_fsdp_state()._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


_ACTIVE: list[SavedActivationCounter] = []


def note_checkpoint_inputs(args) -> None:
    """Called by recomputation wrappers with the inputs they keep alive."""
    for counter in _ACTIVE:
        for a in args:
            counter.add(a)


def note_model_state(tensors) -> None:
    """Called with tensors that are model state made inside a step (the bf16 compute copies of
    ``parallel/compute_weights.py``), which autograd saves like FSDP2's gathered parameters:
    not activations, for counters open now; one opened later sees them as parameters."""
    for counter in _ACTIVE:
        counter.param_storages.update(_storage_key(t.to_local() if hasattr(t, "to_local") else t)
                                      for t in tensors)


@contextlib.contextmanager
def activation_tag(tag):
    """Count what is saved inside under ``tag`` (``SavedActivationCounter.by_tag``) in the
    counters open now: the pipeline tags each forward with its chunk, whose activations
    live until that chunk's backward."""
    before = [(c, c.tag) for c in _ACTIVE]
    for c, _ in before:
        c.tag = tag
    try:
        yield
    finally:
        for c, old in before:
            c.tag = old


def counting() -> bool:
    """Whether a ``count_saved_activations`` is open (recompute wrappers report to it)."""
    return bool(_ACTIVE)


@contextlib.contextmanager
def count_saved_activations(model: nn.Module | None = None):
    counter = SavedActivationCounter(model)
    _ACTIVE.append(counter)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter._pack, lambda t: t):
            yield counter
    finally:
        _ACTIVE.remove(counter)
