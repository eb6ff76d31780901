"""FP8 training against bf16: a paired run per recipe (``train.fp8``), same seed, same data,
same steps of a 4-layer model (d 256), one process. Prints each recipe's final validation
loss, its distance to bf16's, and the ratio of tokens/s to bf16's measured in the same run.

On a CPU the fp8 GEMMs are emulated (``torch._scaled_mm`` upcasts; MXFP8 through torchao's
emulated recipe), so the throughput ratio here is below 1: the figure that matters is the
one a GPU gives (docs/fp8.md). The loss distance is what this script checks on any machine.

    .venv/bin/python benchmarks/fp8.py [--steps 300] [--recipes tensorwise rowwise ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshfold.config import from_dict  # noqa: E402
from meshfold.train.trainer import Trainer  # noqa: E402

MODEL = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 2048, "seq_len": 128}
RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")


def run(recipe: str, steps: int, run_dir: str, seed: int) -> dict:
    cfg = from_dict({
        "model": MODEL,
        "train": {"steps": steps, "seed": seed, "global_batch": 8, "lr": 3e-3, "dtype": "bfloat16",
                  "fp8": recipe, "run_dir": run_dir, "resume": "never", "progress": False,
                  "tensorboard": False, "log_every": max(1, steps // 10), "eval_every": steps, "eval_batches": 8},
    })
    trainer = Trainer(cfg)
    trainer.fit()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows[1:] if "tokens_per_s" in r] or [rows[-1]["tokens_per_s"]]
    val = next(r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None)
    return {"val_loss": val, "tokens_per_s": sorted(speeds)[len(speeds) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES[1:]), choices=RECIPES[1:])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in ("none", *args.recipes):
            out[recipe] = run(recipe, args.steps, f"{tmp}/{recipe}", args.seed)
    base = out["none"]
    print(f"{'recipe':20s} {'val loss':>9s} {'- bf16':>8s} {'tok/s':>9s} {'x bf16':>7s}")
    for recipe, r in out.items():
        r["loss_delta"] = r["val_loss"] - base["val_loss"]
        r["speed_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{recipe:20s} {r['val_loss']:9.4f} {r['loss_delta']:+8.4f} {r['tokens_per_s']:9.0f} "
              f"{r['speed_ratio']:7.2f}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "model": MODEL, "runs": out}, indent=1))


if __name__ == "__main__":
    main()
