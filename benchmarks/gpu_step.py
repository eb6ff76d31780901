"""meshfold on one real GPU: what the fake-CUDA dry-run predicts, measured.

    python benchmarks/gpu_step.py --data PREPARED_DIR [--out DIR] [--budget-s 330] [--tiny]

One process, one GPU (NCCL needs a GPU per rank, so layouts are not measured here):
- **attention over packed documents** (the 1B shape's heads, 2 x 4096 tokens, documents of
  the prepared data's lengths): plain causal SDPA over whole rows (no document masking: the
  floor), meshfold's flash varlen path, its tile path, a dense [S, S]-mask SDPA, and
  FlexAttention's document mask; forward + backward time and the error against an fp32
  reference;
- **the training step** (``Trainer.train_step``, defaults: ``train.dtype = auto``, packed
  documents with ``data.doc_mask``): tokens/s, MFU, peak memory, the host syncs torch's sync
  debug mode sees (with the meshfold line that caused each), the attention kernels the
  profiler sees and the top kernels by GPU time; variants: the tile path, plain causal rows,
  ``train.compile``;
- **Hugging Face transformers' Llama** of the same shape, batch and dtype (bf16 autocast, fp32
  weights, fused AdamW): the plain-causal ratio;
- **MoE on the GPU** (grouped GEMMs in bf16 on the real kernel): the first step's loss
  against the same step in float64 on the CPU, and the step's host syncs.
Each part runs under a time budget and its own try/except: a failure is recorded, not fatal.
Results: ``OUT/gpu_step.json``; a summary table last. ``--tiny`` runs the same code with tiny
shapes (on the CPU too), to check the script before a device run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from meshfold.config import Config, validate  # noqa: E402
from meshfold.models import attention_ops  # noqa: E402
from meshfold.models.counts import flops_per_token, param_count  # noqa: E402
from meshfold.models.presets import preset  # noqa: E402
from meshfold.train.trainer import Trainer  # noqa: E402

T0 = time.time()
RESULTS: dict = {}


def elapsed() -> float:
    return time.time() - T0


def part(name: str, budget_s: float, need_s: float):
    """Run ``fn`` as part ``name`` if ``need_s`` seconds are left of the budget."""
    def wrap(fn):
        if elapsed() + need_s > budget_s:
            RESULTS[name] = {"skipped": f"budget: {elapsed():.0f} s used of {budget_s:.0f}"}
            print(f"== {name}: skipped (budget)", flush=True)
            return fn
        print(f"== {name} (t={elapsed():.0f} s)", flush=True)
        try:
            RESULTS[name] = fn()
        except Exception as err:  # noqa: BLE001 - a failure is a finding; the other parts still run
            RESULTS[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            print(RESULTS[name]["traceback"], flush=True)
        finally:
            gc.collect()  # the part's trainer and model: the next part's peak memory is its own
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(json.dumps(RESULTS[name], default=str)[:1500], flush=True)
        return fn
    return wrap


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


# ----------------------------------------------------------------------------- host syncs

class SyncCounter:
    """torch.cuda's sync debug mode ("warn") during a block: each synchronizing call, counted
    at the innermost meshfold frame (else the innermost frame outside torch)."""

    def __init__(self):
        self.counts = Counter()

    def __enter__(self):
        self._old_show = warnings.showwarning
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message) or "set_sync_debug_mode" in (line or ""):
            return
        frames = traceback.extract_stack()[:-2]
        place = next((f for f in reversed(frames) if "/meshfold/" in f.filename), None) or \
            next((f for f in reversed(frames) if "/torch/" not in f.filename and "warnings" not in f.filename), None)
        if place is not None and "set_sync_debug_mode" in (place.line or ""):
            return  # the counter's own switch-on, not the step's
        where = f"{place.filename.split('/meshfold/')[-1] if place else '?'}:{place.lineno if place else 0}"
        self.counts[f"{where} ({place.line.strip()[:60] if place and place.line else ''})"] += 1

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._old_show
        self._filters.__exit__(*exc)


# ----------------------------------------------------------------------------- attention

def doc_ids_from_lengths(lengths: list[int], b: int, s: int, device) -> torch.Tensor:
    ids = torch.empty(b, s, dtype=torch.long)
    it, doc = iter(lengths * 1000), 0
    for r in range(b):
        pos = 0
        while pos < s:
            n = min(next(it), s - pos)
            ids[r, pos:pos + n] = doc
            doc, pos = doc + 1, pos + n
    return ids.to(device)


def attention_bench(device, tiny: bool, doc_lengths: list[int]) -> dict:
    b, s, H, Hkv, d = (2, 256, 4, 2, 32) if tiny else (2, 4096, 32, 8, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device, dtype) for h in (H, Hkv, Hkv))
    dout = torch.randn(b, s, H, d, generator=g).to(device, dtype)
    doc_ids = doc_ids_from_lengths(doc_lengths, b, s, device)
    runs = int((doc_ids[:, 1:] != doc_ids[:, :-1]).sum()) + b
    pos = torch.arange(s, device=device).expand(b, -1)
    mask = ((doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)) & (pos.unsqueeze(-1) >= pos.unsqueeze(-2))).unsqueeze(1)

    def ref():
        qf, kf, vf = (t.float().transpose(1, 2).requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qf, kf.repeat_interleave(H // Hkv, 1), vf.repeat_interleave(H // Hkv, 1),
                                           attn_mask=mask)
        o.backward(dout.float().transpose(1, 2))
        return o.transpose(1, 2), qf.grad.transpose(1, 2)

    o_ref, dq_ref = ref()

    def variants():
        def causal(qq, kk, vv):
            return F.scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True).transpose(1, 2)

        def docs(flash):
            def f(qq, kk, vv):
                attention_ops.FLASH_VARLEN = flash
                try:
                    return attention_ops.document_attention(qq, kk, vv, None, doc_ids)
                finally:
                    attention_ops.FLASH_VARLEN = True
            return f

        def dense(qq, kk, vv):
            return F.scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                                  attn_mask=mask, enable_gqa=True).transpose(1, 2)

        out = {"causal rows (no doc mask)": causal, "meshfold flash varlen": docs(True),
               "meshfold tiles": docs(False), "dense S x S mask": dense}
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            docs_flat = doc_ids

            def doc_mask(bb, hh, qi, ki):
                return (docs_flat[bb, qi] == docs_flat[bb, ki]) & (qi >= ki)

            block = create_block_mask(doc_mask, b, None, s, s, device=device.type)
            flex = torch.compile(flex_attention)

            def flexf(qq, kk, vv):
                return flex(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), block_mask=block,
                            enable_gqa=True).transpose(1, 2)
            out["flex attention (compiled)"] = flexf
        except Exception as err:  # noqa: BLE001
            print(f"flex attention unavailable: {err}")
        return out

    res = {"shape": f"b{b} s{s} H{H} Hkv{Hkv} d{d} {dtype}", "documents": runs,
           "mean_doc_tokens": round(b * s / runs, 1)}
    for name, fn in variants().items():
        try:
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            o = fn(qq, kk, vv)
            o.backward(dout)
            err_o = ((o.float() - o_ref).norm() / o_ref.norm()).item()
            err_dq = ((qq.grad.float() - dq_ref).norm() / dq_ref.norm()).item()

            def step():
                o2 = fn(qq, kk, vv)
                o2.backward(dout)
            step()
            times = timed(step, device, 5 if tiny else 20)
            with SyncCounter() as sc:
                step()
                sync(device)
            res[name] = {"ms": round(statistics.median(times) * 1e3, 3), "rel_err_out": err_o,
                         "rel_err_dq": err_dq, "syncs": sum(sc.counts.values())}
        except Exception as err:  # noqa: BLE001
            res[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        print(f"  {name}: {res[name]}", flush=True)
    return res


# ----------------------------------------------------------------------------- training

def config(args, **over) -> Config:
    cfg = Config(model=preset("debug" if args.tiny else args.preset,
                              **({} if args.tiny else {"seq_len": args.seq})))
    cfg.data.source = args.data
    if args.tiny:
        cfg.model.vocab_size = 32000
    cfg.train.global_batch = 4 if args.tiny else args.global_batch
    cfg.train.micro_batch = 2 if args.tiny else args.micro_batch
    cfg.train.steps = 10**6
    cfg.train.progress = False
    cfg.train.tensorboard = False
    cfg.train.run_dir = str(Path(args.out) / "run")
    cfg.train.resume = "never"
    for key, value in over.items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    validate(cfg, 1)
    return cfg


def kernel_table(trainer, device, top: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        trainer.train_step()
        sync(device)
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if device.type == "cuda" and t > 0 and ev.device_type.name == "CUDA":
            rows.append((t, ev.key, ev.count))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) or 1
    attn = Counter()
    for t, key, count in rows:
        low = key.lower()
        if any(w in low for w in ("flash", "fmha", "attention", "cudnn_sdpa", "sdpa")):
            attn[key[:90]] += count
    return {"gpu_ms_total": round(total / 1e3, 2),
            "top": [[round(t / 1e3, 2), round(100 * t / total, 1), c, k[:100]] for t, k, c in rows[:top]],
            "attention_kernels": dict(attn)}


def train_run(args, device, steps: int, profile_kernels: bool = False, **over) -> dict:
    cfg = config(args, **over)
    trainer = Trainer(cfg)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    losses = [trainer.train_step() for _ in range(2)]  # warm-up (compilation too)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed(lambda: losses.append(trainer.train_step()), device, steps)
    out = {"params": param_count(cfg.model), "tokens_per_step": tokens, "step_s": round(statistics.median(times), 4),
           "tokens_per_s": round(tokens / statistics.median(times), 1), "losses": [round(x, 4) for x in losses]}
    fpt = flops_per_token(cfg.model, cfg.model.seq_len)
    peak = 989e12 if device.type == "cuda" else None
    if peak:
        out["mfu_pct"] = round(100 * fpt * out["tokens_per_s"] / peak, 2)
        out["mfu_causal_pct"] = round(100 * flops_per_token(cfg.model, cfg.model.seq_len, causal=True)
                                      * out["tokens_per_s"] / peak, 2)
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    with SyncCounter() as sc:
        trainer.train_step()
        sync(device)
    out["host_syncs_per_step"] = sum(sc.counts.values())
    out["host_syncs"] = dict(sc.counts.most_common())
    if profile_kernels:
        out["kernels"] = kernel_table(trainer, device)
    del trainer
    return out


def hf_run(args, device, steps: int, compile_model: bool = False) -> dict:
    from throughput_vs_hf import hf_model
    cfg = config(args, **{"data.doc_mask": False})
    trainer = Trainer(cfg)  # its data pipeline: the same batches as meshfold's causal run
    batches = [trainer.local_batch() for _ in range(2)]
    del trainer
    torch.manual_seed(0)
    model = hf_model(cfg.model).to(device)
    forward = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    mb = cfg.train.micro_batch
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step(i=[0]):
        b = batches[i[0] % len(batches)]
        i[0] += 1
        n = (b["labels"] != -100).sum()
        for lo in range(0, b["inputs"].shape[0], mb):
            x, y = b["inputs"][lo:lo + mb].to(device), b["labels"][lo:lo + mb].to(device)
            with torch.autocast(device.type, dtype=dt, enabled=device.type == "cuda"):
                logits = forward(input_ids=x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum") / n
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    for _ in range(2):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, device, steps)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    out = {"step_s": round(statistics.median(times), 4), "tokens_per_s": round(tokens / statistics.median(times), 1)}
    if device.type == "cuda":
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del model, forward, opt
    return out


def moe_check(args, device, capacity: float = 0.0) -> dict:
    """The first step's loss on the device (bf16, grouped GEMMs) against float64 on the CPU;
    ``capacity``: ``model.moe_capacity_factor`` (the padded, sync-free path)."""
    over = {"model.moe_experts": 8, "model.moe_topk": 2, "model.moe_every": 1,
            "model.moe_ffn_dim": 256 if not args.tiny else 32, "model.vocab_size": 32000,
            "model.moe_capacity_factor": capacity}
    shape = {} if args.tiny else {"model.dim": 512, "model.n_layers": 2, "model.n_heads": 8,
                                  "model.n_kv_heads": 4, "model.ffn_dim": 1024}

    def cfg_for(dev, dtype):
        a = argparse.Namespace(**{**vars(args), "seq": 512, "global_batch": 4, "micro_batch": 2})
        cfg = config(a, **over, **shape, **{"train.device": dev, "train.dtype": dtype})
        cfg.train.run_dir = str(Path(args.out) / f"run-moe-{dev}")
        return cfg

    gpu = Trainer(cfg_for(device.type, "auto"))
    loss_gpu = gpu.train_step()
    with SyncCounter() as sc:
        gpu.train_step()
        sync(device)
    times = timed(gpu.train_step, device, 5)
    del gpu
    threads = torch.get_num_threads()
    cpu = Trainer(cfg_for("cpu", "float64"))
    loss_cpu = cpu.train_step()
    torch.set_num_threads(threads)
    return {"loss_device": loss_gpu, "loss_cpu_fp64": loss_cpu, "rel_diff": abs(loss_gpu - loss_cpu) / abs(loss_cpu),
            "step_s": round(statistics.median(times), 4), "host_syncs_per_step": sum(sc.counts.values()),
            "host_syncs": dict(sc.counts.most_common())}


# ----------------------------------------------------------------------------- main

def document_lengths(folder: str) -> list[int]:
    """The prepared dataset's document lengths in tokens (its shards' offset files)."""
    import numpy as np
    out = []
    for idx in sorted(Path(folder).glob("shard-*.idx")):
        out += np.diff(np.fromfile(idx, dtype="<i8")).tolist()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a prepared dataset (meshfold prepare)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_step"))
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--budget-s", type=float, default=330)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: check the script (CPU is fine)")
    ap.add_argument("--parts", nargs="*", default=["attention", "train", "tiles", "causal", "hf", "moe", "compile", "hf-compile", "wide", "moe-capacity"])
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda"
                      else "cpu", "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    print(RESULTS["env"], flush=True)
    lengths = document_lengths(args.data)
    budget = args.budget_s
    steps = 2 if args.tiny else args.steps

    if "attention" in args.parts:
        part("attention", budget, 20)(lambda: attention_bench(device, args.tiny, lengths))
    if "train" in args.parts:
        part("train: defaults (packed docs, flash varlen)", budget, 40)(
            lambda: train_run(args, device, steps, profile_kernels=True))
    if "tiles" in args.parts:
        def tiles():
            attention_ops.FLASH_VARLEN = False
            try:
                return train_run(args, device, steps)
            finally:
                attention_ops.FLASH_VARLEN = True
        part("train: packed docs, tile path", budget, 40)(tiles)
    if "causal" in args.parts:
        part("train: plain causal rows", budget, 40)(lambda: train_run(args, device, steps, **{"data.doc_mask": False}))
    if "hf" in args.parts:
        part("hf: transformers Llama, plain causal rows", budget, 40)(lambda: hf_run(args, device, steps))
    if "hf-compile" in args.parts:
        part("hf: transformers Llama compiled, plain causal rows", budget, 90)(
            lambda: hf_run(args, device, steps, compile_model=True))
    if "moe" in args.parts:
        part("moe: bf16 device step vs fp64 CPU", budget, 40)(lambda: moe_check(args, device))
    if "wide" in args.parts:  # llama3-8b's widths (4 of its 32 layers), seq 8192: the planner's 8B terms on one GPU
        def wide():
            a = argparse.Namespace(**{**vars(args), "preset": "llama3-8b", "seq": 8192, "global_batch": 4,
                                      "micro_batch": 1})
            return train_run(a, device, steps, **{"model.n_layers": 4})
        part("train: llama3-8b widths, 4 layers, seq 8192", budget, 40)(wide)
    if "moe-capacity" in args.parts:
        part("moe: capacity 1.25, bf16 device step vs fp64 CPU", budget, 40)(lambda: moe_check(args, device, 1.25))
    if "compile" in args.parts:
        part("train: defaults + compile", budget, 120)(
            lambda: train_run(args, device, steps, **{"train.compile": True}))

    (Path(args.out) / "gpu_step.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print("\n== summary", RESULTS["env"])
    for name, r in RESULTS.items():
        if name == "env":
            continue
        if "error" in r or "skipped" in r:
            print(f"{name}: {r.get('error') or r.get('skipped')}")
        elif name == "attention":
            for k, v in r.items():
                print(f"  attn {k}: {v}")
        else:
            keys = ("step_s", "tokens_per_s", "mfu_pct", "peak_allocated_gib", "host_syncs_per_step", "rel_diff")
            print(f"{name}: " + ", ".join(f"{k}={r[k]}" for k in keys if k in r))
    print(f"total {elapsed():.0f} s")


if __name__ == "__main__":
    main()
