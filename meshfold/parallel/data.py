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

Expert parallel with zero 0/1 (``parallel/expert.py``): the routed experts, different on
each ep rank, are averaged over edp (the ranks holding the same experts) by a
``GradReducer`` of their own, and ZeRO-1 shards their Adam state there
(``parallel/optim.py::ExpertSplitAdamW``); the rest is averaged over dp_cp as above.

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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from meshfold import comm
from meshfold.comm import ledger
from meshfold.device import resolved_dtype_name
from meshfold.mesh import ParallelDims
from meshfold.models.moe import GroupedExperts
from meshfold.parallel.expert_shard import expert_shard_dim


# DDP's gradient bucket cap (torch's default, 25 MiB): also the size of GradReducer's buckets.
BUCKET_MB = 25


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


def expert_data_parallel(model: nn.Module) -> tuple[list[nn.Parameter], object | None]:
    """The parameters reduced over their own data-parallel mesh rather than dp_cp (expert
    parallel with zero 0/1: the routed experts, over edp; ``parallel/expert.py`` marks their
    modules with ``reduce_over``), and that mesh (None when there are none)."""
    owners = [m for m in model.modules() if getattr(m, "reduce_over", None) is not None]
    return [p for m in owners for p in m.parameters()], (owners[0].reduce_over if owners else None)


def shard_blocks(model: nn.Module):
    """The submodules FSDP wraps one by one: every transformer block (or expert group) and
    every multi-token prediction depth."""
    layers = getattr(model, "layers", None)
    mtp = getattr(model, "mtp", None)
    return (list(layers.values()) if layers is not None else []) + (list(mtp.values()) if mtp is not None else [])


def apply_fsdp(model: nn.Module, dims: ParallelDims, reshard_after_forward: bool,
               mp_policy: MixedPrecisionPolicy | None = None, offload_policy=None) -> nn.Module:
    kwargs = {"mesh": dims.fsdp_mesh(), "mp_policy": mp_policy or MixedPrecisionPolicy()}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for block in shard_blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=_expert_placement(block, dims.fsdp_mesh().size()), **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    _count_fsdp_bytes(model, dims, reshard_after_forward)
    return model


