"""Features: optional parts of a run behind one small protocol with explicit inputs.

A feature is built by a registered factory (``train/registry.py``: one line per feature)
from its config section and ``RunParts`` (the model, mesh, device, data sizes), never from
the trainer, and never writes to the trainer. The trainer keeps the built ones
(``Features``) and calls their hooks at fixed points; every hook is optional (a feature
defines the ones it needs), so lower layers (``meshfold.data``, ``meshfold.lowcomm``,
``meshfold.parallel``) implement it without importing this module.

Built before the model:

``name``                              checkpoint key: state saved under ``extra.<name>``
                                      (``state_dict``/``load_state_dict``, optionally
                                      ``load_template``); ``None``: no state
``prepare_model(model)``              the meta model before ``parallelize`` (no pipeline)
``comm_hook``                         DDP's one communication hook installer (at most one)
``wrap_loss(loss_fn) -> loss_fn``     extra loss terms around the token-loss sum
``forward_inputs(mb) -> dict``        extra keyword inputs of the model's forward
``touches_master_weights: bool``      the feature reads or writes the fp32 parameters
                                      between steps or replaces the optimizer: ZeRO-1 keeps
                                      its fp32 gather (``optim/sharded.py``)
``world_collectives: bool``           False: the feature promises no collective over all
                                      ranks, so the trainer turns its straggler check off
``holds_run_lock``, ``checks_resume``, ``writes_run_files`` (bool): the run directory's
                                      policy (live replicas share one the launcher locks)
``attach(parts)``                     once the model exists (``parts.model_parts``,
                                      ``parts.engine``: e.g. ``engine.observe_grad_sync``)

Each step, in this order:

``wrap_step(step_fn) -> step_fn``     the whole step (live recovery: until a quorum commits)
``before_step()``                     a step (or its redo) starts
``local_batch(device) -> batch``      a feature that supplies this rank's batches (at most one)
``after_batch() -> dict``             fields for metrics.jsonl once the batch is drawn
``micro_batches(micro) -> micro``     the step's micro-batches as the engine cut them (the
                                      dry-run's observer runs a first part of them)
``reduce(loss_sum, tokens) -> (loss_sum, tokens)``  after backward, before the update
``after_update() -> dict``            right after the optimizer step (MoE statistics)
``device_metrics(tokens) -> dict``    device values, read on the host after the loss
``after_step(step) -> dict``          after each optimizer step: fields for metrics.jsonl

And ``wrap_sampler(sampler)``, ``wrap_optimizer(opt, sched) -> (opt, sched)``,
``wrap_logger(logger)``, ``close()`` (a run that finished). Order at start-up: build, model,
attach, sampler, optimizer, checkpoint registration. See docs/engine.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


class Feature(Protocol):
    """The hooks a feature may define (all optional; see the module doc)."""

    name: str | None

    def wrap_sampler(self, sampler: Any) -> Any: ...

    def wrap_optimizer(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]: ...

    def local_batch(self, device) -> dict: ...

    def after_step(self, step: int) -> dict: ...


@dataclasses.dataclass
class RunParts:
    """What a feature is built from and attached to: explicit, never the trainer.
    ``model``/``model_parts``/``engine`` are set once the step engine holds them; ``features``: the
    ones built so far (a feature may ask for another by ``name``)."""

    cfg: Any
    dims: Any
    device: Any
    param_dtype: Any
    rank: int
    world: int
    data: Any
    progress: Any
    features: "Features"
    model: Any = None
    model_parts: list = dataclasses.field(default_factory=list)
    engine: Any = None  # the step engine (train/engine.py), once built


class Features:
    """The run's features, in the order they were added; each hook runs through all of them."""

    def __init__(self):
        self.items: list[Any] = []

    def add(self, feature: Any) -> Any:
        if feature is not None:
            self.items.append(feature)
        return feature

    def build(self, factories, cfg, parts: RunParts) -> "Features":
        """Every registered factory ``build(cfg, parts) -> feature | None``, in order."""
        for build in factories:
            self.add(build(cfg, parts))
        return self

    def __iter__(self):
        return iter(self.items)

    def named(self, name: str):
        """The feature whose checkpoint ``name`` is ``name``, or None."""
        return next((f for f in self.items if getattr(f, "name", None) == name), None)

    def of_type(self, cls):
        """The first feature that is a ``cls``, or None (tests, benchmarks)."""
        return next((f for f in self.items if isinstance(f, cls)), None)

    def _with(self, hook: str) -> list:
        return [f for f in self.items if hasattr(f, hook)]

    def _merged(self, hook: str, *args) -> dict:
        out: dict = {}
        for f in self._with(hook):
            out.update(getattr(f, hook)(*args))
        return out

    # ------------------------------------------------------------------ start-up

    def prepare_model(self, model):
        for f in self._with("prepare_model"):
            f.prepare_model(model)
        return model

    def comm_hook(self):
        hooks = [f.comm_hook for f in self._with("comm_hook") if f.comm_hook is not None]
        if len(hooks) > 1:
            raise ValueError("two features install a DDP communication hook")
        return hooks[0] if hooks else None

    def wrap_loss(self, loss_fn):
        for f in self._with("wrap_loss"):
            loss_fn = f.wrap_loss(loss_fn)
        return loss_fn

    def forward_inputs(self):
        """``mb -> dict`` of the features' extra forward inputs, or None when none adds any."""
        makers = [f.forward_inputs for f in self._with("forward_inputs")]
        if not makers:
            return None
        return lambda mb: {k: v for make in makers for k, v in make(mb).items()}

    def attach(self, parts: RunParts) -> None:
        for f in self._with("attach"):
            f.attach(parts)

    def wrap_sampler(self, sampler):
        for f in self._with("wrap_sampler"):
            sampler = f.wrap_sampler(sampler)
        return sampler

    def wrap_optimizer(self, optimizer, scheduler):
        for f in self._with("wrap_optimizer"):
            optimizer, scheduler = f.wrap_optimizer(optimizer, scheduler)
        return optimizer, scheduler

    def batch_source(self):
        """The feature that supplies batches, or None (the trainer's own sampler and prefetcher)."""
        sources = self._with("local_batch")
        if len(sources) > 1:
            raise ValueError(f"two features supply batches: {[type(f).__name__ for f in sources]}")
        return sources[0] if sources else None

    def _all(self, flag: str) -> bool:
        return all(getattr(f, flag, True) for f in self.items)

    @property
    def world_collectives(self) -> bool:
        return self._all("world_collectives")

    @property
    def touches_master_weights(self) -> bool:
        return any(getattr(f, "touches_master_weights", False) for f in self.items)

    @property
    def holds_run_lock(self) -> bool:
        return self._all("holds_run_lock")

    @property
    def checks_resume(self) -> bool:
        return self._all("checks_resume")

    @property
    def writes_run_files(self) -> bool:
        return self._all("writes_run_files")

    # ------------------------------------------------------------------ one step

    def wrap_step(self, step_fn):
        for f in self._with("wrap_step"):
            step_fn = f.wrap_step(step_fn)
        return step_fn

    def before_step(self) -> None:
        for f in self._with("before_step"):
            f.before_step()

    def after_batch(self) -> dict:
        return self._merged("after_batch")

    def micro_batches(self, micro: list) -> list:
        for f in self._with("micro_batches"):
            micro = f.micro_batches(micro)
        return micro

    def reduce(self, loss_sum, tokens):
        for f in self._with("reduce"):
            loss_sum, tokens = f.reduce(loss_sum, tokens)
        return loss_sum, tokens

    def after_update(self) -> dict:
        return self._merged("after_update")

    def device_metrics(self, tokens) -> dict:
        return self._merged("device_metrics", tokens)

    def after_step(self, step: int) -> dict:
        return self._merged("after_step", step)

    def wrap_logger(self, logger):
        for f in self._with("wrap_logger"):
            logger = f.wrap_logger(logger)
        return logger

    def close(self) -> None:
        for f in self._with("close"):
            f.close()

    def register_state(self, checkpointer) -> None:
        """Every feature with a ``name`` saves and restores its state with the checkpoints."""
        for f in self.items:
            if getattr(f, "name", None):
                checkpointer.register(f.name, f)
