"""Compute weights: bf16 copies of the fp32 master parameters, made once per step, for the
layouts FSDP2 does not cast (ZeRO-0/1: DDP, ``GradReducer``'s tp x pp x dp, one process).

Under ``train.dtype = bfloat16`` (``auto`` on a GPU) FSDP2's mixed-precision policy gathers
bf16 copies of the fp32 shards, so the blocks compute from bf16 weights and the residual
stream is bf16. Without FSDP the parameters stayed fp32 and autocast cast every weight on
every micro-batch, and the embedding's fp32 output kept the residual stream and the norms
in fp32: 1.7x the activation memory of the same model under FSDP2 (llama3-8b, seq 4096)
and a weight copy per micro-batch. Megatron-LM instead computes from bf16 parameters and
keeps fp32 master weights in its optimizer.

Here the modules keep their fp32 parameters (so checkpoints, the optimizers, DDP, the
gradient reducers, clipping and Hugging Face export see one set of fp32 tensors in every
layout), and for the duration of a step each module's parameter slot holds a bf16 copy
made from it with autograd on: one cast per parameter per step, shared by every micro-batch
and by recomputation in backward. Gradients flow back through the cast into the fp32
parameter's ``.grad``, so micro-batches accumulate in fp32 (Megatron's ``main_grad``) and
data parallel reduces them in ``train.reduce_dtype``, as FSDP2 does. The cast node keeps no
tensors, so every micro-batch's backward may pass through it.

What differs from a module's usual state while a step runs: ``module.parameters()`` yields
the bf16 copies (``master_parameters`` yields the fp32 ones, e.g. for the zero-bubble
pipeline's weight-gradient pass); the copies count as model state, not activations
(``memory.note_model_state``).

Under ZeRO-1 the optimizer keeps them: ``optim/sharded.py::ShardedAdamW`` all-gathers the
updated values in bf16 into one flat buffer after each step, and the copies are views of it
(``source``), as Megatron's distributed optimizer gathers bf16 parameters. Each rank keeps
fp32 values only for the segment it updates, and the module's fp32 parameters are freed
between steps; ``sync_masters`` gathers them in fp32 where they are read whole
(checkpoints, ``full_state``, export).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from meshfold.memory import note_model_state


class ComputeWeights:
    """The floating-point parameters of ``modules`` whose dtype is not ``dtype``, swapped
    for ``dtype`` copies inside ``with weights.active():``. Tied parameters (one tensor in
    two modules) get one copy."""

    def __init__(self, modules: list[nn.Module], dtype: torch.dtype):
        self.dtype = dtype
        self.slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        seen: set[int] = set()
        for root in modules:
            for module in root.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for name, p in module._parameters.items():
                    if p is not None and p.is_floating_point() and p.dtype != dtype:
                        self.slots.append((module, name, p))
        self.swapped = False
        # ZeRO-1 under bf16 (``optim/sharded.py::ShardedAdamW``, set by ``build_optimizer``):
        # the copies come from the optimizer's gathered bf16 buffer; the fp32 parameters hold
        # no values between checkpoints (each rank keeps its own segment's).
        self.source = None

    def sync_masters(self) -> None:
        """Make the fp32 parameters current on every rank before they are read whole
        (``full_state``, export); a no-op without a ZeRO-1 source. Collective over dp."""
        if self.source is not None:
            self.source.sync_masters()

    @contextlib.contextmanager
    def active(self):
        """The copies in the modules' parameter slots until the block exits (re-entrant:
        an inner ``active`` of a step already swapped changes nothing)."""
        if self.swapped or not self.slots:
            yield
            return
        copies: dict[int, torch.Tensor] = {}
        gathered = self.source.compute_copies() if self.source is not None else {}
        for module, name, p in self.slots:
            c = copies.get(id(p))
            if c is None:
                c = gathered.get(id(p))
                c = copies[id(p)] = p.to(self.dtype) if c is None else c
                c._meshfold_master = p
            module._parameters[name] = c
        note_model_state(copies.values())
        self.swapped = True
        try:
            yield
        finally:
            for module, name, p in self.slots:
                module._parameters[name] = p
            self.swapped = False


def master_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """``module.parameters()``, with the fp32 master in place of each compute copy."""
    for p in module.parameters():
        yield getattr(p, "_meshfold_master", p)


def compute_weights_for(modules: list[nn.Module], autocast_dtype: torch.dtype | None,
                        fsdp: bool) -> ComputeWeights | None:
    """The step's compute weights: None when the run has no lower compute dtype, or when
    FSDP2's mixed-precision policy already gathers the parameters in it."""
    if autocast_dtype is None or fsdp:
        return None
    return ComputeWeights(modules, autocast_dtype)
