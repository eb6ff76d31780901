"""What ``meshfold dry-run`` reads off a simulated rank's step: an observer feature of the
``Trainer`` (``train/feature.py``), attached after the registered ones, and the byte counts.

The trainer runs its own step; the observer supplies the step's batch (random tokens in
the batch's shapes: the data set has no corpus), runs a first part of the step's
micro-batches where the driver asks (``take``), watches the gradients before each part's
last backward (``engine.observe_grad_sync``), counts a pipeline rank's saved activations by
chunk, and takes the step's collectives off the communication ledger right after the
update (the outer step of low-communication methods, later in ``after_step``, is not a
step's traffic)."""

from __future__ import annotations

import torch
import torch.nn.parallel.distributed as ddp_module
from torch.distributed.fsdp import FSDPModule

from meshfold.comm import ledger
from meshfold.data.loader import to_device, with_host_run_starts
from meshfold.memory import count_saved_activations
from meshfold.parallel.cp.batch import shard_for_context_parallel
from meshfold.schedules.held import held_counts, held_peak


class RowsWithoutCorpus:
    """The simulated rank's training set: as many sequences as a step draws, no corpus
    (``StepObserver.local_batch`` supplies the batches)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class StepObserver:
    """The dry-run's feature: a rank's parameter, gradient, optimizer and activation bytes
    and its collectives, measured in the trainer's own step (see the module doc)."""

    name = None

    def __init__(self, cfg, parts):
        self.cfg, self.dims, self.device = cfg, parts.dims, parts.device
        self.ledger = ledger()
        self.take: int | None = None  # micro-batches the next step runs (None: all)
        self.n_micro = self.micro_rows = 0  # the step's real micro-batch count and rows
        self.grad_bytes = 0
        self.chunk_grads: dict[int, dict[int, int]] = {1: {}, 2: {}}  # (_note_chunk_grads)
        self.reduced_chunks: set = set()
        self.by_chunk: dict = {}  # pipeline: saved activation bytes per chunk, this step
        self.collectives: dict = {}
        self.model = self.pipeline = self.optimizer = None

    def attach(self, parts) -> None:
        self.model = parts.model
        self.pipeline = getattr(parts.engine, "pipe", None)
        if isinstance(self.model, ddp_module.DistributedDataParallel):
            self.model.reducer = _KeptBuckets(self.model.reducer)
        parts.engine.observe_grad_sync(self._before_grad_sync)

    def wrap_optimizer(self, optimizer, scheduler):
        self.optimizer = optimizer  # the run's, as the features before this one left it
        return optimizer, scheduler

    # ------------------------------------------------------------------ the step

    def wrap_step(self, step_fn):
        """A pipeline rank's saved activations by chunk (``activation_tag``) over the step;
        without a pipeline the engine counts one micro-batch's (``activation_bytes``)."""
        def observed():
            if self.pipeline is None:
                return step_fn()
            with count_saved_activations(self.model) as counted:
                loss = step_fn()
            self.by_chunk = counted.by_tag
            return loss
        return observed

    def local_batch(self, device) -> dict[str, torch.Tensor]:
        """This rank's batch: random tokens of the trainer's shapes, as its prefetcher hands them over."""
        p, m, d = self.cfg.parallel, self.cfg.model, self.cfg.data
        tokens = torch.randint(0, m.vocab_size, (self.cfg.train.global_batch // p.dp, m.seq_len + 1))
        batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}
        if d.pack and d.doc_mask:
            batch["doc_ids"] = torch.zeros_like(batch["inputs"])
        batch = shard_for_context_parallel(batch, self.cfg, self.dims)
        return to_device(with_host_run_starts(batch), device)

    def before_step(self) -> None:
        self.ledger.pop_step()  # what ran before (building, another feature's after_step) is not this step

    def micro_batches(self, micro: list) -> list:
        self.n_micro, self.micro_rows = len(micro), micro[0]["inputs"].shape[0]
        return micro if self.take is None else micro[:self.take]

    def _before_grad_sync(self, chunk) -> None:
        self.grad_bytes = max(self.grad_bytes, held_grad_bytes(self.model))
        if self.pipeline is not None:
            self._note_chunk_grads(chunk)

    def reduce(self, loss_sum, tokens):
        self.grad_bytes = max(self.grad_bytes, held_grad_bytes(self.model))  # after backward, before the update
        return loss_sum, tokens

    def after_update(self) -> dict:
        self.collectives = self.ledger.pop_step_collectives()
        return {}

    # ------------------------------------------------------------------ pipeline moments

    def _note_chunk_grads(self, chunk) -> None:
        """Each pipeline chunk's gradient bytes while it accumulates (unsharded between
        micro-batches) and once reduced, seen before each chunk's last backward
        (``chunk``; None starts a step, "all" ends it): what ``held_pipeline_grads`` combines
        at the moments of the real micro-batch count."""
        if chunk is None:
            self.reduced_chunks = set()
            return
        if chunk == "all":
            return
        for c, module in enumerate(self.pipeline.model.chunks):
            held = held_grad_bytes(module)
            if held:
                seen = self.chunk_grads[2 if c in self.reduced_chunks else 1]
                seen[c] = max(seen.get(c, 0), held)
        self.reduced_chunks.add(chunk)

    def held_pipeline_grads(self) -> int:
        """The most gradient bytes this pipeline rank holds before a chunk's last backward
        in a step of the real micro-batch count: its chunks' accumulating and reduced
        bytes at each of those moments (the schedule's ``rank_grad_moments``, as the planner)."""
        pipe = self.pipeline
        if pipe is None or pipe.n_chunks == 1:
            return 0
        moments = pipe.schedule.rank_grad_moments(pipe.pp, pipe.schedule.virtual_of(pipe.virtual), self.n_micro,
                                                  pipe.rank)
        return max(sum(self.chunk_grads[s].get(c, 0) for c, s in enumerate(moment) if s) for moment in moments)

    def held_activations(self, counted_micro: int) -> float:
        """The most activation bytes this pipeline rank holds at once in a step of the real
        micro-batch count: each chunk's bytes per micro-batch (counted over
        ``counted_micro`` of them) held from its forward to its backward, in this rank's
        order (``held_counts``: the planner prices the same moments)."""
        pipe = self.pipeline
        order = pipe.orders_for(self.n_micro, self.micro_rows)
        per_micro = [self.by_chunk.get(c, 0) / counted_micro for c in range(pipe.n_chunks)]
        return held_peak(held_counts(order), per_micro)

    def state_bytes(self) -> dict:
        return {"param_bytes": param_bytes(self.model, self.optimizer),
                "grad_bytes": max(self.grad_bytes, self.held_pipeline_grads()),
                "optimizer_bytes": optimizer_bytes(self.optimizer)}


def observe(cfg, parts) -> StepObserver:
    """The observer's factory (``Surroundings.features``)."""
    return StepObserver(cfg, parts)


class _KeptBuckets:
    """DDP's reducer, as DDP's Python side calls it, except that it never rebuilds its
    buckets: after the first backward DDP re-allocates them in the order gradients arrived,
    copying parameter values, which fake tensors do not have. The dry-run's DDP cuts its
    buckets at the cap from the start (``ddp_without_shape_check``) and keeps them."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


# --------------------------------------------------------------------------- bytes


def param_bytes(model: torch.nn.Module, opt) -> int:
    """The parameter bytes the rank holds: its local pieces, except that ZeRO-1 under bf16
    holds only its own segment of the fp32 values (``ShardedAdamW.held_param_bytes``)."""
    held = getattr(opt, "held_param_bytes", None)
    if held is not None and opt.compute_dtype is not None:
        mine = {id(p) for p in opt.params}
        return held() + sum(_local_bytes(q) for q in model.parameters() if id(q) not in mine)
    return sum(_local_bytes(q) for q in model.parameters())


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def held_grad_bytes(model: torch.nn.Module) -> int:
    """Gradient bytes the rank holds now: the local pieces of its parameters' gradients,
    plus FSDP2's unsharded gradients, which it keeps between micro-batches while gradient
    sync is off (in the reduce dtype, ``unsharded_accumulated_grad``, once a second
    micro-batch has been added to them) and which ``model.parameters()`` does not show."""
    total = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fp in (group.fsdp_params if group is not None else ()):
            unsharded = getattr(fp, "_unsharded_param", None)
            for g in (getattr(unsharded, "grad", None), getattr(fp, "unsharded_accumulated_grad", None)):
                if g is not None:
                    total += _local_bytes(g)
    return total


def optimizer_bytes(opt) -> int:
    if hasattr(opt, "parts"):  # ZeRO-1 with expert parallel: the dense and the expert part
        return sum(optimizer_bytes(part) for part in opt.parts)
    inner = getattr(opt, "optim", None)  # ZeRO-1: the rank's own optimizer
    states = list(opt.state.values()) + (list(inner.state.values()) if inner is not None else [])
    return sum(_local_bytes(v) for s in states for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
