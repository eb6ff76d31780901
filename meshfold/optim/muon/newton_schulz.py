"""Newton-Schulz orthogonalisation (Muon's update direction) and the update's scale.

The quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, from X = G / ||G||_F drives
every singular value of G towards 1 (Keller Jordan's coefficients by default), on the
wide orientation (rows <= columns) so A is the smaller Gram matrix. Batched: ``g`` is
[k, rows, cols], k matrices of one shape at once (one owner's batch, or experts)."""

from __future__ import annotations

import math

import torch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
SCALES = ("match_rms_adamw", "shape", "none")
EPS = 1e-7


def orthogonalize(g: torch.Tensor, steps: int = 5, coefficients=DEFAULT_COEFFICIENTS,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """The orthogonalised ``g`` ([k, rows, cols]), computed in ``dtype`` (``g``'s when None)
    and returned in ``g``'s dtype."""
    a, b, c = coefficients
    x = g.to(dtype or g.dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def update_scale(rows: int, cols: int, scale: str) -> float:
    """Factor on the orthogonalised update: ``match_rms_adamw`` (Moonlight: 0.2 sqrt(max),
    an update RMS like AdamW's, so AdamW's learning rate and weight decay carry over),
    ``shape`` (sqrt(max(1, rows/cols)), Keller Jordan's) or ``none``."""
    if scale == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if scale == "shape":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``orthogonalize`` on one rows x cols matrix (three matmuls per step)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * 2 * (m * m * n + m * m * m + m * m * n)
