"""Branch-Train-Merge at the debug shape on four domains: four contiguous, disjoint parts of
the default corpus (the standard library's modules in name order). A seed trained on the
whole corpus, four branches trained from it (one process each, no communication), their
average and their ensemble, against a dense model trained from the same seed for the
branches' total steps on the union of the four domains' training documents (each domain's
held-out documents left out). Per-domain validation loss of every model (``meshfold btm eval``).

    python benchmarks/btm.py --seed-steps 50 --branch-steps 100 --out benchmarks/results/btm.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOMAINS = 4


def meshfold(*argv: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "meshfold", *argv], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"meshfold {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed-steps", type=int, default=50)
    ap.add_argument("--branch-steps", type=int, default=100)
    ap.add_argument("--work", default="/tmp/meshfold_btm_bench")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "btm.json"))
    args = ap.parse_args()
    work = Path(args.work).resolve()
    common = ["--set", "data.val_docs=16", "--set", "train.progress=false", "--set", "train.tensorboard=false",
              "--set", "train.log_every=10"]
    seed_run = work / "seed"
    seed = seed_run / "checkpoints" / f"step-{args.seed_steps}"
    if not seed.is_dir():  # a seed of an earlier run with the same steps is reused
        meshfold("train", "configs/debug.toml", *common, "--set", f"train.steps={args.seed_steps}",
                 "--set", f"train.checkpoint_every={args.seed_steps}", "--set", f'train.run_dir="{seed_run}"')
    btm_dir = work / "btm"
    domains = [x for k in range(DOMAINS) for x in ("--domain", f"d{k}=default:{k}/{DOMAINS}")]
    meshfold("btm", "branch", str(seed), *domains, "--out", str(btm_dir), "--set", f"train.steps={args.branch_steps}",
             "--set", f"train.checkpoint_every={args.branch_steps}")
    for k in range(DOMAINS):
        meshfold("train", str(btm_dir / f"d{k}" / "config.toml"))
    # dense: the same seed, the branches' total steps, on every domain's training documents
    from meshfold.config import load_config

    dense_docs = []
    for k in range(DOMAINS):
        cfg = load_config(btm_dir / f"d{k}" / "config.toml")
        docs = Path(cfg.data.source).read_text().splitlines()
        n_val = min(cfg.data.val_docs, len(docs) // 10)  # data/dataset.py::split_corpus holds out the last n_val
        dense_docs += docs[:len(docs) - n_val]
    (work / "dense.jsonl").write_text("\n".join(dense_docs) + "\n")
    dense_steps = DOMAINS * args.branch_steps
    dense_run = work / "dense"
    meshfold("train", str(btm_dir / "d0" / "config.toml"), "--set", f'data.source="{work / "dense.jsonl"}"',
             "--set", f"train.steps={dense_steps}", "--set", f"train.checkpoint_every={dense_steps}",
             "--set", f'train.run_dir="{dense_run}"')
    meshfold("btm", "merge", str(btm_dir), "--out", str(work / "average"))
    meshfold("btm", "merge", str(btm_dir), "--out", str(work / "ensemble"), "--ensemble")
    proc = subprocess.run([sys.executable, "-m", "meshfold", "btm", "eval", str(btm_dir), "--model", f"seed={seed}",
                           "--model", f"average={work / 'average'}",
                           "--model", f"dense={dense_run / 'checkpoints' / f'step-{dense_steps}'}",
                           "--ensemble", str(work / "ensemble"), "--json"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(seed_steps=args.seed_steps, branch_steps=args.branch_steps, dense_steps=dense_steps,
                  config="configs/debug.toml (dim 64, 2 layers, seq 64, batch 8), one process per run")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    from meshfold.btm import format_table

    print(format_table(result))
    print("ensemble weights per domain:", json.dumps(result["ensemble_weights"]))


if __name__ == "__main__":
    main()
