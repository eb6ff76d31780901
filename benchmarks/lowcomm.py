"""Low-communication training next to DDP, measured in the same run.

    # 1. quality and bytes: 4 workers x 1 rank vs DDP over 4 ranks, equal tokens, >= 3 seeds
    python benchmarks/lowcomm.py convergence --seeds 3            # 1500 steps, tuned settings
    #    in pieces of < 10 minutes: one seed (or method) per command, then merge
    python benchmarks/lowcomm.py convergence --seed-list 0 --methods ddp diloco --out a.json
    python benchmarks/lowcomm.py merge a.json b.json ...
    #    sweeps: --h, --outer-lr, --outer-momentum, --lr (workers), --ddp-lr, --set METHOD.KEY=VALUE
    # 2. wall-clock over throttled links: one namespace per worker (meshfold netlab, root)
    python benchmarks/lowcomm.py netlab --rate-mbit 10 --steps 100 --methods ddp --out ddp.json
    python benchmarks/lowcomm.py netlab --rate-mbit 10 --steps 100 --methods diloco --out diloco.json
    python benchmarks/lowcomm.py merge ddp.json diloco.json --out benchmarks/results/lowcomm_netlab.json
    # 3. plots (loss vs wall-clock, loss vs bytes) from the JSON the two write
    python benchmarks/lowcomm.py plot

Every method processes the same tokens per step: DDP's global batch is 4 x the per-worker
batch (the lowcomm convention: ``train.global_batch`` is per worker). Bytes are what global
rank 0 sent (comm ledger, ring convention), divided by the tokens of all workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
WORKERS = 4
PER_WORKER_BATCH = 8

MODEL = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "seq_len": 64}

# Tuned on seed 0 (docs/benchmarks.md lists the sweep): 1500 steps = 150 outer steps.
# Outer lr 0.8 / momentum 0.5: with H = 10 the DiLoCo defaults 0.7 / 0.9 overshoot (their
# steady-state step is lr/(1-mu) = 7x the averaged progress; 1.6x is best here).
STEPS = 1500
INNER_LR = 3e-3  # AdamW lr of every worker (swept 2e-3 / 3e-3 / 6e-3)
DDP_LR = 1.2e-2  # DDP's AdamW lr, best of 3e-3 / 6e-3 / 1.2e-2 / 2e-2
OUTER = {"inner_steps": 10, "outer_lr": 0.8, "outer_momentum": 0.5}
METHODS = {
    "ddp": {},
    "diloco": {"method": "diloco", **OUTER},
    "streaming": {"method": "streaming", **OUTER, "fragments": 4, "overlap_steps": 1, "quant_bits": 4,
                  "quant_coding": "deflate", "mixing": 0.25},
    "noloco": {"method": "noloco", **OUTER, "noloco_gamma": 1.0},
    # CO2 applies each round one round late: H = 5 halves that staleness.
    "co2": {"method": "co2", **OUTER, "inner_steps": 5, "co2_staleness_penalty": 0.25, "co2_clip": 5.0},
}


def config(method: str, seed: int, steps: int, run_dir: str, overrides: dict | None = None) -> dict:
    """The run's config dict. ``overrides`` (from ``settings``) maps "section.key" -> value
    for this method; "lowcomm.*" keys are ignored for DDP."""
    lc = dict(METHODS[method])
    if method == "ddp":
        parallel = {"dp_replicate": WORKERS, "dp_shard": 1}
        batch = WORKERS * PER_WORKER_BATCH
    else:
        parallel = {"dp_replicate": 1, "dp_shard": 1}
        batch = PER_WORKER_BATCH
        lc["workers"] = WORKERS
    cfg = {"model": dict(MODEL), "parallel": parallel,
           "train": {"steps": steps, "seed": seed, "global_batch": batch, "lr": DDP_LR if method == "ddp" else INNER_LR,
                     "run_dir": run_dir,
                     "progress": False, "tensorboard": False, "eval_batches": 8, "warmup_steps": steps // 10,
                     "straggler_every": 0},
           "data": {"val_docs": 32}, "lowcomm": lc}
    for key, value in (overrides or {}).items():
        section, name = key.split(".", 1)
        if method == "ddp" and section == "lowcomm":
            continue
        cfg.setdefault(section, {})[name] = value
    return cfg


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def settings(args, method: str) -> dict:
    """Per-method overrides from the command line: --lr / --ddp-lr / --h / --outer-lr /
    --outer-momentum, then --set METHOD.KEY=VALUE (KEY is a [lowcomm] key, or SECTION.KEY)."""
    out = {}
    if method == "ddp":
        if getattr(args, "ddp_lr", None) is not None:
            out["train.lr"] = args.ddp_lr
    else:
        if getattr(args, "lr", None) is not None:
            out["train.lr"] = args.lr
        for flag, key in (("h", "inner_steps"), ("outer_lr", "outer_lr"), ("outer_momentum", "outer_momentum")):
            if getattr(args, flag, None) is not None:
                out[f"lowcomm.{key}"] = getattr(args, flag)
    for item in getattr(args, "set", None) or []:
        target, value = item.split("=", 1)
        m, key = target.split(".", 1)
        if m == method:
            out[key if "." in key else f"lowcomm.{key}"] = _value(value)
    return out


# --------------------------------------------------------------------------- convergence


def _train(cfg: dict) -> dict | None:
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg))
    per_step, clipped = [], []
    orig = tr.step_record

    def record(loss, elapsed, tokens):  # keep every step's ledger entry
        rec = orig(loss, elapsed, tokens)
        per_step.append(sum(rec["comm_bytes"].values()))
        if "outer_clipped" in rec:  # co2: did the momentum clipping act at this outer step?
            clipped.append(bool(rec["outer_clipped"]))
        return rec

    tr.step_record = record
    losses = tr.fit()
    if dist.get_rank() != 0:
        return None
    val = full_validation(tr)  # worker 0's model; it issues no collective
    out = {"losses": losses, "val_loss": val, "bytes_per_step": per_step, "bytes": sum(per_step)}
    if clipped:
        out["outer_steps_clipped"] = [sum(clipped), len(clipped)]
    return out


def full_validation(tr) -> float:
    """Mean loss per token over EVERY held-out sequence (4296 of 64 tokens with the default
    corpus and data.val_docs = 32), on this rank's model, without collectives. DDP and the workers
    thus see exactly the same validation set (Trainer.evaluate samples per data-parallel
    layout, so its set would differ between DDP's batch of 32 and a worker's batch of 8)."""
    import torch

    from meshfold.data.dataset import IGNORE_INDEX

    val = tr.data.val
    model = getattr(tr.model, "module", tr.model)  # DDP's wrapped module: no collectives in forward
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(val), 32):
            batch = val.batch(range(start, min(start + 32, len(val))))
            doc_ids = batch["doc_ids"] if tr.use_doc_mask else None
            logits = model(batch["inputs"], doc_ids=doc_ids)
            total += float(tr.loss_fn(logits, batch["labels"]).double())
            tokens += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train()
    return total / tokens


def convergence(args) -> dict:
    from meshfold.testing import run_on

    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    out = {"steps": args.steps, "seeds": seeds, "workers": WORKERS, "per_worker_batch": PER_WORKER_BATCH,
           "model": MODEL, "configs": {}, "runs": {}}
    tokens = args.steps * WORKERS * PER_WORKER_BATCH * MODEL["seq_len"]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for method in args.methods:
                t0 = time.perf_counter()
                cfg = config(method, seed, args.steps, f"{tmp}/{method}-{seed}", settings(args, method))
                out["configs"][method] = {k: cfg[k] for k in ("train", "lowcomm")}
                res = run_on(WORKERS, _train, cfg, timeout=1800)[0]
                res["seed"] = seed
                res["bytes_per_token"] = res["bytes"] / tokens
                res["wall_s"] = time.perf_counter() - t0
                out["runs"].setdefault(method, []).append(res)
                print(f"seed {seed} {method:10s} val {res['val_loss']:.4f} bytes/token {res['bytes_per_token']:.1f} "
                      f"({res['wall_s']:.0f} s)", flush=True)
    if "ddp" in out["runs"]:
        summarize(out)
    return out


def merge(args) -> dict:
    """Merge convergence JSONs (e.g. one per method or seed) into one; the model, steps and
    each method's config must agree across files."""
    parts = [json.loads(Path(path).read_text()) for path in args.files]
    if all("rate_mbit" in part for part in parts):
        return merge_netlab(parts, args.files)
    out = None
    for path, part in zip(args.files, parts):
        if out is None:
            out = {k: part[k] for k in ("steps", "workers", "per_worker_batch", "model")}
            out.update(configs={}, runs={})
        for k in ("steps", "workers", "per_worker_batch", "model"):
            if part[k] != out[k]:
                raise SystemExit(f"{path}: {k} differs ({part[k]} vs {out[k]})")
        for method, cfg in part["configs"].items():
            known = out["configs"].setdefault(method, cfg)
            norm = lambda c: {s: {k: v for k, v in c[s].items() if k not in ("seed", "run_dir")} for s in c}
            if norm(known) != norm(cfg):
                raise SystemExit(f"{path}: config of {method} differs from an earlier file")
        for method, rs in part["runs"].items():
            out["runs"].setdefault(method, []).extend(rs)
    for method, rs in out["runs"].items():
        rs.sort(key=lambda r: r["seed"])
        seeds = [r["seed"] for r in rs]
        if len(set(seeds)) != len(seeds):
            raise SystemExit(f"{method}: seed measured twice ({seeds}); merge each seed once")
    out["seeds"] = sorted({r["seed"] for rs in out["runs"].values() for r in rs})
    summarize(out)
    return out


