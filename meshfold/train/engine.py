"""One step engine: forward and backward of one step's batch, evaluation and ``full_state``,
with two executions of the same policy.

``StepEngine`` holds what every layout shares: the loss scale (the token-loss sum is
divided by the *global* valid-token count and multiplied by the number of ranks that
average gradients, so the averaged gradient is the one-process gradient of the mean loss),
the MoE auxiliary terms scaled the same way, autocast and the document mask of the
forward, the one micro-batch splitter (``data/micro.py``), the gradient-norm clip and the
unsharded ``full_state``. ``LocalEngine`` runs the micro-batches one after the other on
this rank's model; ``PipelineEngine`` hands the same forward, loss and auxiliary terms to
the pipeline executor (``parallel/pp/executor.py::Pipeline``), which runs the schedule.

The trainer counts the global tokens (one all-reduce), cuts the batch with
``engine.micro_batches(batch)`` and calls ``engine.step(micro, global_tokens, step)``
(gradients accumulated and reduced),
``engine.clip_grad_norm``, ``engine.evaluate(batch)`` and ``engine.full_state()``; the
engine never sees the optimizer, the data or the trainer. ``observe_grad_sync(fn)``: ``fn(chunk)``
is called right before a part's gradients are reduced in its last backward of the step (an
observer measures what is held then: the dry-run). See docs/engine.md.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import torch

from meshfold.config import Config
from meshfold.data.loader import HOST_POSITIONS, HOST_RUN_STARTS
from meshfold.data.micro import micro_batch_count, split_micro_batches
from meshfold.mesh import ParallelDims
from meshfold.models.attention_ops import note_run_starts
from meshfold.models.moe import moe_aux_loss
from meshfold.parallel.cp.plan import context_step_metrics
from meshfold.parallel.dp.plan import unwrap, uses_ddp, uses_fsdp, uses_grad_reducer
from meshfold.parallel.dp.replicate import grad_reducers
from meshfold.parallel.pp.executor import Pipeline
from meshfold.parallel.pp.timeline_plot import TIMELINE_FILE
from meshfold.memory import count_saved_activations
from meshfold.parallel.compute_weights import ComputeWeights, compute_weights_for
from meshfold.optim.clip import clip_grad_norm_


def unsharded(named, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full CPU copies of ``named`` parameters (or their gradients; missing ones skipped)."""
    out = {}
    for name, p in named:
        t = p.grad if grads else p
        if t is None:
            continue
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().clone().cpu()
    return out


