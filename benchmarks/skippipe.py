"""SkipPipe against 1F1B over two slow links among four pipeline stages (meshfold netlab:
one network namespace per stage, every link at --rate-mbit except 0<->1 and 2<->3 at
--slow-mbit; needs root). Same config, same steps (so the same tokens) for every schedule:
median step time and final validation loss measured, next to the planner's prediction
(``CostModel.estimate`` of the same layout with the same links).

    python benchmarks/skippipe.py --steps 30 --out benchmarks/results/skippipe_netlab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW = [(0, 1), (2, 3)]
RUNS = {
    "1f1b": {"parallel.pp_schedule": '"1f1b"'},
    "skippipe reorder": {"parallel.pp_schedule": '"skippipe"', "parallel.pp_reorder": "true"},
    "skippipe skip 0.5": {"parallel.pp_schedule": '"skippipe"', "parallel.pp_skip": "0.5"},
    "skippipe skip 0.25 + reorder": {"parallel.pp_schedule": '"skippipe"', "parallel.pp_skip": "0.25",
                                     "parallel.pp_reorder": "true"},
}


def common(args, run_dir: Path) -> dict:
    links = "[" + ", ".join(f"[{a}, {b}, {args.slow_mbit}]" for a, b in SLOW) + "]"
    return {"parallel.pp": "4", "model.n_layers": "4", "parallel.pp_microbatches": "4", "train.steps": str(args.steps),
            "parallel.pp_link_mbit": str(args.rate_mbit), "parallel.pp_links": links,
            "train.eval_every": str(args.steps), "data.val_docs": "16", "train.run_dir": f'"{run_dir}"',
            "train.progress": "false", "train.tensorboard": "false"}


def planner_prediction(sets: dict) -> float:
    from meshfold.config import load_config
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.cost import CostModel
    from meshfold.planner.from_config import layout_from_config, workload_from_config

    cfg = load_config(ROOT / "configs" / "debug.toml", [f"{k}={v}" for k, v in sets.items()])
    cluster = load_cluster("cpu", nodes=1, devices=4)  # calibrated CPU; the slow links come from pp_links
    return CostModel(workload_from_config(cfg, False), cluster).estimate(layout_from_config(cfg, 4)).step_time_s


def run_one(args, name: str, extra: dict) -> dict:
    run_dir = Path(args.work) / name.replace(" ", "_").replace("+", "")
    sets = {**common(args, run_dir), **extra}
    argv = [sys.executable, "-m", "meshfold", "netlab", "train", str(ROOT / "configs" / "debug.toml"), "--nodes", "4",
            "--rate-mbit", str(args.rate_mbit), "--timeout", "900"]
    for a, b in SLOW:
        argv += ["--slow-link", f"{a},{b},{args.slow_mbit}"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if "step_time_s" in r]
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {"median_step_s": statistics.median(r["step_time_s"] for r in steps[1:]),
            "final_loss": steps[-1]["loss"], "val_loss": val[-1] if val else None,
            "planner_step_s": planner_prediction(sets), "wall_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--slow-mbit", type=float, default=2.0)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--work", default="/tmp/meshfold_skippipe_bench")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "skippipe_netlab.json"))
    args = ap.parse_args()
    out = {"steps": args.steps, "rate_mbit": args.rate_mbit, "slow_mbit": args.slow_mbit, "slow_links": SLOW,
           "config": "configs/debug.toml, pp 4 x 1 layer, 4 micro-batches of 2 sequences", "runs": {}}
    for name in args.runs.split(","):
        out["runs"][name] = run_one(args, name, RUNS[name])
        print(name, json.dumps(out["runs"][name]), flush=True)
    base = out["runs"].get("1f1b")
    if base:
        for r in out["runs"].values():
            r["speedup_vs_1f1b"] = base["median_step_s"] / r["median_step_s"]
            r["planner_speedup_vs_1f1b"] = base["planner_step_s"] / r["planner_step_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("| run | step (s) | speed-up | planner step (s) | planner speed-up | val loss |")
    print("|---|---|---|---|---|---|")
    for name, r in out["runs"].items():
        print(f"| {name} | {r['median_step_s']:.3f} | {r.get('speedup_vs_1f1b', 1):.2f} | {r['planner_step_s']:.3f} | "
              f"{r.get('planner_speedup_vs_1f1b', 1):.2f} | {r['val_loss']:.3f} |")


if __name__ == "__main__":
    main()
