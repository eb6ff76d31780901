"""The planner's accuracy: published GPU results, and measured runs on this machine.

Default (no GPU, a second): every published row the cost model is checked against —
Megatron-LM 2021 on A100s (Tables 1 and 2), Korthikanti et al. 2022 Table 5 on A100s (22B,
175B, 530B, 1T; full recompute and selective + sequence parallel: held out, never fitted
on) and torchtitan's Llama 3.1 runs on H100s (8B FSDP on 8 and 128 GPUs, 70B FSDP x TP on
256), each priced as the job ran (``meshfold/planner/published.py``: sources and how each
job ran) — published vs predicted, the error of each row, the mean and max absolute error
per table and per device generation, and Korthikanti's full/selective step-time ratio per
model, published vs predicted.

    .venv/bin/python benchmarks/planner_accuracy.py [--json]

``--sc21``: Megatron 2021's Table 1 as the paper's own scripts ran it (micro-batches 16 to 1,
the interleaved schedule on four rows, PyTorch's overlapped DDP where pp = 1:
``published.SC21_TABLE1_SCRIPTS``) beside the bounded rows' micro-batch 1 and 1F1B.

``--h200``: the step times measured on one H200 for the newer families (gemma-3-1b with and
without its windows, gpt-oss-20b and llama4-scout cut to a few layers, plain rows;
``benchmarks/results/gpu_features_h200_run2.json``, docs/gpu.md) against the planner's.

``--measure``: predicted vs measured step time on this machine, after ``meshfold calibrate``.
For N in (4, 8): calibrate N gloo processes (``meshfold calibrate``), train a small model
for a few steps with each layout (``meshfold train --nproc N``), and compare the run's
fastest steady ``step_time_s`` (steps 3..12; the least disturbed by other jobs on a shared
host, as calibration takes its fastest samples) with the planner's prediction for its layout (``plan --check``'s
code path). Also runs the planner's own pick (full search on the calibrated cluster) and
checks it against the fastest measured layout. Prints per-layout rows, the mean absolute
percentage error, Spearman's rank correlation, and the pick's gap to the fastest.

    .venv/bin/python benchmarks/planner_accuracy.py --measure [--quick] [--out runs/planner_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = ["model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=512",
        "model.seq_len=64", "train.global_batch=16", "train.dtype=\"float32\"", "train.steps=12",
        "train.progress=false", "train.tensorboard=false", "train.checkpoint_every=0", "train.eval_every=0",
        "train.straggler_every=0", "data.val_docs=0"]

LAYOUTS = {
    4: [
        {"parallel.dp_replicate": 4, "parallel.dp_shard": 1, "parallel.zero": 0},
        {"parallel.dp_shard": 4, "parallel.zero": 1},
        {"parallel.dp_shard": 4, "parallel.zero": 2, "train.micro_batch": 2},
        {"parallel.dp_shard": 4, "parallel.zero": 3},
        {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 3},
        {"parallel.dp_replicate": 4, "parallel.dp_shard": 1, "parallel.zero": 0, "train.recompute": "full"},
        {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 2},
        {"parallel.tp": 4, "parallel.dp_shard": 1},
        {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.zero": 1},
        {"parallel.pp": 4, "parallel.dp_shard": 1, "parallel.pp_microbatches": 8},
        {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.zero": 2},
        {"parallel.tp": 2, "parallel.sp": True, "parallel.pp": 2, "parallel.dp_shard": 1},
    ],
    8: [
        {"parallel.dp_replicate": 8, "parallel.dp_shard": 1, "parallel.zero": 0},
        {"parallel.dp_shard": 8, "parallel.zero": 3},
        {"parallel.dp_replicate": 2, "parallel.dp_shard": 4, "parallel.zero": 2, "train.micro_batch": 1},
        {"parallel.tp": 2, "parallel.dp_shard": 4, "parallel.zero": 2},
        {"parallel.tp": 4, "parallel.dp_shard": 2, "parallel.zero": 2},
        {"parallel.pp": 2, "parallel.dp_shard": 4, "parallel.zero": 1},
        {"parallel.pp": 4, "parallel.dp_shard": 2, "parallel.zero": 1},
        {"parallel.cp": 2, "parallel.dp_shard": 4, "parallel.zero": 2},
        {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp_shard": 2, "parallel.zero": 3},
        {"parallel.cp": 4, "parallel.dp_shard": 2, "parallel.zero": 2, "parallel.cp_mode": "ulysses"},
    ],
}


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)


def train(nproc: int, overrides: dict, run_dir: Path) -> bool:
    sets = BASE + [f"{k}={_fmt(v)}" for k, v in overrides.items()] + [f'train.run_dir="{run_dir}"']
    if (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").unlink()
    cmd = [sys.executable, "-m", "meshfold", "train", str(ROOT / "configs/debug.toml"), "--nproc", str(nproc),
           "--set", "train.resume=\"never\""]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        print(f"  FAILED ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:] }", flush=True)
        return False
    return True


def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def published_main(as_json: bool) -> int:
    from meshfold.planner.published import KORTHIKANTI, MEGATRON, TORCHTITAN, predict, rows

    results = [predict(r) for r in rows()]
    if as_json:
        print(json.dumps([{k: v for k, v in r.items() if k != "estimate"} for r in results], indent=1))
        return 0
    print(f"{'row':44s} {'device':17s} {'unit':13s} {'published':>10s} {'predicted':>10s} {'error':>8s}  bound")
    for r in results:
        bound = f"{100 * r['bound']:.0f}%" if r["bound"] else "-"
        flag = "" if not r["bound"] or abs(r["error"]) <= r["bound"] else "  OUT"
        nd = 2 if r["unit"] == "s/step" else 1
        print(f"{r['name']:44s} {r['device']:17s} {r['unit']:13s} {r['published']:10.{nd}f} {r['predicted']:10.{nd}f} "
              f"{100 * r['error']:+7.1f}%  {bound}{flag}")
    groups = {  # per table; Korthikanti's Table 5 as two: full recompute and selective + sp
        "Megatron 2021 Tables 1-2 (A100)": lambda r: r["source"] == MEGATRON,
        "Korthikanti 2022 Table 5, full (A100)": lambda r: r["source"] == KORTHIKANTI and "full" in r["name"],
        "Korthikanti 2022 Table 5, selective + sp (A100)": lambda r: r["source"] == KORTHIKANTI
        and "selective" in r["name"],
        "torchtitan (H100)": lambda r: r["source"] == TORCHTITAN,
        "A100": lambda r: r["device"] == "a100-dgx",
        "H100": lambda r: r["device"] == "h100-grand-teton",
        "all": lambda r: True,
    }
    for group, member in groups.items():
        for checked in (True, False):
            errs = [abs(r["error"]) for r in results if member(r) and (r["bound"] is not None or not checked)]
            if errs:
                print(f"{group}{' (bounded rows)' if checked else ' (all rows)'}: {len(errs)} rows, "
                      f"mean |error| {100 * sum(errs) / len(errs):.1f}%, max {100 * max(errs):.1f}%")
    # full / selective step-time ratio per model, published vs predicted (the recompute's price)
    by_size: dict = {}
    for r in results:
        if r["source"] == KORTHIKANTI:
            by_size.setdefault(r["name"].split()[0], {})["full" if "full" in r["name"] else "sel"] = r
    for size, pair in by_size.items():
        pub = pair["full"]["published"] / pair["sel"]["published"]
        pred = pair["full"]["predicted"] / pair["sel"]["predicted"]
        print(f"Korthikanti {size}: full/selective step time published {pub:.3f}, predicted {pred:.3f} "
              f"({100 * (pred / pub - 1):+.1f}%)")
    for r in results:
        if r["source"].startswith("torchtitan"):
            est = r["estimate"]
            print(f"  {r['name']}: step {est.step_time_s:.3f} s, MFU {100 * est.mfu:.1f}% of this device's peak, "
                  f"planner memory {r['peak_mem_gib']:.1f} GiB ({'fits' if r['fits'] else 'does NOT fit'})")
    return 0


def sc21_main() -> int:
    """Megatron 2021's Table 1: the bounded rows (micro-batch 1, 1F1B, DDP after the backward)
    and the same rows as ``examples/sc21/run_table_1.sh`` ran them, each against the paper."""
    from meshfold.planner.published import predict, rows, scripted_rows

    bounded = [predict(r) for r in rows() if "(Table 1)" in r.name and r.source.startswith("Narayanan")]
    scripted = [predict(r) for r in scripted_rows()]
    print(f"{'row':30s} {'published':>9s} {'mb 1, 1F1B':>16s} {'as scripted':>16s}  layout as scripted")
    for b, r in zip(bounded, scripted):
        print(f"{b['name']:30s} {b['published']:9.1f} {b['predicted']:8.1f} ({100 * b['error']:+5.1f}%) "
              f"{r['predicted']:8.1f} ({100 * r['error']:+5.1f}%)  {r['layout']}")
    for label, res in (("mb 1, 1F1B", bounded), ("as scripted", scripted)):
        errs = [abs(r["error"]) for r in res]
        print(f"Table 1 {label}: {len(errs)} rows, mean |error| {100 * sum(errs) / len(errs):.1f}%, "
              f"max {100 * max(errs):.1f}%")
    return 0


# The H200 runs of ``benchmarks/gpu_features.py`` with plain rows (no packed documents: the
# planner prices attention over whole rows), as each was configured there: preset, layers,
# model overrides. Seq 8192, global batch 4, micro-batch 1, eager bf16 (docs/gpu.md).
H200_RUNS = {
    "window-512": ("gemma-3-1b", 6, {}),
    "window-full": ("gemma-3-1b", 6, {"sliding_window": 0}),
    "family-gpt-oss": ("gpt-oss-20b", 4, {}),
    "family-gpt-oss-full": ("gpt-oss-20b", 4, {"alternating_window": 0}),
    "family-llama4": ("llama4-scout", 2, {"moe_experts": 8, "attention_chunk_size": 2048}),
    "family-llama4-full": ("llama4-scout", 2, {"moe_experts": 8, "attention_chunk_size": 0}),
}


def h200_main() -> int:
    """Measured step times of the H200 family runs (``benchmarks/results/gpu_features_h200_run2.json``)
    against the planner's for the same config on ``h200:1``."""
    from meshfold.config import Config, validate
    from meshfold.models.presets import preset
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.cost import CostModel
    from meshfold.planner.from_config import layout_from_config, workload_from_config

    measured = json.loads((ROOT / "benchmarks/results/gpu_features_h200_run2.json").read_text())
    errs = []
    print(f"{'run (H200, run 2)':22s} {'measured s':>10s} {'planner s':>10s} {'error':>8s}")
    for name, (model, layers, over) in H200_RUNS.items():
        cfg = Config(model=preset(model, seq_len=8192))
        cfg.model.n_layers = layers
        for key, value in over.items():
            setattr(cfg.model, key, value)
        cfg.train.global_batch, cfg.train.micro_batch, cfg.data.doc_mask = 4, 1, False
        cfg = validate(cfg, 1)
        est = CostModel(workload_from_config(cfg, True), load_cluster("h200", devices=1)).estimate(
            layout_from_config(cfg, 1))
        step = measured[name]["step_s"]
        errs.append(est.step_time_s / step - 1)
        print(f"{name:22s} {step:10.4f} {est.step_time_s:10.4f} {100 * errs[-1]:+7.1f}%")
    print(f"H200 runs: {len(errs)}, mean |error| {100 * sum(map(abs, errs)) / len(errs):.1f}%, "
          f"max {100 * max(map(abs, errs)):.1f}%")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--h200", action="store_true", help="the measured H200 family runs against the planner")
    ap.add_argument("--sc21", action="store_true", help="Megatron 2021's Table 1 as its own scripts ran it")
    ap.add_argument("--measure", action="store_true", help="calibrate this machine and compare measured runs")
    ap.add_argument("--json", action="store_true", help="published rows as JSON")
    ap.add_argument("--out", default="runs/planner_bench")
    ap.add_argument("--nprocs", default="4,8")
    ap.add_argument("--quick", action="store_true", help="first 4 layouts per process count")
    ap.add_argument("--reuse-cluster", action="store_true",
                    help="no new calibration: re-derive the cluster files from their saved measurements")
    ap.add_argument("--predict-only", action="store_true",
                    help="no training: (re)calibrate and predict the runs already in --out")
    args = ap.parse_args()
    if args.h200:
        return h200_main()
    if args.sc21:
        return sc21_main()
    if not args.measure:
        return published_main(args.json)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from meshfold.config import load_config
    from meshfold.calibration import calibrate
    from meshfold.planner.calibrate import cluster_from_measurements, measurements_path
    from meshfold.planner.cluster import cluster_to_toml
    from meshfold.planner.cli import predict_run, workload_from_config
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.search import search

    rows = []
    picks = []
    for nproc in [int(x) for x in args.nprocs.split(",")]:
        cluster_file = out / f"cluster-cpu-{nproc}.toml"
        raw = measurements_path(cluster_file)
        if args.reuse_cluster and raw.exists():  # re-derive with the current code, same measurements
            cluster_file.write_text(cluster_to_toml(cluster_from_measurements(
                nproc, json.loads(raw.read_text())["measurements"])))
        elif not (args.reuse_cluster and cluster_file.exists()):
            t0 = time.time()
            calibrate(nproc, cluster_file)
            print(f"calibrated {nproc} processes in {time.time() - t0:.0f} s -> {cluster_file}", flush=True)
        layouts = LAYOUTS[nproc][: 4 if args.quick else None]
        # the planner's own pick on the calibrated cluster, run as one more layout
        cfg = load_config(ROOT / "configs/debug.toml", BASE)
        cluster = load_cluster(cluster_file)
        res = search(workload_from_config(cfg, cluster), cluster, top=1)
        win = res.ranked[0].layout
        pick = {f"parallel.{k}": getattr(win, k) for k in ("dp_replicate", "dp_shard", "zero", "tp", "sp", "pp",
                                                             "pp_schedule", "pp_virtual_stages", "cp", "cp_mode")}
        pick.update({"train.micro_batch": win.micro_batch, "train.recompute": win.recompute})
        if win.pp > 1:
            pick["parallel.pp_microbatches"] = win.microbatches(16)
        entries = [(i, lay) for i, lay in enumerate(layouts)] + [("pick", pick)]
        measured_here = []
        for tag, lay in entries:
            run_dir = out / f"n{nproc}-{tag}"
            t0 = time.time()
            if args.predict_only:
                if not (run_dir / "metrics.jsonl").exists():
                    continue
            elif not train(nproc, lay, run_dir):
                continue
            est, meas, layout = predict_run(run_dir, str(cluster_file), stat="min")
            row = {"nproc": nproc, "tag": str(tag), "layout": layout.short(), "predicted_s": est.step_time_s,
                   "measured_s": meas["step_time_s"], "comm_pred": est.comm_bytes, "comm_meas": meas["comm_bytes"],
                   "wall_s": time.time() - t0, "load_avg_1m": os.getloadavg()[0]}
            measured_here.append(row)
            print(f"n={nproc} {str(tag):>4} {layout.short():42s} predicted {est.step_time_s:8.4f} s  measured "
                  f"{meas['step_time_s']:8.4f} s  ratio {est.step_time_s / meas['step_time_s']:.3f}  "
                  f"(load {os.getloadavg()[0]:.0f})", flush=True)
        rows += [r for r in measured_here if r["tag"] != "pick"]
        fastest = min(r["measured_s"] for r in measured_here)
        chosen = [r for r in measured_here if r["tag"] == "pick"]
        if args.predict_only:  # the pick of the current model, if one of the measured layouts
            chosen = [r for r in measured_here if r["layout"] == win.short()]
            if not chosen:
                picks.append({"nproc": nproc, "pick": win.short(), "note": "not among the measured layouts"})
        if chosen:
            picks.append({"nproc": nproc, "pick": chosen[0]["layout"], "pick_measured_s": chosen[0]["measured_s"],
                          "fastest_measured_s": fastest, "gap": chosen[0]["measured_s"] / fastest - 1})
        # the planner ranking only the layouts measured here
        cand = [r for r in measured_here if r["tag"] != "pick"]
        best_pred = min(cand, key=lambda r: r["predicted_s"])
        fastest_cand = min(r["measured_s"] for r in cand)
        picks.append({"nproc": nproc, "pick_among_measured": best_pred["layout"],
                      "gap": best_pred["measured_s"] / fastest_cand - 1})

    errs = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    mae = sum(errs) / len(errs)
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    summary = {"layouts": len(rows), "mean_abs_pct_error": 100 * mae, "spearman": rho, "picks": picks,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "results.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"MAE {100 * mae:.1f}% (target <= 15%), Spearman {rho:.3f} (target >= 0.9), "
          f"pick gaps {[round(100 * p['gap'], 1) for p in picks if 'gap' in p]}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
