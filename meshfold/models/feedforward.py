"""The dense feed-forward block (SwiGLU or GELU MLP): the dense layers' MLP in ``llama.py``
and the shared experts of ``moe.py`` (its own module so both import it one way)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, kind: str = "swiglu", bias: bool = False):
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias) if kind == "swiglu" else None

    def forward(self, x):
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))
