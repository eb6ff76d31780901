"""The kernel classes the planner prices, measured on the GPU at hand against the device
model's prices (issue 44): what a session with a GPU runs to replace an assumed constant
with a measured one (docs/planner.md, "Device specs" and the Korthikanti section's list of
what is left).

1. GEMMs by shape: the torchtitan 8B and Megatron 22B/175B per-GPU shapes and a sweep of the
   inner dimension k at m = 8192, n = 6144 — measured TFLOP/s against ``kernels.gemm_time``
   (MAMF, tile and wave quantization, the roofline, the A100's epilogue term).
2. Memory-bound kernels: a copy, softmax and dropout over attention scores, LayerNorm, tanh-
   GELU and an add, forward and backward, each with the bytes it must move: the fraction of
   the datasheet bandwidth each reaches, against ``hbm_eff`` and ``eager_hbm_eff``.
3. Fused attention (SDPA, flash and cuDNN backends), forward and backward: the fraction of
   peak against ``attention_eff`` / ``attention_bwd_eff`` (backward counted as 2.5x the
   forward's FLOPs, as the planner does).
4. The loss: ``F.cross_entropy`` on fp32 logits and meshfold's chunked ``cross_entropy_sum``
   over a 128,256 vocabulary, forward + backward, against the planner's loss passes.

CUDA events around repeated calls after a warm-up, the median of ``--repeat`` timings.
``--tiny`` runs the same code on small shapes (the CPU is fine) to check the script.

    python benchmarks/planner_kernels.py [--device h100-sxm] [--out results.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from meshfold.parallel.loss import cross_entropy_sum  # noqa: E402
from meshfold.planner.cluster import DEVICES  # noqa: E402
from meshfold.planner.kernels import gemm_time  # noqa: E402

GEMMS = [(16384, 4096, 4096), (16384, 1024, 4096), (16384, 14336, 4096), (16384, 4096, 14336),
         (16384, 128256, 4096), (4096, 4096, 16384), (8192, 2304, 6144), (8192, 3072, 6144),
         (8192, 6144, 3072), (8192, 6144, 768), (2048, 1536, 12288), (12288, 1536, 2048)]
K_SWEEP = [96, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384]


def device_model(name: str):
    """The planner's device for this GPU (``--device``, else by its name)."""
    if name:
        return DEVICES[name]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for key, dev in (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"), ("B200", "b200"),
                     ("MI300X", "mi300x")):
        if key in gpu:
            return DEVICES[dev]
    return DEVICES["h100-sxm"]


