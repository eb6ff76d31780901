"""FP8, Muon, windowed attention and torchtitan on one GPU (#45): measured beside what meshfold predicts.

    python benchmarks/gpu_features.py --data PREPARED_DIR [--out DIR] [--budget-s 420] [--tiny]
        [--parts wide-bf16 wide-tensorwise ...]

One process, one GPU, llama3-8b's widths (4 of its 32 layers, seq 8192, global batch 4,
micro-batch 1: 32,768 tokens a step), packed documents with per-document attention unless
a part says otherwise:
- ``wide-{bf16,tensorwise,rowwise}``: ``train.fp8`` eager; ``...-compiled``: with
  ``train.compile``; tokens/s, MFU (against the bf16 dense peak, as torchtitan and Megatron
  report fp8 runs), peak memory, host syncs per step (torch's sync debug mode) and the top
  kernels (fp8 GEMMs show as ``*f8*``/``*e4m3*`` kernels);
- ``wide-muon``: ``train.optimizer = "muon"`` against the AdamW step (one GPU: Newton-Schulz
  alone, no exchange);
- ``titan-{bf16,tensorwise}``: torchtitan's own Llama 3 (its 8B config cut to 4 layers, its
  default flex attention with the packed-document mask, each block compiled with
  ``fullgraph=True`` as torchtitan's ``apply_compile`` does, bf16 autocast, fused AdamW,
  clipping), on meshfold's batches, fp8 by torchao's ``convert_to_float8_training`` with the
  output layer in bf16 as torchtitan's converter does;
- ``window``: the Gemma 3 family's local layers (its own window, 512 of 8,192) against the same
  model with every layer global: tokens/s, attention kernels;
- ``family-*``: presets of newer families at 2-4 layers, when the package exists.
Each part runs under the budget in its own try/except (``gpu_step.part``). Results:
``OUT/gpu_features.json``. ``--tiny``: tiny shapes, any device, to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

import gpu_step  # noqa: E402
from gpu_step import RESULTS, SyncCounter, elapsed, part, sync, timed  # noqa: E402
from meshfold.models.counts import flops_per_token  # noqa: E402
from meshfold.models.presets import PRESETS  # noqa: E402
from meshfold.train.trainer import Trainer  # noqa: E402

WIDE = {"preset": "llama3-8b", "seq": 8192, "global_batch": 4, "micro_batch": 1}
TINY_VOCAB = 40960  # --tiny: above the prepared data's largest token id
FP8_KERNEL_WORDS = ("f8", "e4m3", "e5m2", "scaled_mm", "fp8")


def wide_args(args, **over) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **({} if args.tiny else WIDE), **over})


def fp8_kernels(kernels: dict) -> dict:
    """The profiled step's kernels whose names say fp8, with their share of GPU time."""
    rows = [r for r in kernels.get("top", []) if any(w in r[3].lower() for w in FP8_KERNEL_WORDS)]
    return {"fp8_kernel_pct": round(sum(r[1] for r in rows), 1), "fp8_kernels": [r[3][:80] for r in rows[:4]]}


def meshfold_run(args, device, layers: int, profile: bool = False, **over) -> dict:
    over = {"model.n_layers": layers, **over} if not args.tiny else {"model.vocab_size": TINY_VOCAB, **over}
    out = gpu_step.train_run(args, device, args.steps, profile_kernels=profile, **over)
    if profile and "kernels" in out:
        out.update(fp8_kernels(out["kernels"]))
    return out


# ----------------------------------------------------------------------------- torchtitan

