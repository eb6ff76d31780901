"""ZeRO-1 through torch's ``ZeroRedundancyOptimizer`` (plain parameters: DDP, pipeline
stages): each rank keeps Adam state for the whole parameters it owns and broadcasts them
after its update. Checkpointed as the state of those parameters, by name."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from meshfold.comm import ledger
from meshfold.optim.state import ADAM_KEYS, ParamNames, load_param_groups, param_group_entries


class ZeroOneOptimizer(ZeroRedundancyOptimizer):
    """ZeRO-1: gradients are all-reduced by DDP; each rank keeps Adam state only for the
    parameters it owns and broadcasts them after its update. Records that traffic."""

    def __init__(self, groups, group: dist.ProcessGroup, **adam_kwargs):
        super().__init__(groups[0]["params"], optimizer_class=torch.optim.AdamW, process_group=group,
                         weight_decay=groups[0]["weight_decay"], **adam_kwargs)
        for extra in groups[1:]:
            self.add_param_group(extra)
        self._n = dist.get_world_size(group)
        self._bytes = sum(p.numel() * p.element_size() for g in groups for p in g["params"])

    def step(self, closure=None):
        out = super().step(closure)
        ledger().record("dp", "all_gather", self._bytes, self._n)
        return out

    # ------------------------------------------------------------------ checkpoint state (state.py)

    def before_checkpoint(self) -> None:
        pass

    def checkpoint_state(self, model: ParamNames) -> dict[str, Any]:
        """The Adam state of the parameters this rank owns (whole), and every group entry."""
        state = {}
        for p, s in self.optim.state.items():
            for k, v in s.items():
                state[f"state.{model[p]}.{k}"] = v
        state.update(param_group_entries(self, model))
        return state

    def before_load(self) -> None:
        pass

    def checkpoint_template(self, model: ParamNames, saved: set[str]) -> dict[str, Any]:
        """Placeholders for the state of the parameters this rank owns (if the checkpoint
        has any) and every param-group entry."""
        out: dict[str, Any] = {}
        for p in (p for g in self.optim.param_groups for p in g["params"]):
            for k in ADAM_KEYS:
                key = f"state.{model[p]}.{k}"
                if key in saved:
                    out[key] = torch.zeros((), dtype=torch.float32) if k == "step" else torch.empty_like(p)
        out.update(param_group_entries(self, model, saved))
        return out

    def load_checkpoint_state(self, model: ParamNames, flat: dict[str, Any]) -> None:
        for g in self.optim.param_groups:
            for p in g["params"]:
                fqn = model[p]
                state = {k: flat[f"state.{fqn}.{k}"] for k in ADAM_KEYS if f"state.{fqn}.{k}" in flat}
                if state:
                    self.optim.state[p] = {k: v.to(p.device) if k != "step" else v for k, v in state.items()}
        load_param_groups(self, model, flat)

    def after_load(self) -> None:
        pass