def timed(fn, repeat: int, inner: int) -> float:
    """Median seconds of one call of ``fn`` (``inner`` back-to-back calls per timing)."""
    fn()
    cuda = torch.cuda.is_available()
    out = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) * 1e-3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def gemms(d, dev, dtype, shrink: int, repeat: int) -> list[dict]:
    rows = []
    shapes = GEMMS + [(8192, 6144, k) for k in K_SWEEP]
    for m, n, k in shapes:
        m, n, k = max(1, m // shrink), max(1, n // shrink), max(1, k // shrink)
        a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
        t = timed(lambda: a @ b, repeat, 5)
        priced = gemm_time(d, m, n, k, 1)
        rows.append({"m": m, "n": n, "k": k, "measured_s": t, "priced_s": priced, "tflops": 2 * m * n * k / t / 1e12,
                     "priced_over_measured": priced / t})
    return rows


def memory_bound(d, dev, dtype, shrink: int, repeat: int) -> list[dict]:
    """(name, seconds, bytes it moves) -> the fraction of the datasheet bandwidth."""
    a = torch.finfo(dtype).bits // 8
    rows = []

    def row(name, fn, nbytes):
        t = timed(fn, repeat, 5)
        rows.append({"kernel": name, "measured_s": t, "bytes": nbytes, "GBps": nbytes / t / 1e9,
                     "fraction_of_hbm": nbytes / t / (d.hbm_GBps * 1e9)})

    x = torch.randn(1 << (28 - 2 * shrink.bit_length()), device=dev, dtype=dtype)
    y = torch.empty_like(x)
    row("copy", lambda: y.copy_(x), 2 * a * x.numel())
    s = torch.randn(32, 2048 // shrink, 2048 // shrink, device=dev, dtype=dtype, requires_grad=True)
    n = s.numel()
    p = torch.softmax(s, -1)
    g = torch.randn_like(p)
    row("softmax fwd", lambda: torch.softmax(s, -1), 2 * a * n)
    row("softmax bwd", lambda: torch.autograd.grad(p, s, g, retain_graph=True), 3 * a * n)
    dr = F.dropout(s, 0.1)
    row("dropout fwd", lambda: F.dropout(s, 0.1), (2 * a + 1) * n)
    row("dropout bwd", lambda: torch.autograd.grad(dr, s, g, retain_graph=True), (2 * a + 1) * n)
    h = torch.randn(8192 // shrink, 6144 // shrink, device=dev, dtype=dtype, requires_grad=True)
    ln = torch.nn.LayerNorm(h.shape[-1], device=dev, dtype=dtype)
    lo = ln(h)
    gl = torch.randn_like(lo)
    row("layernorm fwd", lambda: ln(h), 2 * a * h.numel())
    row("layernorm bwd", lambda: torch.autograd.grad(lo, h, gl, retain_graph=True), 3 * a * h.numel())
    row("add", lambda: h + gl, 3 * a * h.numel())
    u = torch.randn(8192 // shrink, 12288 // shrink, device=dev, dtype=dtype, requires_grad=True)
    ge = F.gelu(u, approximate="tanh")
    gg = torch.randn_like(ge)
    row("gelu fwd", lambda: F.gelu(u, approximate="tanh"), 2 * a * u.numel())
    row("gelu bwd", lambda: torch.autograd.grad(ge, u, gg, retain_graph=True), 3 * a * u.numel())
    return rows


def attention(d, dev, dtype, shrink: int, repeat: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, heads, s, hd = 2, 32 // shrink, 8192 // shrink, 128
    q, k, v = (torch.randn(b, heads, s, hd, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    flops = 4 * b * heads * s * s * hd * 0.5  # causal forward
    rows = []
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    if dev == "cpu":
        backends = [("math", SDPBackend.MATH)]
    for name, backend in backends:
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                g = torch.randn_like(out)
                fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeat, 2)
                bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), repeat, 2)
        except RuntimeError as err:  # a backend this GPU or build lacks
            rows.append({"backend": name, "error": str(err).splitlines()[0][:120]})
            continue
        peak = d.peak_tflops * 1e12
        rows.append({"backend": name, "fwd_s": fwd, "bwd_s": bwd, "fwd_fraction_of_peak": flops / fwd / peak,
                     "bwd_fraction_of_peak": 2.5 * flops / bwd / peak, "planner_fwd": d.attention_eff,
                     "planner_bwd": d.attention_bwd_eff})
    return rows


def loss(d, dev, dtype, shrink: int, repeat: int) -> list[dict]:
    tokens, vocab = 16384 // shrink, 128256 // shrink
    logits = torch.randn(tokens, vocab, device=dev, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    a = torch.finfo(dtype).bits // 8
    bw = d.hbm_GBps * 1e9 * (d.eager_hbm_eff or d.hbm_eff)
    priced = (2 * a + 16 + 2 * a + 24) * tokens * vocab / bw  # the planner's passes (layer.py), eager

    def torch_ce():
        torch.autograd.grad(F.cross_entropy(logits.float(), labels, reduction="sum"), logits)

    def meshfold_ce():
        torch.autograd.grad(cross_entropy_sum(logits, labels), logits)

    return [{"loss": name, "fwd_bwd_s": timed(fn, repeat, 1), "priced_s": priced}
            for name, fn in (("F.cross_entropy(fp32)", torch_ce), ("meshfold cross_entropy_sum", meshfold_ce))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="", help="planner device to compare with (default: by the GPU's name)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="small shapes: check the script (CPU is fine)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    d = device_model(args.device)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shrink = 16 if args.tiny else 1
    repeat = 2 if args.tiny else args.repeat
    res = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "planner_device": d.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for part, fn in (("gemms", gemms), ("memory_bound", memory_bound), ("attention", attention), ("loss", loss)):
        res[part] = fn(d, dev, torch.float16 if part == "memory_bound" and dev == "cuda" else dtype, shrink, repeat)
        print(json.dumps({part: res[part]}, indent=None), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