def summarize(out: dict) -> None:
    runs = out["runs"]
    ddp_val = statistics.mean(r["val_loss"] for r in runs["ddp"])
    ddp_bpt = statistics.mean(r["bytes_per_token"] for r in runs["ddp"])
    ddp_peak = max(max(r["bytes_per_step"]) for r in runs["ddp"])
    print(f"\n{'method':10s} {'val loss (mean ± sd)':>22s} {'vs DDP':>8s} {'bytes/token':>12s} {'DDP/method':>11s} "
          f"{'peak B/step':>12s}")
    table = {}
    for method, rs in runs.items():
        vals = [r["val_loss"] for r in rs]
        mean, sd = statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0
        bpt = statistics.mean(r["bytes_per_token"] for r in rs)
        peak = max(max(r["bytes_per_step"]) for r in rs)
        table[method] = {"val_mean": mean, "val_sd": sd, "val_vs_ddp": mean / ddp_val - 1, "bytes_per_token": bpt,
                         "bytes_reduction": ddp_bpt / bpt if bpt else float("inf"), "peak_bytes_per_step": peak,
                         "peak_reduction": ddp_peak / peak if peak else float("inf")}
        t = table[method]
        print(f"{method:10s} {mean:14.4f} ± {sd:.4f} {100 * t['val_vs_ddp']:+7.2f}% {bpt:12.1f} "
              f"{t['bytes_reduction']:10.1f}x {peak:12.0f}")
    out["summary"] = table


