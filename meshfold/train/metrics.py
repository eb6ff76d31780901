"""What a user sees: ``metrics.jsonl``, TensorBoard events, a progress bar; and the
quantities behind them (device peak FLOP/s for MFU, peak memory)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

# Dense bf16 peak per device (no sparsity), from the vendors' data sheets.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
                   "MI300X": 1307.0, "MI250X": 191.5}


def device_peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device, for MFU. ``MESHFOLD_PEAK_TFLOPS`` overrides; on CPU it is
    measured once (a float32 matmul on this process's threads) and cached."""
    env = os.environ.get("MESHFOLD_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return 100e12
    return _cpu_peak_flops()


_CPU_PEAK: float | None = None


def _cpu_peak_flops() -> float:
    global _CPU_PEAK
    if _CPU_PEAK is None:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.2:
            a @ b
            reps += 1
        _CPU_PEAK = 2 * n**3 * reps / (time.perf_counter() - start)
    return _CPU_PEAK


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: the caching allocator's peak; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


class MetricsLogger:
    """Rank 0 writes ``metrics.jsonl`` (one object per logged step) and TensorBoard events,
    and draws the progress bar. Other ranks get a logger that does nothing."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, tensorboard: bool = True,
                 progress: bool = True, start_step: int = 0):
        self.enabled = enabled
        self.total = total_steps
        self._file = None
        self._tb = None
        self._progress = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = (run_dir / "metrics.jsonl").open("a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None
        if progress:
            self._start_progress(start_step)

    def _start_progress(self, start_step: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(file=sys.stderr)
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), console=console, transient=False,
            disable=not console.is_terminal and not os.environ.get("MESHFOLD_PROGRESS"),
        )
        self._task = self._progress.add_task("train", total=self.total, completed=start_step, info="")
        self._progress.start()
        self._plain = not console.is_terminal

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, step)
                elif isinstance(value, dict):
                    for sub, v in value.items():
                        if isinstance(v, (int, float)):
                            self._tb.add_scalar(f"{key}/{sub}", v, step)
        info = (f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s  "
                f"mfu {100 * record['mfu']:.2f}%  mem {record['peak_mem_bytes'] / 2**20:,.0f} MiB")
        if self._progress is not None and not self._progress.disable:
            self._progress.update(self._task, completed=step, info=info)
        else:
            print(f"step {step}/{self.total}  {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