def import_torchtitan():
    """torchtitan's Llama 3 configs. Its MoE expert-parallel kernels import triton at module
    level; where triton is missing (a CPU check of this script) that one module is stubbed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        stub = types.ModuleType("torchtitan.distributed.minimal_async_ep")
        stub.__path__ = []
        stub.__getattr__ = lambda n: None
        sys.modules["torchtitan.distributed.minimal_async_ep"] = stub
        for name in ("api", "kernels"):
            mod = types.ModuleType(f"torchtitan.distributed.minimal_async_ep.{name}")
            mod.__getattr__ = lambda n: None
            sys.modules[mod.__name__] = mod
    import torchtitan
    from torchtitan.models.llama3 import llama3_configs
    return torchtitan, llama3_configs


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Per-document positions (0 at each document's first token), as torchtitan's loaders give."""
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, -1)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def titan_run(args, device, fp8: str = "none", attn_backend: str = "flex") -> dict:
    torchtitan, llama3_configs = import_torchtitan()
    a = wide_args(args)
    cfg = gpu_step.config(a, **({"model.n_layers": 4} if not args.tiny else {"model.vocab_size": TINY_VOCAB}))
    trainer = Trainer(cfg)  # meshfold's data pipeline: the same packed batches
    batches = [trainer.local_batch() for _ in range(2)]
    del trainer
    mcfg = llama3_configs["debugmodel" if args.tiny else "8B"](attn_backend=attn_backend)
    mcfg.layers = mcfg.layers[:4]
    if args.tiny:
        mcfg.vocab_size = cfg.model.vocab_size
        mcfg.tok_embeddings.num_embeddings = cfg.model.vocab_size
        mcfg.lm_head.out_features = cfg.model.vocab_size
    with torch.device("meta"):
        model = mcfg.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    n_params = sum(p.numel() for p in model.parameters())
    if fp8 != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(fp8),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    if device.type == "cuda":  # torchtitan's apply_compile: each block, whole graph
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, torch.compile(block, fullgraph=True))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step(i=[0]):
        b = batches[i[0] % len(batches)]
        i[0] += 1
        n = (b["labels"] != -100).sum().to(device)
        mb = cfg.train.micro_batch
        for lo in range(0, b["inputs"].shape[0], mb):
            x, y = b["inputs"][lo:lo + mb].to(device), b["labels"][lo:lo + mb].to(device)
            pos = positions_from_doc_ids(b["doc_ids"][lo:lo + mb].to(device))
            masks = model.get_attention_masks(pos)
            with torch.autocast(device.type, dtype=dt, enabled=device.type == "cuda"):
                logits = model(x, pos, masks)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100,
                                   reduction="sum") / n
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if device.type == "cpu":  # FlexAttention has no CPU backward: check the build and forward only
        b = batches[0]
        pos = positions_from_doc_ids(b["doc_ids"][:1])
        with torch.no_grad():
            logits = model(b["inputs"][:1], pos, model.get_attention_masks(pos))
        return {"forward_only_on_cpu": list(logits.shape), "params": n_params}
    losses = [float(step()) for _ in range(2)]
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, device, args.steps)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    out = {"torchtitan": getattr(torchtitan, "__version__", "?"), "attention": attn_backend, "fp8": fp8,
           "params": n_params, "step_s": round(statistics.median(times), 4),
           "tokens_per_s": round(tokens / statistics.median(times), 1), "losses": [round(x, 4) for x in losses]}
    if device.type == "cuda":
        out["mfu_pct"] = round(100 * flops_per_token(cfg.model, cfg.model.seq_len) * out["tokens_per_s"] / 989e12, 2)
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    with SyncCounter() as sc:
        step()
        sync(device)
    out["host_syncs_per_step"] = sum(sc.counts.values())
    del model, opt
    return out


# ----------------------------------------------------------------------------- windows, families

def window_run(args, device, window: int) -> dict:
    """The Gemma 3 family at 6 layers (5 local, 1 global), seq 8192: ``window`` 0 makes every
    layer global. Plain rows (no packed documents), so the window alone differs."""
    shape = {} if args.tiny else {"model.n_layers": 6, "model.seq_len": 8192}
    a = argparse.Namespace(**{**vars(args), "preset": "gemma-3-1b", "seq": 8192, "global_batch": 4,
                              "micro_batch": 1})
    over = {**shape, "model.sliding_window": window, "data.doc_mask": False}
    if args.tiny:
        over.update({"model.n_layers": 2, "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
                     "model.attn_head_dim": 16, "model.ffn_dim": 128, "model.seq_len": 256,
                     "model.sliding_window": min(window, 64), "model.vocab_size": TINY_VOCAB})
        a.tiny = False  # take the preset, with the tiny shape above
        a.seq, a.global_batch, a.micro_batch = 256, 4, 2
    out = gpu_step.train_run(a, device, args.steps, profile_kernels=True, **over)
    out["attention_kernels"] = out.get("kernels", {}).get("attention_kernels")
    return out


def family_run(args, device, preset_name: str, layers: int, **over) -> dict:
    """A newer family's preset cut to ``layers`` layers at seq 8192 (plain rows): ``over`` turns
    its windows or chunks off for the full-attention twin. ``--tiny``: the preset's layer
    pattern at tiny widths."""
    a = argparse.Namespace(**{**vars(args), "preset": preset_name, "seq": 8192, "global_batch": 4,
                              "micro_batch": 1, "tiny": False})
    shape = {"model.n_layers": layers, "data.doc_mask": False, **over}
    if args.tiny:
        a.seq, a.global_batch, a.micro_batch = 256, 4, 2
        shape.update({"model.vocab_size": TINY_VOCAB, "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
                      "model.attn_head_dim": 16, "model.moe_ffn_dim": 32, "model.ffn_dim": 64,
                      "model.moe_experts": 4, "model.moe_topk": 1})
    if args.tiny and over.get("model.attention_chunk_size"):
        shape["model.attention_chunk_size"] = 64
    out = gpu_step.train_run(a, device, args.steps, profile_kernels=True, **shape)
    out["attention_kernels"] = out.get("kernels", {}).get("attention_kernels")
    return out


