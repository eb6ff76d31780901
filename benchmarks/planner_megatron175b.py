"""Predicted GPT-3 175B step times for Megatron's own layout (tp 8 x pp 8 x data parallel)
against the iteration times Megatron-LM published, and meshfold's PTD-P against ZeRO-3.

Published: Narayanan et al., SC 2021, Table 2 ("PTD-P vs ZeRO-3", 174.6B parameters,
batch 1536, s = 2048, A100 80GB, micro-batch 1 for PTD-P): achieved TFLOP/s per GPU at
384, 768 and 1536 GPUs. The iteration time is Eq. (3)'s FLOPs / (TFLOP/s x GPUs).

For each row the script prints the planner's step time for
- ``megatron``: the layout Megatron runs (DDP zero 0 across replicas, as Table 1's test);
- ``ptdp-z1``: meshfold's PTD-P with the distributed optimizer (tp x pp x dp_shard, zero 1);
- ``ptdp-z2``/``ptdp-z3``: tp x pp x FSDP (what meshfold could run before issue 17);
- ``zero3``: ZeRO-3 without model parallelism at Table 2's micro-batch sizes;
and each one's ratio to the published iteration time.

    python benchmarks/planner_megatron175b.py [--json]
"""

from __future__ import annotations

import argparse
import json

from meshfold.config import ModelConfig
from meshfold.planner.cluster import load_cluster
from meshfold.planner.cost import Layout, Workload, estimate, megatron_flops_per_iteration

# (GPUs, PTD-P TFLOP/s per GPU, ZeRO-3 TFLOP/s per GPU, ZeRO-3 micro-batch), batch 1536
TABLE2 = [(384, 153, 144, 4), (768, 149, 88, 2), (1536, 141, 44, 1)]
H, A, LAYERS, S, V, BATCH = 12288, 96, 96, 2048, 51200, 1536


def rows() -> list[dict]:
    m = ModelConfig(dim=H, n_layers=LAYERS, n_heads=A, vocab_size=V, seq_len=S, norm="layernorm", mlp="gelu",
                    bias=True, pos="learned", tie_embeddings=True)
    w = Workload(m, BATCH, dtype="bf16", flash=False, dropout=True)
    flops = megatron_flops_per_iteration(BATCH, S, LAYERS, H, V)
    out = []
    for gpus, ptdp, zero3, zero3_mb in TABLE2:
        c = load_cluster("a100", devices=gpus)
        d = gpus // 64
        published = flops / (ptdp * 1e12 * gpus)
        layouts = {
            "megatron": Layout(dp_replicate=d, tp=8, pp=8, micro_batch=1, recompute="full"),
            "ptdp-z1": Layout(dp_shard=d, zero=1, tp=8, pp=8, micro_batch=1, recompute="full"),
            "ptdp-z2": Layout(dp_shard=d, zero=2, tp=8, pp=8, micro_batch=1, recompute="full"),
            "ptdp-z3": Layout(dp_shard=d, zero=3, tp=8, pp=8, micro_batch=1, recompute="full"),
            "zero3": Layout(dp_shard=gpus, zero=3, micro_batch=zero3_mb, recompute="full"),
        }
        row = {"gpus": gpus, "micro_batches": BATCH // d, "published_s": published,
               "published_zero3_s": flops / (zero3 * 1e12 * gpus)}
        for name, lay in layouts.items():
            e = estimate(w, c, lay)
            row[name] = {"step_s": e.step_time_s, "ratio": e.step_time_s / published, "fits": e.fits}
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = rows()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    names = ["megatron", "ptdp-z1", "ptdp-z2", "ptdp-z3", "zero3"]
    print(f"{'GPUs':>5} {'mb':>4} {'published s':>11} " + " ".join(f"{n + ' s (x)':>17}" for n in names)
          + f" {'pub. zero3 s':>12}")
    for r in out:
        print(f"{r['gpus']:>5} {r['micro_batches']:>4} {r['published_s']:>11.2f} "
              + " ".join(f"{r[n]['step_s']:>9.2f} ({r[n]['ratio']:.2f})" for n in names)
              + f" {r['published_zero3_s']:>12.2f}")


if __name__ == "__main__":
    main()
