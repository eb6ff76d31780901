"""Cost-aware balancing vs a naive token-equal split: step time on 4 gloo processes.

Both sides run the real ``Trainer.train_step`` with ``data.balance = greedy`` (whole
documents, per-document attention, the same documents per step in the same order); the
baseline's loader places them with the naive token-equal contiguous split
(``plan_step(method="none")``) instead of the cost-aware plan. The cost model
W(l) = a l^2 + b l is measured first (``cost_calibration.measure_cost``, in this
process before the ranks start) unless --cost-a/--cost-b are given. Steps alternate between the two trainers so machine
noise hits both. Printed: lambda (max/mean W over the 4 ranks, and of tokens) before and
after balancing; each rank's measured compute time per step (its main thread's CPU
seconds, which waiting for a core or for peers does not count), their max/mean, and the
ratio of the slowest rank's compute (the step time with one core per rank); and the
wall-clock ratio, which on a machine with fewer free cores than processes mostly measures
the total work (the same on both sides) rather than the slowest rank.

Length distributions:
  default    the default corpus (this Python's standard library), documents cut into
             pieces of at most model.seq_len tokens (its real long-tailed lengths)
  lognormal  a seeded lognormal sample of document lengths (median ~400 tokens), written
             as a JSONL corpus

    .venv/bin/python benchmarks/balance.py [--dist default lognormal] [--seq 4096] [--steps 6] [--seq-cp 4]

With --seq-cp K the balanced side also spreads documents too costly for one rank over
groups of up to K ranks (data.seq_cp_max, ring attention); the naive side never does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def lognormal_corpus(path: Path, n_docs: int, seed: int = 0, median_words: float = 300.0, sigma: float = 1.2,
                     max_words: int = 6000) -> str:
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(400)]
    with open(path, "w") as fh:
        for _ in range(n_docs):
            n = int(min(max(rng.lognormal(np.log(median_words), sigma), 2), max_words))
            fh.write(json.dumps({"text": " ".join(rng.choice(vocab, n))}) + "\n")
    return str(path)


def bench(cfg_dict: dict, steps: int) -> dict | None:
    import torch
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.parallel.balanced_loader import BalancedBatches
    from meshfold.train.trainer import Trainer

    torch.set_num_threads(1)
    balanced = Trainer(from_dict(cfg_dict))
    naive = Trainer(from_dict(cfg_dict))
    naive.features.of_type(BalancedBatches).method = "none"  # same documents, token-equal contiguous split
    times = {"balanced": [], "naive": []}
    cpu = {"balanced": [], "naive": []}  # per step: every rank's main-thread CPU seconds
    stats = {"balanced": [], "naive": []}
    for step in range(steps + 1):
        for name, tr in (("naive", naive), ("balanced", balanced)) if step % 2 else \
                (("balanced", balanced), ("naive", naive)):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            tr.train_step()
            mine = torch.tensor([time.thread_time() - start_cpu], dtype=torch.float64)
            dist.barrier()
            wall = time.perf_counter() - start
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            if step:  # the first step of each warms up
                times[name].append(wall)
                cpu[name].append([float(x) for x in every])
                stats[name].append(tr.pop_step_metrics())
    if dist.get_rank() != 0:
        return None
    cost = balanced.features.of_type(BalancedBatches).cost
    return {"times": times, "cpu": cpu, "stats": stats, "a": cost.a, "b": cost.b}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", nargs="+", default=["default", "lognormal"], choices=["default", "lognormal"])
    ap.add_argument("--seq", type=int, default=2048, help="model.seq_len: longest document piece")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8, help="step budget = global_batch * seq tokens")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cost-a", type=float, default=0.0)
    ap.add_argument("--cost-b", type=float, default=0.0)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seq-cp", type=int, default=1, help="data.seq_cp_max for the balanced side (per-sequence cp)")
    ap.add_argument("--max-tokens", type=int, default=0, help="data.max_tokens (per-rank token limit)")
    args = ap.parse_args()

    from meshfold.testing import run_on

    tmp = Path(tempfile.mkdtemp(prefix="meshfold-balance-"))
    if not (args.cost_a or args.cost_b):
        # Measured once here (one process, before the gloo ranks start), then pinned.
        from meshfold.config import ModelConfig
        from meshfold.data.cost_calibration import default_lengths, measure_cost

        torch.set_num_threads(1)
        model = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2, vocab_size=512,
                            seq_len=args.seq)
        fit = measure_cost(model, lengths=default_lengths(args.seq, 5), repeats=2)
        args.cost_a, args.cost_b = fit.a, fit.b
        print(f"calibrated: W(l) = {fit.a:.3e} l^2 + {fit.b:.3e} l (overhead {fit.c:.2e} s per micro-batch; "
              f"largest fit error {fit.rel_error():.0%})", flush=True)
    for dist_name in args.dist:
        source = "default" if dist_name == "default" else lognormal_corpus(tmp / "lognormal.jsonl", 600)
        cfg = {
            "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
                      "seq_len": args.seq},
            "parallel": {"dp_replicate": args.nproc, "dp_shard": 1},
            "train": {"global_batch": args.global_batch, "dtype": "float32", "run_dir": str(tmp / dist_name),
                      "progress": False, "tensorboard": False, "steps": args.steps + 1},
            "data": {"source": source, "val_docs": 0, "balance": "greedy", "cost_a": args.cost_a,
                     "cost_b": args.cost_b, "seq_cp_max": args.seq_cp, "max_tokens": args.max_tokens},
        }
        started = time.perf_counter()
        out = run_on(args.nproc, bench, cfg, args.steps, timeout=1800)[0]
        t_bal, t_naive = statistics.median(out["times"]["balanced"]), statistics.median(out["times"]["naive"])
        mean = lambda key, name: statistics.mean(s[key] for s in out["stats"][name])  # noqa: E731
        print(f"[{dist_name}] {args.nproc} gloo processes, seq_len {args.seq}, dim {args.dim}, {args.layers} layers, "
              f"{args.global_batch * args.seq} tokens/step budget, seq_cp_max {args.seq_cp}; W(l) = {out['a']:.3e} l^2 + {out['b']:.3e} l")
        print(f"  lambda W      before {mean('imbalance_before', 'balanced'):.3f}  after "
              f"{mean('imbalance', 'balanced'):.3f}   (naive run: {mean('imbalance', 'naive'):.3f})")
        print(f"  lambda tokens before {mean('imbalance_tokens_before', 'balanced'):.3f}  after "
              f"{mean('imbalance_tokens', 'balanced'):.3f}")
        # Compute time per rank (main-thread CPU seconds: forward, backward, optimizer; not
        # time spent waiting for a core or for peers). With one core per rank the step lasts
        # as long as the slowest rank's compute: max over ranks.
        crit = {k: statistics.median(max(r) for r in v) for k, v in out["cpu"].items()}
        work = {k: statistics.median(sum(r) / len(r) for r in v) for k, v in out["cpu"].items()}
        lam = {k: statistics.mean(max(r) / (sum(r) / len(r)) for r in v) for k, v in out["cpu"].items()}
        print(f"  measured compute lambda (max/mean rank CPU time)  naive {lam['naive']:.3f}  balanced "
              f"{lam['balanced']:.3f}")
        print(f"  slowest rank's compute per step  naive {crit['naive']:.3f} s   balanced {crit['balanced']:.3f} s   "
              f"speed-up {crit['naive'] / crit['balanced']:.2f}x   (mean rank: {work['naive']:.3f} vs "
              f"{work['balanced']:.3f} s)")
        print(f"  wall-clock median step           naive {t_naive:.3f} s   balanced {t_bal:.3f} s   "
              f"ratio {t_naive / t_bal:.2f}x ({len(out['times']['balanced'])} steps each; {args.nproc} processes "
              f"share this machine's cores; run wall {time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
