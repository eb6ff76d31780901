"""Muon vs AdamW on the same data and model (4 layers), each at its best learning rate from
a small sweep, in one run: validation loss and tokens/s of each, and their ratios.

    python benchmarks/muon.py                      # 300 steps, sweep at the same length
    python benchmarks/muon.py --steps 100 --adamw-lrs 3e-3 1e-2 --muon-lrs 1e-2 2e-2

One process (the comparison is of the update rule; the distributed exchange's cost is the
planner's, docs/optimizers.md). Validation: every held-out sequence (lowcomm.py's
``full_validation``). Muon's default scale (match_rms_adamw) lets both share a grid.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODEL = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "seq_len": 64}
BATCH = 32
LRS = {"adamw": [3e-3, 6e-3, 1.2e-2], "muon": [6e-3, 1.2e-2, 2.4e-2]}


def config(optimizer: str, lr: float, steps: int, run_dir: str) -> dict:
    return {"model": dict(MODEL), "parallel": {"dp_replicate": 1, "dp_shard": 1},
            "train": {"steps": steps, "seed": 0, "global_batch": BATCH, "lr": lr, "optimizer": optimizer,
                      "run_dir": run_dir, "progress": False, "tensorboard": False, "eval_batches": 8,
                      "warmup_steps": max(1, steps // 10), "straggler_every": 0},
            "data": {"val_docs": 32}}


def _train(cfg: dict) -> dict:
    from lowcomm import full_validation

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg))
    start = time.perf_counter()
    tr.fit()
    seconds = time.perf_counter() - start
    tokens = cfg["train"]["steps"] * BATCH * MODEL["seq_len"]
    return {"val_loss": full_validation(tr), "tokens_per_s": tokens / seconds}


def run(optimizer: str, lr: float, steps: int) -> dict:
    from meshfold.testing import run_on

    with tempfile.TemporaryDirectory() as d:
        return run_on(1, _train, config(optimizer, lr, steps, d))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--adamw-lrs", type=float, nargs="+", default=LRS["adamw"])
    ap.add_argument("--muon-lrs", type=float, nargs="+", default=LRS["muon"])
    args = ap.parse_args()
    best = {}
    for optimizer, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
        for lr in lrs:
            r = run(optimizer, lr, args.steps)
            print(f"{optimizer:6s} lr {lr:<8g} val {r['val_loss']:.4f}  {r['tokens_per_s']:,.0f} tokens/s", flush=True)
            if optimizer not in best or r["val_loss"] < best[optimizer][1]["val_loss"]:
                best[optimizer] = (lr, r)
    (la, a), (lm, m) = best["adamw"], best["muon"]
    print(f"best, {args.steps} steps, {BATCH}x{MODEL['seq_len']} tokens/step: AdamW lr {la:g} val {a['val_loss']:.4f}, "
          f"Muon lr {lm:g} val {m['val_loss']:.4f}; Muon/AdamW val loss {m['val_loss'] / a['val_loss']:.3f}, "
          f"tokens/s {m['tokens_per_s'] / a['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