def _expert_placement(block: nn.Module, n: int):
    """FSDP2's ``shard_placement_fn`` for a block: the stacked expert weights [E_l, out, in]
    of an MoE block that keeps its experts (no expert parallel) sharded on the dimension
    ``expert_shard_dim`` picks, which pads least (dim 0 pads when E_l < n: every rank would
    hold a whole expert, n / E_l times its share); everything else FSDP2's default."""
    experts = {id(p) for m in block.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    if not experts:
        return None

    def placement(p: nn.Parameter) -> Shard | None:
        if id(p) not in experts:
            return None
        local = p.to_local() if isinstance(p, DTensor) else p
        return Shard(expert_shard_dim(tuple(local.shape), n))

    return placement


class _CountedAllGather(DefaultAllGather):
    """FSDP2's own all-gather, issued through the communication layer (which checks the
    tensors and records the bytes): what is counted is what FSDP2 actually sends."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return comm.all_gather_into_tensor(output_tensor, input_tensor, group, "dp", async_op=async_op)


class _CountedReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter (its op may be a pre-multiplied sum, which the communication
    layer's string ops do not name): checked and recorded there, issued as FSDP2 would."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        comm.check_tensors([output_tensor, input_tensor], group, "reduce_scatter")
        ledger().record("dp", "reduce_scatter", input_tensor.numel() * input_tensor.element_size(),
                        dist.get_world_size(group))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _count_fsdp_bytes(root: nn.Module, dims: ParallelDims, reshard_after_forward: bool = True) -> None:
    """Route every FSDP2 module's all-gathers and reduce-scatters through the communication
    layer, and record the HSDP all-reduce of the reduced shard (FSDP2 calls the hook on its
    output), so ``comm_bytes["dp"]`` is measured, micro-batch accumulation included."""
    for m in root.modules():
        if not isinstance(m, FSDPModule):
            continue
        _, n_rep = getattr(m, "fsdp_group_sizes", (dims.size("dp_shard_cp"), dims.size("dp_replicate")))
        m.set_custom_all_gather(_CountedAllGather())
        m.set_custom_reduce_scatter(_CountedReduceScatter())
        if n_rep > 1:
            m.set_all_reduce_hook(
                lambda out, n=n_rep: ledger().record("dp", "all_reduce", out.numel() * out.element_size(), n))


def _on_wire(flat: torch.Tensor, wire: torch.dtype | None) -> torch.Tensor:
    """The gradients ``flat`` as they cross the link: in ``train.reduce_dtype`` when it is
    narrower than theirs (``wire``), else themselves (reduced in place)."""
    return flat if wire is None or wire == flat.dtype else flat.to(wire)


def _counting_allreduce_hook(group: dist.ProcessGroup, wire: torch.dtype | None = None):
    n = dist.get_world_size(group)

    def hook(_state, bucket):
        tensor = bucket.buffer()
        tensor.div_(n)
        sent = _on_wire(tensor, wire)
        fut = comm.all_reduce(sent, group, "dp", async_op=True).get_future()
        # the all-reduce is in place: the bucket is its result (the ``fake`` backend of
        # ``meshfold dry-run`` completes the future without a value)
        return fut.then(lambda f: (f.wait(), tensor if sent is tensor else tensor.copy_(sent))[1])

    return hook


def reduce_wire_dtype(train, device_type: str) -> torch.dtype | None:
    """The dtype data parallel reduces gradients in when it is narrower than theirs:
    ``train.reduce_dtype = bfloat16`` under a bf16 compute dtype; None (their own) otherwise."""
    if train is None or train.reduce_dtype != "bfloat16" or resolved_dtype_name(train.dtype, device_type) != "bfloat16":
        return None
    return torch.bfloat16


def apply_ddp(model: nn.Module, dims: ParallelDims, comm_hook=None, wire: torch.dtype | None = None) -> nn.Module:
    """``comm_hook``: None, or ``install(ddp, group)`` registering the one communication
    hook DDP takes in place of the counting all-reduce (``lowcomm.compression``'s,
    ``lowcomm/compress.py``: the feature that owns it passes it down, so this layer never
    imports it). ``wire``: see ``reduce_wire_dtype``."""
    group = dims.group("dp_cp")
    ddp = DDP(model, process_group=group, broadcast_buffers=False, bucket_cap_mb=BUCKET_MB)
    if comm_hook is None:
        ddp.register_comm_hook(None, _counting_allreduce_hook(group, wire))
    else:
        comm_hook(ddp, group)
    return ddp


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return g.to_local() if hasattr(g, "to_local") else g


class GradReducer:
    """Once-per-step gradient averaging over ``dp_cp`` for the layouts DDP cannot wrap
    (Megatron's tp x pp x dp with zero 0/1). Parameters go in flat buckets (~25 MB, in
    reverse registration order, roughly the order backward produces them). When the
    reducer is armed (the step's last micro-batch), a bucket's all-reduce is launched
    asynchronously as soon as every gradient in it has been accumulated, so it overlaps the
    rest of backward; ``finish`` launches what is left, waits and writes the averages back.
    Unarmed backwards (earlier micro-batches) only accumulate: no traffic."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, n: int,
                 bucket_bytes: int = BUCKET_MB * 2**20, wire: torch.dtype | None = None):
        self.group, self.n, self.wire = group, n, wire
        params = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes + 1
        for p in reversed(params):
            local = p.to_local() if hasattr(p, "to_local") else p
            nbytes = local.numel() * local.element_size()
            if size + nbytes > bucket_bytes or local.dtype != self.buckets[-1][0].dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.armed = False
        self._left: list[int] = []
        self._works: dict[int, tuple] = {}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they complete."""
        self.armed = True
        self._left = [len(b) for b in self.buckets]

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        i = self.bucket_of[id(p)]
        self._left[i] -= 1
        if self._left[i] == 0:
            self._launch(i)

    def _launch(self, i: int) -> None:
        if i in self._works:
            return
        params = [p for p in self.buckets[i] if p.grad is not None]
        if not params:
            self._works[i] = (None, [], None)
            return
        flat = torch.cat([_local_grad(p).reshape(-1) for p in params])
        flat.div_(self.n)
        flat = _on_wire(flat, self.wire)
        work = comm.all_reduce(flat, self.group, "dp", async_op=True)
        self._works[i] = (work, params, flat)

    def finish(self) -> None:
        """Launch buckets not yet reduced (unused parameters, unarmed runs), wait, write back."""
        for i in range(len(self.buckets)):
            self._launch(i)
        for work, params, flat in self._works.values():
            if work is None:
                continue
            work.wait()
            offset = 0
            for p in params:
                g = _local_grad(p)
                g.copy_(flat[offset: offset + g.numel()].view_as(g))  # (casts back from the wire dtype)
                offset += g.numel()
        self._works.clear()
        self.armed = False


def attach_grad_reducer(model: nn.Module, dims: ParallelDims, wire: torch.dtype | None = None) -> nn.Module:
    """The dense parameters' reducer over dp_cp; with expert parallel under zero 0/1 a
    second one averages the experts over edp (none when edp = 1: nothing to average)."""
    experts, edp = expert_data_parallel(model)
    apart = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in apart]
    model.grad_reducer = GradReducer(dense, dims.group("dp_cp"), dims.size("dp_cp"), wire=wire)
    if experts and edp.size() > 1:
        model.expert_grad_reducer = GradReducer(experts, edp.get_group(), edp.size(), wire=wire)
    return model


def grad_reducers(model: nn.Module) -> list[GradReducer]:
    return [r for m in model.modules() for r in (getattr(m, "grad_reducer", None),
                                                 getattr(m, "expert_grad_reducer", None))
            if isinstance(r, GradReducer)]


def fsdp_policies(train, device_type: str = "cpu") -> tuple[MixedPrecisionPolicy, object | None]:
    """FSDP2 mixed precision and offload from ``[train]``: when the resolved compute dtype
    is bf16 (``dtype = bfloat16``, or ``auto`` on ``device_type`` cuda) the
    all-gathered compute copies are bf16 while the sharded fp32 master weights stay in
    fp32 and gradients are reduced in ``train.reduce_dtype``; ``offload = params`` moves
    parameters, gradients and optimizer state to host memory (the step runs there)."""
    mp = MixedPrecisionPolicy()
    if train is not None and resolved_dtype_name(train.dtype, device_type) == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.float32 if train.reduce_dtype == "float32" else torch.bfloat16)
    offload = None
    if train is not None and train.offload == "params":
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return mp, offload


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
