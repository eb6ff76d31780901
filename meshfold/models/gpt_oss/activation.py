"""gpt-oss's clamped SwiGLU, the routed experts' activation (``model.mlp = "clamped_swiglu"``):
gate clamped above at ``limit``, up clamped to [-limit, limit], then
``gate * sigmoid(alpha * gate) * (up + 1)`` (transformers' ``GptOssExperts._apply_gate``)."""

from __future__ import annotations

import torch


def clamped_swiglu(cfg):
    """``glu(gate, up)`` with the config's ``swiglu_alpha`` and ``swiglu_limit``."""
    alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)

    return glu
