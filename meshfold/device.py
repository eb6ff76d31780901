"""Where and in which precision a process computes: ``train.device`` and ``train.dtype``
resolved to torch objects (core layer: the trainer, the dry run and the cost calibration
all resolve them the same way)."""

from __future__ import annotations

import os
import time

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


class StepClock:
    """Times of the work issued within one step, in seconds from ``start()``. On a CPU the
    host clock; on a GPU, CUDA events recorded on the current stream, because there the host
    only launches kernels and runs ahead of the device, so host clocks would time launches.
    The events are read once, at ``finish()`` (one wait for the last of them; the step's
    loss read waits for the device there anyway)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.wall0 = 0.0
        self._t0 = None

    def start(self) -> None:
        """The step begins now: ``wall0`` is the host's wall clock (ranks align on it)."""
        self.wall0 = time.time()
        self._t0 = self.mark()

    def mark(self):
        """A point in the step's work (a CUDA event, or the host clock)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def finish(self) -> float:
        """Seconds from ``start`` to now; every mark is readable with ``seconds`` after it."""
        end = self.mark()
        if self.cuda:
            end.synchronize()
        return self.seconds(end)

    def seconds(self, mark) -> float:
        return self._t0.elapsed_time(mark) / 1e3 if self.cuda else mark - self._t0
