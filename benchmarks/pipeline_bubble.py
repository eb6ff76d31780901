"""Measured pipeline bubble of each schedule at pp 4 next to its theory.

Runs every schedule on 4 real gloo processes (same model, data and micro-batch count),
reads the per-step ``bubble_frac`` the executor measured (1 - busy / makespan per stage,
from real timings) and prints it next to the schedule's theoretical bubble, the bubble
its order would have with the measured mean F/B/W durations and no contention or
transfer time ("replay"), and the step time relative to GPipe measured in the same run
(the baseline).

    .venv/bin/python benchmarks/pipeline_bubble.py [--steps 8] [--microbatches 8]

On a shared 2-core CPU the four stages also compete for cores, so measured bubbles carry
that noise; the ordering of the schedules is what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("MESHFOLD_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "meshfold"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbv", 1)]


def train(cfg_dict: dict) -> None:
    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    Trainer(from_dict(cfg_dict)).fit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()

    from meshfold.parallel.pp.timeline_plot import TIMELINE_FILE
    from meshfold.schedules import get_schedule
    from meshfold.schedules.simulate import bubble_fractions, simulate
    from meshfold.testing import run_on

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, virtual in SCHEDULES:
            run_dir = Path(tmp) / schedule
            cfg = {
                "model": {"dim": args.dim, "n_layers": 4 * args.pp, "n_heads": 4, "vocab_size": 512,
                          "seq_len": args.seq},
                "parallel": {"pp": args.pp, "dp_shard": 1, "pp_schedule": schedule, "pp_virtual_stages": virtual,
                             "pp_microbatches": args.microbatches},
                "train": {"steps": args.steps, "global_batch": 2 * args.microbatches, "dtype": "float32",
                          "run_dir": str(run_dir), "progress": False, "tensorboard": False},
                "data": {"max_docs": 400, "val_docs": 0},
            }
            run_on(args.pp, train, cfg, timeout=600)
            records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]  # warm-up
            stages = [statistics.median(r["bubble_frac_stages"][s] for r in records) for s in range(args.pp)]
            # Replay the order with the measured mean action durations (no waiting for cores or wires).
            steps = [json.loads(x) for x in (run_dir / TIMELINE_FILE).read_text().splitlines()][2:]
            events = [e for rec in steps for e in rec["events"]]
            cost = {k: statistics.mean([e["end"] - e["start"] for e in events if e["kind"] == k] or [0.0])
                    for k in "FBW"}
            sched = get_schedule(schedule)
            orders = sched.actions(args.pp, virtual, args.microbatches)
            replay = bubble_fractions(simulate(sched, orders, cost))
            rows.append((schedule, virtual, sched.theoretical_bubble(args.pp, virtual, args.microbatches),
                         sum(replay.values()) / len(replay),
                         statistics.median(r["bubble_frac"] for r in records), stages,
                         statistics.median(r["step_time_s"] for r in records), cost))
    base = rows[0][6]  # gpipe step time
    print(f"pp {args.pp}, {args.microbatches} micro-batches of 2 sequences, {4 * args.pp} blocks of dim {args.dim}, "
          f"seq {args.seq}, float32; "
          f"median over steps 3..{args.steps}")
    print(f"{'schedule':<18}{'theory':>8}{'replay':>8}{'measured':>10}  {'measured per stage':<22}"
          f"{'step s':>8}{'speed vs gpipe':>16}   mean F / B / W ms")
    for schedule, virtual, theory, replay, measured, stages, step, cost in rows:
        name = f"interleaved (v={virtual})" if schedule == "interleaved" else schedule
        per = " ".join(f"{b:.2f}" for b in stages)
        print(f"{name:<18}{theory:>8.3f}{replay:>8.3f}{measured:>10.3f}  {per:<22}{step:>8.3f}{base / step:>15.2f}x   "
              + " / ".join(f"{1e3 * cost[k]:.1f}" for k in "FBW"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
