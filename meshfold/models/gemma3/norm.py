"""Gemma's RMSNorm: x / rms(x) * (1 + w), its weights starting at 0 (``model.norm =
"gemma_rmsnorm"``). The shared ``RMSNorm`` carries the offset, so tensor parallel's norm
classes keep it."""

from __future__ import annotations

from meshfold.models.llama import RMSNorm


class GemmaRMSNorm(RMSNorm):
    offset = 1.0
