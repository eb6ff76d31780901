"""Low-communication training next to DDP, measured in the same run.

    # 1. quality and bytes: 4 workers x 1 rank vs DDP over 4 ranks, equal tokens, >= 3 seeds
    python benchmarks/lowcomm.py convergence --seeds 3 --steps 120
    # 2. wall-clock over throttled links: one namespace per worker (meshfold netlab, root)
    python benchmarks/lowcomm.py netlab --rate-mbit 10 --steps 60   # methods get 1.5x the steps
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

# Outer lr 0.5 / momentum 0.8 for every method: in this short regime (12 outer steps) the
# DiLoCo defaults 0.7 / 0.9 overshoot (seed 0: val 4.90 vs 4.35; docs/benchmarks.md).
OUTER = {"inner_steps": 10, "outer_lr": 0.5, "outer_momentum": 0.8}
METHODS = {
    "ddp": {},
    "diloco": {"method": "diloco", **OUTER},
    "streaming": {"method": "streaming", **OUTER, "fragments": 4, "overlap_steps": 1, "quant_bits": 4,
                  "mixing": 0.5},
    "noloco": {"method": "noloco", **OUTER, "noloco_gamma": 0.5},
    "co2": {"method": "co2", **OUTER, "co2_staleness_penalty": 0.5, "co2_clip": 5.0},
}


def config(method: str, seed: int, steps: int, run_dir: str) -> dict:
    lc = dict(METHODS[method])
    if method == "ddp":
        parallel = {"dp_replicate": WORKERS, "dp_shard": 1}
        batch = WORKERS * PER_WORKER_BATCH
    else:
        parallel = {"dp_replicate": 1, "dp_shard": 1}
        batch = PER_WORKER_BATCH
        lc["workers"] = WORKERS
    return {"model": dict(MODEL), "parallel": parallel,
            "train": {"steps": steps, "seed": seed, "global_batch": batch, "lr": 3e-3, "run_dir": run_dir,
                      "progress": False, "tensorboard": False, "eval_batches": 8, "warmup_steps": steps // 10},
            "data": {"val_docs": 32}, "lowcomm": lc}


# --------------------------------------------------------------------------- convergence


def _train(cfg: dict) -> dict | None:
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg))
    per_step = []
    orig = tr.step_record

    def record(loss, elapsed, tokens):  # keep every step's ledger entry
        rec = orig(loss, elapsed, tokens)
        per_step.append(sum(rec["comm_bytes"].values()))
        return rec

    tr.step_record = record
    losses = tr.fit()
    val = tr.evaluate()
    if dist.get_rank() != 0:
        return None
    return {"losses": losses, "val_loss": val, "bytes_per_step": per_step, "bytes": sum(per_step)}


def convergence(args) -> dict:
    from meshfold.testing import run_on

    out = {"steps": args.steps, "seeds": args.seeds, "workers": WORKERS, "per_worker_batch": PER_WORKER_BATCH,
           "model": MODEL, "methods": METHODS, "runs": {}}
    tokens = args.steps * WORKERS * PER_WORKER_BATCH * MODEL["seq_len"]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for method in METHODS:
                t0 = time.perf_counter()
                res = run_on(WORKERS, _train, config(method, seed, args.steps, f"{tmp}/{method}-{seed}"),
                             timeout=1800)[0]
                res["bytes_per_token"] = res["bytes"] / tokens
                out["runs"].setdefault(method, []).append(res)
                print(f"seed {seed} {method:10s} val {res['val_loss']:.4f} bytes/token {res['bytes_per_token']:.1f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
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


# --------------------------------------------------------------------------- netlab


def _toml(cfg: dict) -> str:
    import tomli_w

    return tomli_w.dumps(cfg)


def netlab(args) -> dict:
    out = {"rate_mbit": args.rate_mbit, "steps": args.steps, "method_steps_factor": args.method_steps_factor,
           "seed": args.seed, "model": MODEL, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            # Methods may run longer than DDP (their own schedule) to reach DDP's final loss.
            steps = args.steps if method == "ddp" else int(args.steps * args.method_steps_factor)
            cfg = config(method, args.seed, steps, f"{tmp}/{method}")
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
    time_to_target(out)
    return out


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def time_to_target(out: dict) -> None:
    """Seconds of training (sum of step times) until the 5-step moving average of the
    training loss first reaches DDP's final moving average."""
    runs = out["runs"]
    target = _smooth(runs["ddp"]["losses"])[-1]
    # DDP's own time to target: the first step its moving average reaches its final value.
    ddp_sm = _smooth(runs["ddp"]["losses"])
    ddp_time = runs["ddp"]["time_s"][next(i for i, v in enumerate(ddp_sm) if v <= target)]
    print(f"\ntarget loss (DDP's final 5-step mean) {target:.4f}, DDP reaches it after {ddp_time:.1f} s")
    summary = {}
    for method, r in runs.items():
        sm = _smooth(r["losses"])
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
            ax.plot(cum, _smooth(r["losses"]), label=method)
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlabel("MB sent by rank 0 (cumulative)")
        ax.set_ylabel("training loss (5-step mean)")
        ax.set_title("loss vs bytes (seed 0)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(img / "lowcomm_loss_vs_bytes.png", dpi=120)
        print(img / "lowcomm_loss_vs_bytes.png")
    lab = RESULTS / "lowcomm_netlab.json"
    if lab.exists():
        data = json.loads(lab.read_text())
        fig, ax = plt.subplots(figsize=(6, 4))
        for method, r in data["runs"].items():
            ax.plot(r["time_s"], _smooth(r["losses"]), label=method)
        ax.set_xlabel(f"seconds of training over {data['rate_mbit']} Mbit/s links")
        ax.set_ylabel("training loss (5-step mean)")
        ax.set_title("loss vs wall-clock (meshfold netlab, 4 nodes)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(img / "lowcomm_loss_vs_time.png", dpi=120)
        print(img / "lowcomm_loss_vs_time.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    c = sub.add_parser("convergence")
    c.add_argument("--seeds", type=int, default=3)
    c.add_argument("--steps", type=int, default=120)
    n = sub.add_parser("netlab")
    n.add_argument("--rate-mbit", type=float, default=10.0)
    n.add_argument("--steps", type=int, default=60)
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--methods", nargs="+", default=list(METHODS))
    n.add_argument("--method-steps-factor", type=float, default=1.5)
    sub.add_parser("plot")
    sub.add_parser("summary", help="re-print the tables from the saved JSON")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.part == "convergence":
        out = convergence(args)
        (RESULTS / "lowcomm_convergence.json").write_text(json.dumps(out, indent=1))
    elif args.part == "netlab":
        out = netlab(args)
        (RESULTS / "lowcomm_netlab.json").write_text(json.dumps(out, indent=1))
    elif args.part == "summary":
        for name, fn in (("lowcomm_convergence.json", summarize), ("lowcomm_netlab.json", time_to_target)):
            if (RESULTS / name).exists():
                fn(json.loads((RESULTS / name).read_text()))
    else:
        plot(args)


if __name__ == "__main__":
    main()
