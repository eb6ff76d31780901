"""The dense feed-forward block (SwiGLU, GeGLU or GELU MLP): the dense layers' MLP in
``llama.py`` and the shared experts of ``moe.py`` (its own module so both import it one way)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models.config import GATED_MLPS as GATED  # w2(act(w1 x) * w3 x): silu or tanh-GELU (Gemma)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, kind: str = "swiglu", bias: bool = False):
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias) if kind in GATED else None

    def activate(self, a: torch.Tensor) -> torch.Tensor:
        """The activation on w1's output (the gate of a gated MLP)."""
        return F.silu(a) if self.kind == "swiglu" else F.gelu(a, approximate="tanh")

    def forward(self, x):
        if self.w3 is not None:
            return self.w2(self.activate(self.w1(x)) * self.w3(x))
        return self.w2(self.activate(self.w1(x)))
