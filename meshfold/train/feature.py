"""Features: optional parts of a run behind one small protocol with explicit inputs.

A feature is built from its config section and the objects it needs (model, mesh, device,
data sizes), never from the trainer, and never writes to the trainer. The trainer keeps a
list of them (``Features``) and calls their hooks at fixed points; every hook is optional
(a feature defines the ones it needs), so lower layers (``meshfold.data``,
``meshfold.lowcomm``) implement it without importing this module:

``name``                              checkpoint key: state saved under ``extra.<name>``
                                      (``state_dict``/``load_state_dict``, optionally
                                      ``load_template``); ``None``: no state
``wrap_sampler(sampler) -> sampler``   the global-batch sampler the run draws from
``wrap_optimizer(opt, sched) -> (opt, sched)``  e.g. 1-bit Adam in place of AdamW
``local_batch(device) -> batch``       a feature that supplies this rank's batches (at most one)
``after_step(step) -> dict``           after each optimizer step: fields for metrics.jsonl
``wrap_logger(logger) -> logger``      the metrics logger (live recovery: which replica writes)
``close()``                            at the end of a run that finished
``world_collectives: bool``            False: the feature promises no collective over all
                                      ranks, so the trainer turns its straggler check off

Order at start-up: sampler, then (after the model and optimizer are built) optimizer and
scheduler, then checkpoint registration. See docs/engine.md.
"""

from __future__ import annotations

from typing import Any, Protocol


class Feature(Protocol):
    """The hooks a feature may define (all optional; see the module doc)."""

    name: str | None

    def wrap_sampler(self, sampler: Any) -> Any: ...

    def wrap_optimizer(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]: ...

    def local_batch(self, device) -> dict: ...

    def after_step(self, step: int) -> dict: ...


class Features:
    """The run's features, in the order they were added; each hook runs through all of them."""

    def __init__(self):
        self.items: list[Any] = []

    def add(self, feature: Any) -> Any:
        if feature is not None:
            self.items.append(feature)
        return feature

    def __iter__(self):
        return iter(self.items)

    def _with(self, hook: str) -> list:
        return [f for f in self.items if hasattr(f, hook)]

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

    def after_step(self, step: int) -> dict:
        out: dict = {}
        for f in self._with("after_step"):
            out.update(f.after_step(step))
        return out

    def wrap_logger(self, logger):
        for f in self._with("wrap_logger"):
            logger = f.wrap_logger(logger)
        return logger

    def close(self) -> None:
        for f in self._with("close"):
            f.close()

    @property
    def world_collectives(self) -> bool:
        return all(getattr(f, "world_collectives", True) for f in self.items)

    def register_state(self, checkpointer) -> None:
        """Every feature with a ``name`` saves and restores its state with the checkpoints."""
        for f in self.items:
            if getattr(f, "name", None):
                checkpointer.register(f.name, f)