class StepEngine:
    """What both executions share; see the module doc. ``parts``: the modules this rank
    holds (one model, or its pipeline chunks), which checkpoints save under the full
    model's names."""

    model: torch.nn.Module
    parts: list[torch.nn.Module]

    def __init__(self, cfg: Config, dims: ParallelDims, device: torch.device,
                 autocast_dtype: torch.dtype | None, loss_fn, use_doc_mask: bool, forward_inputs=None):
        """``loss_fn(logits, labels)``: the token-loss sum; ``use_doc_mask``: batches carry
        ``doc_ids`` that the attention masks by (``data.pack`` and ``data.doc_mask``);
        ``forward_inputs(mb) -> dict``: the features' extra keyword inputs of the forward
        (``train/feature.py``; e.g. the token ids multi-token prediction embeds), or None."""
        self.cfg, self.dims, self.device = cfg, dims, device
        self.autocast_dtype, self.loss_fn = autocast_dtype, loss_fn
        self.use_doc_mask = use_doc_mask
        self.forward_inputs = forward_inputs
        self.grad_reducers = dims.size("dp_cp")
        self.metrics: dict = {}  # this step's fields for metrics.jsonl (activation_bytes, bubble, cp)
        self.weights: ComputeWeights | None = None  # set by the subclass once it holds the modules
        self.grad_sync_observers: list = []  # observe_grad_sync's

    def observe_grad_sync(self, fn) -> None:
        """``fn(chunk)`` right before a part's gradients are reduced: ``chunk`` is the part
        (pipeline chunk) whose next backward is its last of the step; with a pipeline also None
        when the schedule starts and "all" when it is done."""
        self.grad_sync_observers.append(fn)

    # ------------------------------------------------------------------ shared policy

    def compute_weights(self):
        """The step's bf16 compute copies of the fp32 parameters, for layouts FSDP2 does
        not cast (parallel/compute_weights.py); nothing to do otherwise."""
        return self.weights.active() if self.weights is not None else contextlib.nullcontext()

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward(self, module: torch.nn.Module, x: torch.Tensor, mb: dict) -> torch.Tensor:
        """``module`` (the model or one pipeline chunk) on ``x`` under autocast, with the
        micro-batch's positions and, with ``data.doc_mask``, its document ids."""
        doc_ids = mb["doc_ids"] if self.use_doc_mask else None
        extra = self.forward_inputs(mb) if self.forward_inputs is not None else {}
        with self.autocast():
            return module(x, positions=mb.get("positions"), doc_ids=doc_ids, **extra)

    def loss_scale(self, global_tokens: torch.Tensor) -> torch.Tensor:
        return self.grad_reducers / global_tokens.clamp(min=1)

    def moe_aux(self, module: torch.nn.Module, n_micro: int) -> torch.Tensor | None:
        """``module``'s MoE balance and z-loss terms (models/moe.py) of the micro-batch just
        run: their sum over ranks is the global-batch value, so they are scaled by the
        gradient-averaging ranks like the LM loss (and spread over the micro-batches)."""
        aux = moe_aux_loss(module)
        return None if aux is None else aux * (self.grad_reducers / n_micro)

    def micro_batches(self, batch: dict) -> list[dict]:
        p, local = self.cfg.parallel, batch["inputs"].shape[0]
        n = micro_batch_count(local, self.cfg.train.micro_batch, p.pp, p.pp_microbatches)
        micro = split_micro_batches(batch, n)
        for mb in micro:  # document runs found on the host by the loader: no read back per micro-batch
            starts, positions = mb.pop(HOST_RUN_STARTS, None), mb.pop(HOST_POSITIONS, None)
            if starts is not None and "doc_ids" in mb:
                note_run_starts(mb["doc_ids"], starts, positions)
        return micro

    # ------------------------------------------------------------------ the step

    def step(self, micro: list[dict], global_tokens: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches (``micro_batches(batch)``):
        gradients accumulated over them and reduced over data parallel. ``global_tokens``:
        the valid tokens of the global batch (the trainer's one all-reduce of the step's
        control scalars); ``step``: the number of the step it makes. Returns this rank's loss
        sum; the step's metrics are in ``self.metrics`` (``pop_metrics``)."""
        loss_sum = self.forward_backward(micro, global_tokens, step)
        self.metrics.update(context_step_metrics(self.model))  # cp: attention work max/mean
        return loss_sum

    def forward_backward(self, micro: list[dict], global_tokens: torch.Tensor,
                         step: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (clipped to ``max_norm`` when > 0)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return clip_grad_norm_(params, max_norm, extra_group=self.norm_group(), device=self.device)

    def norm_group(self):
        """A group beyond the parameters' own meshes over which the norm is summed."""
        return None

    def pop_metrics(self) -> dict:
        out, self.metrics = self.metrics, {}
        return out

    # ------------------------------------------------------------------ evaluation, inspection

    def evaluate(self, batch: dict) -> torch.Tensor:
        """This rank's token-loss sum (float64) of a held-out ``batch``; call under no_grad."""
        raise NotImplementedError

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded parameters (or their gradients) by model name, for tests and export."""
        raise NotImplementedError

    def sync_masters(self) -> None:
        """The fp32 parameters current on every rank (ZeRO-1 under bf16 updates only its own
        segment's between checkpoints: parallel/compute_weights.py); collective over dp."""
        if self.weights is not None:
            self.weights.sync_masters()


class LocalEngine(StepEngine):
    """This rank holds the whole (possibly tp/cp/ep/dp-sharded) model: micro-batches run in
    order, data-parallel gradients are reduced in the last one's backward."""

    def __init__(self, model: torch.nn.Module, cfg: Config, dims: ParallelDims, device: torch.device,
                 autocast_dtype: torch.dtype | None, loss_fn, use_doc_mask: bool, forward_inputs=None):
        super().__init__(cfg, dims, device, autocast_dtype, loss_fn, use_doc_mask, forward_inputs)
        self.model, self.parts = model, [model]
        self.weights = compute_weights_for([unwrap(model)], autocast_dtype, uses_fsdp(dims))

    def forward_loss(self, mb: dict) -> torch.Tensor:
        with self.autocast():
            logits = self.forward(self.model, mb["inputs"], mb)
            return self.loss_fn(logits, mb["labels"])

    def forward_backward(self, micro: list[dict], global_tokens: torch.Tensor,
                         step: int | None = None) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns this rank's loss sum."""
        scale = self.loss_scale(global_tokens)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with self.compute_weights():
            for i, mb in enumerate(micro):
                last = i == len(micro) - 1
                with self.grad_sync(last):
                    with self.activation_counter(first=i == 0) as counted:
                        loss = self.forward_loss(mb)
                    if counted is not None:
                        self.metrics["activation_bytes"] = counted.bytes
                    aux = self.moe_aux(self.model, len(micro))
                    (loss * scale.to(loss.dtype) + (0.0 if aux is None else aux)).backward()
                loss_sum += loss.detach().double()
        for reducer in grad_reducers(self.model):
            reducer.finish()
        return loss_sum

    def grad_sync(self, last: bool):
        """Data-parallel gradients are reduced once per step, in the last micro-batch's
        backward: DDP's no_sync before it; FSDP2 keeps unsharded gradients (and, ZeRO-2,
        unsharded parameters) between micro-batches and reduce-scatters once;
        ``GradReducer`` (tp/pp with zero 0/1) is armed for the last backward only."""
        if last:
            for observe in self.grad_sync_observers:
                observe(0)
        if uses_fsdp(self.dims):
            self.model.set_requires_gradient_sync(last)
            if self.cfg.parallel.zero == 2:
                self.model.set_reshard_after_backward(last)
            return contextlib.nullcontext()
        if last:
            for reducer in grad_reducers(self.model):
                reducer.arm()
        if last or not uses_ddp(self.dims) or uses_grad_reducer(self.dims):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def activation_counter(self, first: bool):
        """Count the bytes autograd saves for backward on the first micro-batch of a step
        (the honest activation-memory figure on CPU; see meshfold/memory.py). Off under
        torch.compile, whose graphs the counting hooks would break."""
        if not first or self.cfg.train.compile:
            return contextlib.nullcontext()
        return count_saved_activations(self.model)

    def evaluate(self, batch: dict) -> torch.Tensor:
        with self.compute_weights():
            return self.forward_loss(batch).double()

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        if not grads:
            self.sync_masters()
        return unsharded(unwrap(self.model).named_parameters(), grads)


class PipelineEngine(StepEngine):
    """This rank holds pipeline chunks; the executor runs the schedule with this engine's
    forward, loss and MoE terms, and the loss sum arrives summed over the stages."""

    def __init__(self, pipe: Pipeline, cfg: Config, dims: ParallelDims, device: torch.device,
                 autocast_dtype: torch.dtype | None, loss_fn, use_doc_mask: bool, write_timeline: bool = False,
                 forward_inputs=None, timeline: bool = True):
        """``write_timeline``: this rank appends the schedule's events to
        ``RUN_DIR/pipeline_timeline.jsonl`` on the steps metrics are logged; ``timeline``:
        the events are gathered then (an object collective over pp; off where collectives
        return at once without data: a fake process group)."""
        super().__init__(cfg, dims, device, autocast_dtype, loss_fn, use_doc_mask, forward_inputs)
        self.pipe = pipe
        self.grad_sync_observers = pipe.grad_sync_observers  # called by the executor
        self.timeline = timeline
        self.model, self.parts = pipe.model, list(pipe.chunks)
        self.weights = compute_weights_for(self.parts, autocast_dtype, uses_fsdp(dims))
        self.write_timeline = write_timeline

    def forward_backward(self, micro: list[dict], global_tokens: torch.Tensor,
                         step: int | None = None) -> torch.Tensor:
        """The schedule's execution (loss summed over stages); with ``step``, the timeline
        of the steps that are logged."""
        with self.compute_weights():
            loss_sum = self.pipe.forward_backward(micro, self.loss_scale(global_tokens), self.forward, self.loss_fn,
                                                  self.moe_aux)
        self.pipe.sum_embedding_grads()  # multi-token prediction: the last stage's embedding copy
        self.metrics.update(self.pipe.metrics)
        t = self.cfg.train
        if self.timeline and step is not None and (step % max(1, t.log_every) == 0 or step == t.steps):
            self.pipe.log_events(step, Path(t.run_dir) / TIMELINE_FILE, self.write_timeline)
        return loss_sum

    def norm_group(self):
        return self.dims.group("pp")  # stages hold disjoint parameters

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """As one process's: the last stage's copy of the embedding (multi-token prediction)
        is clipped but counted once, on the first stage."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        return clip_grad_norm_(params, max_norm, extra_group=self.norm_group(), device=self.device,
                               uncounted=self.pipe.embedding_copies())

    def evaluate(self, batch: dict) -> torch.Tensor:
        with self.compute_weights():
            return self.pipe.forward_loss_sum(batch, self.forward, self.loss_fn)

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Gathered from every stage onto pp rank 0 (empty elsewhere)."""
        if not grads:
            self.sync_masters()
        return self.pipe.gather_state(unsharded(itertools.chain.from_iterable(
            c.named_parameters() for c in self.pipe.chunks), grads))
