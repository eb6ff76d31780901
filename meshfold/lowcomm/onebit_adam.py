"""1-bit Adam (Tang et al. 2021): exact Adam while the variance settles, then the variance
is frozen and only the 1-bit compressed momentum crosses the data-parallel group.

    warm-up (t <= T_w):  g = mean_ranks(g_i) (full precision, the ordinary DDP all-reduce)
                         m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  AdamW update
    compressed (t > T_w): m_i = b1 m + (1-b1) g_i        (local gradient, no all-reduce)
                         m = mean_ranks(C(m_i + e_i)),  e_i <- m_i + e_i - C(m_i + e_i)
                         p <- p - lr (m_hat / (sqrt(v_hat_frozen) + eps) + wd p)

C is the sign compressor with one fp32 scale per tensor (``codecs/sign.py``).
Every rank ends each step with the same m, v and p, so parameters stay identical.

Checkpoints (``optim/state.py``): DCP's flattened optimizer state, plus the step count
``t`` that decides warm-up or compressed (DCP's state dict keeps only the per-parameter
state and the groups, so a resume used to start the warm-up over).
"""

from __future__ import annotations

from typing import Any

import torch

from meshfold.lowcomm.codecs.sign import sign_all_reduce_mean
from meshfold.optim.state import FlattenedState, ParamNames

_STEPS_KEY = "onebit_t"


class OneBitAdam(FlattenedState, torch.optim.Optimizer):
    def __init__(self, params, group, n: int, warmup_steps: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.comm_group, self.n, self.warmup_steps = group, n, warmup_steps
        self.t = 0

    @property
    def frozen(self) -> bool:
        """True once the variance is frozen: gradients then stay local (see the DDP hook)."""
        return self.t >= self.warmup_steps

    @torch.no_grad()
    def step(self, closure=None):
        compressed = self.frozen
        self.t += 1
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                    st["error"] = torch.zeros_like(p).view(-1)
                    st["v_steps"] = 0
                m, v = st["m"], st["v"]
                if compressed:
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                    m.copy_(sign_all_reduce_mean(f"{i}", m, st["error"], self.comm_group, self.n))
                else:
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    st["v_steps"] += 1
                m_hat = m / (1 - b1 ** self.t)
                v_hat = v / (1 - b2 ** max(1, st["v_steps"]))
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m_hat, v_hat.sqrt().add_(group["eps"]), value=-group["lr"])

    def state_dict(self):
        sd = super().state_dict()
        sd[_STEPS_KEY] = self.t
        return sd

    def load_state_dict(self, state_dict):  # (DCP passes it by keyword)
        state_dict = dict(state_dict)
        self.t = state_dict.pop(_STEPS_KEY, 0)
        super().load_state_dict(state_dict)

    # ------------------------------------------------------------------ checkpoint state (optim/state.py)

    def checkpoint_state(self, model: ParamNames) -> dict[str, Any]:
        return {**super().checkpoint_state(model), _STEPS_KEY: self.t}

    def checkpoint_template(self, model: ParamNames, saved: set[str]) -> dict[str, Any]:
        out = super().checkpoint_template(model, saved)
        if _STEPS_KEY not in saved:  # written before 1-bit Adam kept its step count
            del out[_STEPS_KEY]
        return out

    def load_checkpoint_state(self, model: ParamNames, flat: dict[str, Any]) -> None:
        flat = dict(flat)
        steps = flat.pop(_STEPS_KEY, None)
        super().load_checkpoint_state(model, flat)
        if steps is not None:
            self.t = int(steps)
