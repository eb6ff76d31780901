"""Data parallel with replicated parameters (zero 0/1): torch DDP with a counting all-reduce
hook (or the one communication hook a feature above hands down), and ``GradReducer``, the
once-per-step bucketed all-reduce for the layouts DDP cannot wrap (tp, pp, expert
parallel; the experts then over their own edp group). What each zero level means is in
``parallel/dp/plan.py``."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshfold import comm
from meshfold.device import resolved_dtype_name
from meshfold.mesh import ParallelDims


# DDP's gradient bucket cap (torch's default, 25 MiB): also the size of GradReducer's buckets.
BUCKET_MB = 25


def expert_data_parallel(model: nn.Module) -> tuple[list[nn.Parameter], object | None]:
    """The parameters reduced over their own data-parallel mesh rather than dp_cp (expert
    parallel with zero 0/1: the routed experts, over edp; ``parallel/ep/plan.py`` marks their
    modules with ``reduce_over``), and that mesh (None when there are none)."""
    owners = [m for m in model.modules() if getattr(m, "reduce_over", None) is not None]
    return [p for m in owners for p in m.parameters()], (owners[0].reduce_over if owners else None)


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
    with warnings.catch_warnings():
        # torch deprecates broadcast_buffers for forward_sync_buffers, whose False still syncs
        # buffers at init (a broadcast meshfold does not want: each rank builds its own);
        # torch's warning itself says to keep broadcast_buffers=False until init_sync_buffers exists.
        warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated", category=FutureWarning)
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