# ----------------------------------------------------------------------------- main

PARTS = ["wide-bf16", "wide-tensorwise", "wide-rowwise", "wide-muon", "window-512", "window-full",
         "wide-bf16-compiled", "wide-tensorwise-compiled", "titan-bf16", "titan-tensorwise",
         "wide-rowwise-compiled", "family-gpt-oss", "family-gpt-oss-full", "family-llama4", "family-llama4-full"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a prepared dataset (meshfold prepare)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_features"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: check the script (CPU is fine)")
    ap.add_argument("--parts", nargs="*", default=PARTS)
    args = ap.parse_args()
    args.preset, args.seq, args.global_batch, args.micro_batch = "llama3-8b", 8192, 4, 1
    Path(args.out).mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda"
                      else "cpu", "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        import torchao
        RESULTS["env"]["torchao"] = torchao.__version__
    except ImportError as err:
        RESULTS["env"]["torchao"] = f"missing: {err}"
    print(RESULTS["env"], flush=True)
    budget = args.budget_s
    wide = wide_args(args)
    layers = 4
    runs = {
        "wide-bf16": (25, lambda: meshfold_run(wide, device, layers, profile=True)),
        "wide-tensorwise": (25, lambda: meshfold_run(wide, device, layers, True, **{"train.fp8": "tensorwise"})),
        "wide-rowwise": (25, lambda: meshfold_run(wide, device, layers, True, **{"train.fp8": "rowwise"})),
        "wide-muon": (25, lambda: meshfold_run(wide, device, layers, **{"train.optimizer": "muon"})),
        "window-512": (25, lambda: window_run(args, device, 512)),
        "window-full": (25, lambda: window_run(args, device, 0)),
        "wide-bf16-compiled": (70, lambda: meshfold_run(wide, device, layers, **{"train.compile": True})),
        "wide-tensorwise-compiled": (70, lambda: meshfold_run(wide, device, layers, True, **{
            "train.compile": True, "train.fp8": "tensorwise"})),
        "titan-bf16": (60, lambda: titan_run(args, device)),
        "titan-tensorwise": (60, lambda: titan_run(args, device, fp8="tensorwise")),
        "wide-rowwise-compiled": (70, lambda: meshfold_run(wide, device, layers, **{
            "train.compile": True, "train.fp8": "rowwise"})),
        # gpt-oss-20b, 4 layers: 128-token windows on layers 0 and 2, sinks on all; the twin global
        "family-gpt-oss": (30, lambda: family_run(args, device, "gpt-oss-20b", 4)),
        "family-gpt-oss-full": (30, lambda: family_run(args, device, "gpt-oss-20b", 4,
                                                       **{"model.alternating_window": 0})),
        # llama4-scout, 2 layers (both chunked RoPE layers), 8 of its 16 experts to fit one GPU's
        # memory with fp32 masters, chunks of 2,048 so they matter at seq 8192; the twin unchunked
        "family-llama4": (30, lambda: family_run(args, device, "llama4-scout", 2, **{
            "model.moe_experts": 8, "model.attention_chunk_size": 2048})),
        "family-llama4-full": (30, lambda: family_run(args, device, "llama4-scout", 2, **{
            "model.moe_experts": 8, "model.attention_chunk_size": 0})),
    }
    for name in args.parts:
        if name.startswith("family-") and not any(p.startswith(name.split("-")[1]) for p in PRESETS):
            RESULTS[name] = {"skipped": "no such preset in this tree"}
            continue
        need, fn = runs[name]
        part(name, budget, need)(fn)
        (Path(args.out) / "gpu_features.json").write_text(json.dumps(RESULTS, indent=1, default=str))

    print("\n== summary", RESULTS["env"])
    keys = ("step_s", "tokens_per_s", "mfu_pct", "peak_allocated_gib", "host_syncs_per_step", "fp8_kernel_pct")
    for name, r in RESULTS.items():
        if name == "env":
            continue
        if "error" in r or "skipped" in r:
            print(f"{name}: {(r.get('error') or r.get('skipped'))[:300]}")
        else:
            print(f"{name}: " + ", ".join(f"{k}={r[k]}" for k in keys if k in r)
                  + (f", attention={r['attention_kernels']}" if r.get("attention_kernels") else ""))
    print(f"total {elapsed():.0f} s")


if __name__ == "__main__":
    main()
