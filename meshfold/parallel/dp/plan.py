"""Data parallel: replicated (DDP), ZeRO-1/2/3 and hybrid replicate x shard.

What ``parallel.zero`` means here, with n = dp_shard (x cp) ranks sharing a shard group:

=====  ==============================  ===================================  ========================================
zero   memory per rank (model states)  communication per step               mechanism
=====  ==============================  ===================================  ========================================
0      params + grads + optimizer      all-reduce grads (2(n-1)/n * G)      torch DDP (bucketed, overlapped); with
                                                                            tp or pp: ``GradReducer`` below
1      params + grads + optimizer/n    all-reduce grads, then one gather    DDP + ZeroRedundancyOptimizer; with tp:
                                       of the updated params                ``GradReducer`` + ``ShardedAdamW``
2      params/n + grads/n + optim/n    all-gather params once, reduce-     FSDP2 ``fully_shard`` with
       between steps; unsharded        scatter grads once (last micro-      ``reshard_after_forward=False``; no
       params + grads while a step     batch)                               sync/reshard before the last backward
       accumulates
3      (params + grads + optimizer)/n  all-gather params in every micro-    FSDP2 ``fully_shard`` with
       (+ unsharded grads while        batch's forward and backward,        ``reshard_after_forward=True``; no
       accumulating)                   reduce-scatter grads once            sync before the last backward
=====  ==============================  ===================================  ========================================

Expert parallel with zero 0/1 (``parallel/ep/plan.py``): the routed experts, different on
each ep rank, are averaged over edp (the ranks holding the same experts) by a
``GradReducer`` of their own, and ZeRO-1 shards their Adam state there
(``optim/expert_split.py::ExpertSplitAdamW``); the rest is averaged over dp_cp as above.

Every data-parallel reduction happens once per optimizer step, in the last micro-batch's
backward (see ``LocalEngine.grad_sync`` in train/engine.py and the pipeline's per-chunk
arming), so dp bytes per step do not depend on the micro-batch count for zero 0-2.

With ``dp_replicate`` > 1 and zero >= 2 FSDP2 runs as HSDP on the 2-D mesh
(dp_replicate, dp_shard_cp): shards within a group, all-reduce of shard gradients across
replicas. With zero <= 1 the gradient all-reduce spans all data-parallel ranks and (zero 1)
the optimizer state is sharded over the ``dp_shard`` group only.
Context-parallel ranks hold different tokens of the same sequences, so they take part in
the gradient reduction exactly like data-parallel ranks (torchtitan folds cp into FSDP the
same way).

The package: ``fsdp.py`` (zero 2/3: FSDP2, its counted collectives and mixed precision),
``replicate.py`` (zero 0/1: DDP with its counting hook, ``GradReducer`` where DDP cannot
wrap), and this module choosing between them.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshfold.mesh import ParallelDims
from meshfold.parallel.dp.fsdp import apply_fsdp, fsdp_policies
from meshfold.parallel.dp.replicate import apply_ddp, attach_grad_reducer, reduce_wire_dtype


def uses_fsdp(dims: ParallelDims) -> bool:
    return dims.parallel.zero >= 2 and dims.size("dp_shard_cp") > 1


def uses_ddp(dims: ParallelDims) -> bool:
    """Replicated gradients averaged over dp_cp (zero 0 and 1)."""
    return not uses_fsdp(dims) and dims.size("dp_cp") > 1


def uses_grad_reducer(dims: ParallelDims) -> bool:
    """DDP cannot wrap tensor- or expert-parallel DTensor parameters, and cannot follow a
    pipeline schedule's interleaved forwards and backwards: those layouts reduce gradients
    with ``GradReducer`` (once per step) instead."""
    return uses_ddp(dims) and (dims.enabled("tp") or dims.enabled("pp") or dims.parallel.ep > 1)


def apply_data_parallel(model: nn.Module, dims: ParallelDims, mp_policy=None, offload_policy=None,
                        comm_hook=None, train=None) -> nn.Module:
    """``comm_hook``: see ``apply_ddp`` (used only when the layout is DDP's)."""
    device_type = dims.mesh.device_type if dims.mesh is not None else "cpu"
    if train is not None and mp_policy is None and offload_policy is None:
        mp_policy, offload_policy = fsdp_policies(train, device_type)
    if uses_fsdp(dims):
        return apply_fsdp(model, dims, reshard_after_forward=dims.parallel.zero == 3, mp_policy=mp_policy,
                          offload_policy=offload_policy)
    wire = reduce_wire_dtype(train, device_type)
    if uses_grad_reducer(dims):
        return attach_grad_reducer(model, dims, wire)
    if uses_ddp(dims):
        return apply_ddp(model, dims, comm_hook, wire)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model
