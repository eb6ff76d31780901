"""What a user sees: ``metrics.jsonl``, TensorBoard events, a progress bar; and the
quantities behind them (device peak FLOP/s for MFU, peak memory)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

# Dense bf16 tensor-core peak per device (no sparsity), by the exact name
# torch.cuda.get_device_name reports. Sources: NVIDIA's data sheets (H100/H800 SXM 989,
# PCIe 756, NVL 835; H200 SXM 989, NVL 835; H20 148; B200 2250; GB200 2500 per GPU; A100 312;
# L40S 362; L4 121; A10 125) and AMD's (MI300X/MI325X 1307; MI250X 383 per package = 191.5
# per GCD, which is what torch sees as one device). A name not listed is not guessed at
# (a "H100" substring would give a PCIe card the SXM peak): set train.peak_tflops.
GPU_PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 SXM5 80GB": 989.0, "NVIDIA H100 SXM5 94GB": 989.0,
    "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0,
    "NVIDIA H800": 989.0, "NVIDIA H800 PCIe": 756.0, "NVIDIA H20": 148.0,
    "NVIDIA H200": 989.0, "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.0, "NVIDIA GH200 144G HBM3e": 989.0,
    "NVIDIA B200": 2250.0, "NVIDIA GB200": 2500.0,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA A800-SXM4-80GB": 312.0,
    "NVIDIA L40S": 362.0, "NVIDIA L4": 121.0, "NVIDIA A10": 125.0,
    "AMD Instinct MI300X": 1307.0, "AMD Instinct MI300X VF": 1307.0, "AMD Instinct MI325X": 1307.0,
    "AMD Instinct MI250X": 191.5, "AMD Instinct MI250X/MI250": 191.5,
}
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def device_peak_flops(device: torch.device, peak_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device, for MFU: ``train.peak_tflops`` (or ``MESHFOLD_PEAK_TFLOPS``)
    when set; on a GPU the table by exact device name, None (MFU not reported, one warning)
    for a name it does not list; on CPU measured once (a float32 matmul on this process's
    threads, the best of several rounds) and cached."""
    env = os.environ.get("MESHFOLD_PEAK_TFLOPS")
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if env:
        return float(env) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if name in GPU_PEAK_TFLOPS:
            return GPU_PEAK_TFLOPS[name] * 1e12
        _warn_once(name, f"no peak FLOP/s known for {name!r}: MFU is not reported; set train.peak_tflops "
                         "to its dense bf16 peak in TFLOP/s")
        return None
    return _cpu_peak_flops()


def model_flops_utilization(flops_per_s: float, peak_flops: float | None, devices: int) -> float | None:
    """MFU, None without a known peak. Never above 1: a measured CPU peak can read low on a
    busy machine (processes sharing its cores, as the netlab's nodes do), and a value above
    100 % would be a wrong one: with this process's measured peak it is unknown (None, "n/a",
    one warning), with a given one clamped to 1 (one warning)."""
    if not peak_flops:
        return None
    mfu = flops_per_s / (peak_flops * devices)
    if mfu > 1.0 and _CPU_PEAK is not None and peak_flops == _CPU_PEAK:
        _warn_once("mfu>1", f"MFU measured {100 * mfu:.0f}% > 100% against this CPU's measured peak "
                            f"({peak_flops / 1e12:.3g} TFLOP/s, probed while other processes shared its cores): "
                            "reported as n/a; set train.peak_tflops")
        return None
    if mfu > 1.0:
        _warn_once("mfu>1", f"MFU measured {100 * mfu:.0f}% > 100%: the device peak "
                            f"({peak_flops / 1e12:.3g} TFLOP/s) is too low (a busy CPU during the peak probe?); "
                            "reported as 100%; set train.peak_tflops")
        return 1.0
    return mfu


_CPU_PEAK: float | None = None


def _cpu_peak_flops(rounds: int = 8, round_s: float = 0.1) -> float:
    """The best rate over ``rounds`` timed rounds: a round slowed by other processes reads
    low, never high, so the maximum is the nearest to the true peak."""
    global _CPU_PEAK
    if _CPU_PEAK is None:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = 0.0
        for _ in range(rounds):
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < round_s:
                a @ b
                reps += 1
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
        _CPU_PEAK = best
    return _CPU_PEAK


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: the caching allocator's peak; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def process_base_bytes(device: torch.device) -> int:
    """What the process holds before the model is built (the interpreter, torch, the process
    groups, the data): on CPU the resident set now, the part of ``peak_mem_bytes`` the
    planner does not model (``meshfold plan --check`` subtracts it); on a GPU 0, as
    ``peak_mem_bytes`` counts the allocator's tensors only."""
    if device.type == "cuda":
        return 0
    try:
        with open("/proc/self/statm") as f:  # Linux: pages
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


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
                f"mfu {_percent(record.get('mfu'))}  mem {record['peak_mem_bytes'] / 2**20:,.0f} MiB")
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
