"""Where and in which precision a process computes: ``train.device`` and ``train.dtype``
resolved to torch objects (core layer: the trainer, the dry run and the cost calibration
all resolve them the same way)."""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def resolved_dtype_name(choice: str, device_type: str) -> str:
    """``train.dtype`` with ``auto`` resolved: bfloat16 on CUDA, float32 elsewhere. The one
    place ``auto`` is decided (the trainer's dtypes and FSDP2's mixed precision use it)."""
    if choice == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    return choice


def resolve_dtypes(choice: str, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None). bf16 keeps fp32 master weights."""
    choice = resolved_dtype_name(choice, device.type)
    if choice == "bfloat16":
        return torch.float32, torch.bfloat16
    return DTYPES[choice], None