def merge_netlab(parts: list[dict], files: list[str]) -> dict:
    """Netlab JSONs of one method each (one command per method, each under 10 minutes)."""
    out = {k: v for k, v in parts[0].items() if k not in ("runs", "configs", "summary")}
    out.update(configs={}, runs={})
    for path, part in zip(files, parts):
        for k in ("rate_mbit", "seed", "model", "steps", "method_steps_factor"):
            if part.get(k) != out.get(k):
                raise SystemExit(f"{path}: {k} differs ({part.get(k)} vs {out.get(k)})")
        for method, r in part["runs"].items():
            if method in out["runs"]:
                raise SystemExit(f"{path}: {method} measured twice")
            out["runs"][method] = r
            out["configs"][method] = part.get("configs", {}).get(method)
    time_to_target(out)
    return out


# --------------------------------------------------------------------------- netlab


def _toml(cfg: dict) -> str:
    import tomli_w

    return tomli_w.dumps(cfg)


def netlab(args) -> dict:
    out = {"rate_mbit": args.rate_mbit, "steps": args.steps, "method_steps_factor": args.method_steps_factor,
           "seed": args.seed, "model": MODEL, "configs": {}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            # Methods may run longer than DDP (their own schedule) to reach DDP's final loss.
            steps = args.steps if method == "ddp" else int(args.steps * args.method_steps_factor)
            cfg = config(method, args.seed, steps, f"{tmp}/{method}", settings(args, method))
            out["configs"][method] = {k: cfg[k] for k in ("train", "lowcomm")}
            path = Path(tmp) / f"{method}.toml"
            path.write_text(_toml(cfg))
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "meshfold", "netlab", "train", str(path), "--nodes",
                                   str(WORKERS), "--rate-mbit", str(args.rate_mbit), "--timeout", "1500"],
                                  cwd=ROOT, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"netlab run of {method} failed")
            recs = [json.loads(line) for line in (Path(tmp) / method / "metrics.jsonl").read_text().splitlines()]
            elapsed, total, cum_bytes = 0.0, [], []
            sent = 0
            for r in recs:
                elapsed += r["step_time_s"]
                total.append(elapsed)
                sent += sum(r.get("comm_bytes", {}).values())
                cum_bytes.append(sent)
            out["runs"][method] = {"losses": [r["loss"] for r in recs], "time_s": total, "bytes": cum_bytes,
                                   "command_wall_s": wall}
            print(f"{method:10s} {elapsed:7.1f} s of steps ({wall:.0f} s with start-up), final loss "
                  f"{recs[-1]['loss']:.4f}", flush=True)
    if "ddp" in out["runs"]:
        time_to_target(out)
    return out


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def time_to_target(out: dict) -> None:
    """Seconds of training (sum of step times) until the k-step moving average of the
    training loss first reaches DDP's final moving average (k = out["smooth"], 20 by
    default: the methods' logged loss is worker 0's batch of 8 sequences, noisier than
    DDP's 32, and a short window would let noise hit the target early)."""
    runs = out["runs"]
    k = out.setdefault("smooth", 20)
    target = _smooth(runs["ddp"]["losses"], k)[-1]
    # DDP's own time to target: the first step its moving average reaches its final value.
    ddp_sm = _smooth(runs["ddp"]["losses"], k)
    ddp_time = runs["ddp"]["time_s"][next(i for i, v in enumerate(ddp_sm) if v <= target)]
    print(f"\ntarget loss (DDP's final {k}-step mean) {target:.4f}, DDP reaches it after {ddp_time:.1f} s")
    summary = {}
    for method, r in runs.items():
        sm = _smooth(r["losses"], k)
        hit = next((i for i, v in enumerate(sm) if v <= target), None)
        t = r["time_s"][hit] if hit is not None else None
        summary[method] = {"time_to_target_s": t, "speedup_vs_ddp": (ddp_time / t) if t else None,
                           "final_smoothed_loss": sm[-1], "total_time_s": r["time_s"][-1]}
        speed = f"{ddp_time / t:5.2f}x" if t else "not reached"
        print(f"{method:10s} time to target {t if t is not None else float('nan'):7.1f} s  {speed}  "
              f"(final {sm[-1]:.4f}, total {r['time_s'][-1]:.1f} s)")
    out["summary"] = summary


