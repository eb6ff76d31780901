"""The checkpoint state an optimizer owns: one small protocol the checkpointer
(``train/checkpoint.py``) calls, whatever the optimizer, and its default for torch
optimizers whose parameters are the model's.

Naming (what makes a checkpoint reload into another layout): an optimizer's state is
flat, keyed by the *model* name of each parameter, ``state.<fqn>.<key>`` and
``param_groups.<fqn>.<key>``; tensors keep their global shape (a DTensor, a ``Chunks`` of
the boxes a ZeRO-1 rank owns (``zero_state.py``), or a whole tensor equal on every rank
holding it). DCP stores each piece at its global offsets, so the placeholders any layout
hands it (``checkpoint_template``) read whatever overlaps them: that is the re-sharding.

The protocol (``CheckpointState``), in the order the checkpointer calls it:

save   ``before_checkpoint()``        make the values the state refers to current
                                      (ZeRO-1 under bf16: gather the fp32 masters)
       ``checkpoint_state(model)``    this rank's keys and values (views, no copies)
load   ``before_load()``              storage to load the parameters into
       ``checkpoint_template(model, saved)``  placeholders for the keys this rank reads,
                                      ``saved`` being the optimizer keys the checkpoint has
       ``load_checkpoint_state(model, flat)`` take the loaded values in
       ``after_load()``               the parameters were loaded on every rank

A layout the state cannot be written in raises ``CheckpointStateError`` (one line).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from meshfold.parallel.dp.plan import unwrap

# DCP's optimizer state dict flattened by parameter name (layout-independent keys).
FLATTENED = StateDictOptions(flatten_optimizer_state_dict=True)
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


class CheckpointStateError(ValueError):
    """The optimizer's state cannot be checkpointed in this layout (the message says why)."""


class ParamNames:
    """The model this rank holds (its pipeline chunks as one module) and each parameter's
    layout-independent name: what an optimizer's checkpoint keys are made of."""

    def __init__(self, module: nn.Module):
        self.module = module

    @cached_property
    def by_id(self) -> dict[int, str]:
        return {id(p): name for name, p in unwrap(self.module).named_parameters()}

    def __getitem__(self, param: torch.Tensor) -> str:
        return self.by_id[id(param)]


@runtime_checkable
class CheckpointState(Protocol):
    """What an optimizer implements to be checkpointed (see the module doc)."""

    def before_checkpoint(self) -> None: ...

    def checkpoint_state(self, model: ParamNames) -> dict[str, Any]: ...

    def before_load(self) -> None: ...

    def checkpoint_template(self, model: ParamNames, saved: set[str]) -> dict[str, Any]: ...

    def load_checkpoint_state(self, model: ParamNames, flat: dict[str, Any]) -> None: ...

    def after_load(self) -> None: ...


class FlattenedState:
    """``CheckpointState`` of a torch optimizer whose parameters are the model's (AdamW,
    DDP/FSDP/tp/pp alike): DCP's own optimizer state dict, flattened by parameter name.
    Mixed into the optimizer class (``self`` is the optimizer)."""

    def before_checkpoint(self) -> None:
        pass

    def checkpoint_state(self, model: ParamNames) -> dict[str, Any]:
        return get_optimizer_state_dict(model.module, self, options=FLATTENED)

    def before_load(self) -> None:
        pass

    def checkpoint_template(self, model: ParamNames, saved: set[str]) -> dict[str, Any]:
        return self.checkpoint_state(model)

    def load_checkpoint_state(self, model: ParamNames, flat: dict[str, Any]) -> None:
        set_optimizer_state_dict(model.module, self, flat, options=FLATTENED)

    def after_load(self) -> None:
        pass


def state_of(optimizer: torch.optim.Optimizer) -> CheckpointState:
    """The optimizer's own checkpoint state; a plain torch optimizer (a test's, a tool's)
    is saved as ``FlattenedState`` saves it."""
    return optimizer if isinstance(optimizer, CheckpointState) else _Flattened(optimizer)


class _Flattened(FlattenedState):
    """``FlattenedState`` for an optimizer that does not mix it in."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def checkpoint_state(self, model: ParamNames) -> dict[str, Any]:
        return get_optimizer_state_dict(model.module, self.optimizer, options=FLATTENED)

    def load_checkpoint_state(self, model: ParamNames, flat: dict[str, Any]) -> None:
        set_optimizer_state_dict(model.module, self.optimizer, flat, options=FLATTENED)


def param_group_entries(optimizer: torch.optim.Optimizer, model: ParamNames,
                        saved: set[str] | None = None) -> dict[str, Any]:
    """``param_groups.<fqn>.<key>`` of every parameter (the same on every rank); given
    ``saved``, only those the checkpoint has."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in group.items():
                key = f"param_groups.{model[p]}.{k}"
                if k != "params" and (saved is None or key in saved):
                    out[key] = v
    return out


def load_param_groups(optimizer: torch.optim.Optimizer, model: ParamNames, flat: dict[str, Any]) -> None:
    """Each group's settings from the entries of its first parameter."""
    for group in optimizer.param_groups:
        if not group["params"]:
            continue
        fqn = model[group["params"][0]]
        for k in list(group):
            if k != "params" and f"param_groups.{fqn}.{k}" in flat:
                group[k] = flat[f"param_groups.{fqn}.{k}"]
