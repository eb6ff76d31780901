"""ZeRO-1 with expert parallel: the dense parameters' Adam state sharded over the
data-parallel ranks and the routed experts' over the ranks holding the same experts, two
``ShardedAdamW`` seen as one optimizer (checkpointed as its parts are)."""

from __future__ import annotations

from typing import Any

import torch

from meshfold.optim.sharded import ShardedAdamW
from meshfold.optim.state import ParamNames


class ExpertSplitAdamW(torch.optim.Optimizer):
    """ZeRO-1 with expert parallel (DeepSeek-V3's layout): the dense parameters' Adam state
    sharded over the data-parallel ranks (``ShardedAdamW`` over dp_shard_cp) and the routed
    experts' over edp, the ranks holding the same experts (a second ``ShardedAdamW``), seen
    by the trainer, the scheduler, the compute weights and checkpoints as one optimizer.
    ``param_groups`` are the parts' own group dicts (a scheduler's lr reaches both);
    ``parts`` are what checkpoints save, each as any ``ShardedAdamW``. The gradient norm
    needs nothing here: the experts' gradients are DTensors sharded over ep, so
    ``grad_norm`` sums them over ep and counts each once."""

    def __init__(self, parts: list[ShardedAdamW]):
        self.parts = parts
        super().__init__([g for o in parts for g in o.param_groups], parts[0].defaults)
        self.params = [p for o in parts for p in o.params]
        self.compute_dtype = parts[0].compute_dtype

    @property
    def current(self) -> bool:
        return all(o.current for o in self.parts)

    def step(self, closure=None):
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.parts:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [o.optim.state_dict() if o.optim is not None else {} for o in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        for o, sd in zip(self.parts, state_dict["parts"], strict=True):
            if o.optim is not None:
                o.optim.load_state_dict(sd)

    def compute_copies(self) -> dict[int, torch.Tensor]:
        return {k: v for o in self.parts for k, v in o.compute_copies().items()}

    def sync_masters(self) -> None:
        for o in self.parts:
            o.sync_masters()

    def materialize(self) -> None:
        for o in self.parts:
            o.materialize()

    def masters_written(self) -> None:
        for o in self.parts:
            o.masters_written()

    def held_param_bytes(self) -> int:
        return sum(o.held_param_bytes() for o in self.parts)

    # ------------------------------------------------------------------ checkpoint state (state.py)

    def before_checkpoint(self) -> None:
        self.sync_masters()

    def checkpoint_state(self, model: ParamNames) -> dict[str, Any]:
        return {k: v for o in self.parts for k, v in o.checkpoint_state(model).items()}

    def before_load(self) -> None:
        self.materialize()

    def checkpoint_template(self, model: ParamNames, saved: set[str]) -> dict[str, Any]:
        return {k: v for o in self.parts for k, v in o.checkpoint_template(model, saved).items()}

    def load_checkpoint_state(self, model: ParamNames, flat: dict[str, Any]) -> None:
        for o in self.parts:
            o.load_checkpoint_state(model, flat)

    def after_load(self) -> None:
        self.masters_written()