# --------------------------------------------------------------------------- plots


def plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img = ROOT / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    conv = RESULTS / "lowcomm_convergence.json"
    if conv.exists():
        data = json.loads(conv.read_text())
        fig, ax = plt.subplots(figsize=(6, 4))
        for method, rs in data["runs"].items():
            r = rs[0]
            cum, s = [], 0
            for b in r["bytes_per_step"]:
                s += b
                cum.append(s / 1e6)
            ax.plot(cum, _smooth(r["losses"], 20), label=method)
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlabel("MB sent by rank 0 (cumulative)")
        ax.set_ylabel("training loss (20-step mean)")
        ax.set_title(f"loss vs bytes (seed {data['runs']['ddp'][0].get('seed', 0)}, {data['steps']} steps)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(img / "lowcomm_loss_vs_bytes.png", dpi=120)
        print(img / "lowcomm_loss_vs_bytes.png")
    for lab in sorted(RESULTS.glob("lowcomm_netlab*.json")):
        data = json.loads(lab.read_text())
        if "ddp" not in data["runs"]:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        k = data.get("smooth", 20)
        for method, r in data["runs"].items():
            ax.plot(r["time_s"], _smooth(r["losses"], k), label=method)
        ax.axhline(_smooth(data["runs"]["ddp"]["losses"], k)[-1], color="gray", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel(f"seconds of training over {data['rate_mbit']:g} Mbit/s links")
        ax.set_ylabel(f"training loss ({k}-step mean)")
        ax.set_title(f"loss vs wall-clock (meshfold netlab, 4 nodes, DDP {data['steps']} steps)")
        ax.legend()
        fig.tight_layout()
        name = "lowcomm_loss_vs_time" + lab.stem[len("lowcomm_netlab"):] + ".png"
        fig.savefig(img / name, dpi=120)
        print(img / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    c = sub.add_parser("convergence")
    c.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    c.add_argument("--seed-list", type=int, nargs="+", help="these seeds instead of --seeds")
    c.add_argument("--steps", type=int, default=STEPS)
    c.add_argument("--out", default=str(RESULTS / "lowcomm_convergence.json"))
    m = sub.add_parser("merge", help="merge convergence JSONs (per method / seed) and print the table")
    m.add_argument("files", nargs="+")
    m.add_argument("--out", default=str(RESULTS / "lowcomm_convergence.json"))
    n = sub.add_parser("netlab")
    n.add_argument("--rate-mbit", type=float, default=10.0)
    n.add_argument("--steps", type=int, default=60)
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--method-steps-factor", type=float, default=1.5)
    n.add_argument("--out", default=str(RESULTS / "lowcomm_netlab.json"))
    for p in (c, n):  # the training settings both parts share
        p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
        p.add_argument("--lr", type=float, help=f"inner AdamW lr of the outer methods (default {INNER_LR})")
        p.add_argument("--ddp-lr", type=float, help=f"DDP's AdamW lr (default {DDP_LR})")
        p.add_argument("--h", type=int, help="inner steps per outer step, all methods")
        p.add_argument("--outer-lr", type=float)
        p.add_argument("--outer-momentum", type=float)
        p.add_argument("--set", action="append", metavar="METHOD.KEY=VALUE",
                       help="per-method override, e.g. streaming.mixing=0.3 or ddp.train.lr=4e-3")
    sub.add_parser("plot")
    sub.add_parser("summary", help="re-print the tables from the saved JSON")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.part in ("convergence", "merge", "netlab"):
        out = {"convergence": convergence, "merge": merge, "netlab": netlab}[args.part](args)
        Path(args.out).write_text(json.dumps(out, indent=1))
    elif args.part == "summary":
        for name, fn in (("lowcomm_convergence.json", summarize), ("lowcomm_netlab.json", time_to_target)):
            if (RESULTS / name).exists():
                fn(json.loads((RESULTS / name).read_text()))
    else:
        plot(args)


if __name__ == "__main__":
    main()
