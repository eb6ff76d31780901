"""Activation recomputation and per-block compilation, applied from outside the model.

``train.recompute``:
- ``none``: every activation the backward needs is kept.
- ``selective``: only the core attention (scores, softmax, weighted sum: the part whose
  memory grows with the square of the sequence in Korthikanti et al. 2022) is recomputed
  in backward; the cheap-to-store, expensive-to-recompute matmuls keep their inputs.
- ``op``: torchtitan's per-op selective checkpointing of each block (``torch.utils.checkpoint``
  with a selective policy): the block keeps its input and the outputs of every other matmul
  (the 1st, 3rd, ... of the block's forward: q, v, w1's and w2's in a Llama block), of the
  fused attention kernels (output and log-sum-exp), of ``aten.max`` and of functional
  reduce-scatters; everything else is recomputed in backward. A matmul with a bias
  (``addmm``) counts as a matmul. The count restarts at each block forward and advances
  identically in the recompute, so it re-runs exactly the matmuls it did not keep.
- ``full``: each block keeps only its input and recomputes everything inside in backward;
  ``train.recompute_every = k`` applies it to every k-th block only (the rest keep all).

All patch the module's ``forward`` in place instead of wrapping it, so parameter names,
and therefore checkpoints and the name-seeded initialisation, do not change.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshfold.memory import counting, note_checkpoint_inputs

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import TrainConfig


def _checkpoint_forward(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        note_checkpoint_inputs(args)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def _ops(*names: str) -> frozenset:
    """The aten/functional-collective overloads by dotted name; ones this build lacks are skipped."""
    found = set()
    for name in names:
        obj = torch.ops
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            continue
        found.add(obj)
    return frozenset(found)


_MATMULS = _ops("aten.mm.default", "aten.addmm.default")
# Kept whole: the fused attention kernels meshfold's attention reaches on CPU and CUDA
# (``F.scaled_dot_product_attention``, ``models/attention_ops.py``, ring attention),
# aten.max (float8 scaling's amax) and reduce-scatters (not worth re-communicating).
_KEPT = _ops(
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "aten.max.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)


def op_policy(kept: list | None = None):
    """One block forward's policy (a fresh matmul count per forward and per recompute).
    ``kept``: set to ``[True]`` after each decision to keep, for the memory counter."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            save = counts[ctx.is_recompute] % 2 == 1
        else:
            save = func in _KEPT
        if kept is not None:
            kept[0] = save
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _NoteKept(TorchDispatchMode):
    """Reports the outputs the selective policy keeps to ``memory.count_saved_activations``
    (they live in the checkpoint's cache, out of the saved-tensor hooks' sight)."""

    def __init__(self, kept: list):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.kept[0] = False
        out = func(*args, **(kwargs or {}))
        if self.kept[0]:
            note_checkpoint_inputs(tree_leaves(out))
        return out


def _op_contexts():
    if not counting():
        return create_selective_checkpoint_contexts(op_policy())
    kept = [False]
    forward, recompute = create_selective_checkpoint_contexts(op_policy(kept))

    @contextlib.contextmanager
    def counted():
        with forward, _NoteKept(kept):  # the note mode on top: it sees each op's output
            yield

    return counted(), recompute


def _op_checkpoint_forward(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        note_checkpoint_inputs(args)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=_op_contexts, **kwargs)

    module.forward = forward


def apply_recompute(model: nn.Module, cfg: TrainConfig) -> None:
    if cfg.recompute == "none":
        return
    for i, block in enumerate(model.blocks()):  # the trunk's, then the extra heads'
        if cfg.recompute == "selective":
            _checkpoint_forward(block.attention.core)
        elif cfg.recompute == "op":
            _op_checkpoint_forward(block)
        elif i % max(1, cfg.recompute_every) == 0:
            _checkpoint_forward(block)


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each block in place (names unchanged); identical blocks share one
    compiled graph, so compile time does not grow with depth."""
    layers = getattr(model, "layers", None)
    for block in (layers.values() if layers is not None else []):
        block.compile()
