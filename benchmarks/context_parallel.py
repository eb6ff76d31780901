"""Context parallel: activation memory per rank, bytes sent per layer, causal balance.

For cp = 1, 2, 4 at one fixed sequence length, every rank runs one forward+backward of a
small Llama on its slice of a packed sequence (real gloo processes) and reports

* the activation bytes autograd keeps for backward (``meshfold/memory.py``: saved-tensor hooks,
  one count per storage, parameters excluded), as a ratio to cp = 1 (ideal 1/cp);
* the cp bytes it sent (comm ledger) per layer, next to the formulas (docs/context_parallel.md):
    ring     per layer: (3R-2) * 2 b (S/R) (Hkv'/U) d e   (forward R-1 k/v sends; backward R-1 k/v + R dk/dv)
    Ulysses  per layer: 2 (U-1)/U * b (S/cp) d e (2H + 2Hkv')  (q, k, v, out and their gradients)
  with Hkv' = Hkv, or U when the kv heads are fewer than U (repeated), and cp = U x R;
  plus one metadata all-gather per forward: (cp-1) * 2 b (S/cp) * 8 bytes;
* the visible (query, key) score entries per rank, balanced vs contiguous (max / mean).

The cp = 1 baseline runs the same tiled attention kernel in this process.

    .venv/bin/python benchmarks/context_parallel.py [--seq 1024] [--dim 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def measure(seq: int, dim: int, layers: int, mode: str, balance: bool, doc_mask: bool) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshfold.comm import reset_ledger
    from meshfold.config import Config, ModelConfig, ParallelConfig
    from meshfold.mesh import build_mesh
    from meshfold.models.llama import Transformer, init_weights
    from meshfold.parallel.cp.attention import ContextParallelAttention, _MetaCache
    from meshfold.parallel.cp.batch import shard_batch
    from meshfold.parallel.cp.groups import ContextParallelPlan
    from meshfold.parallel.cp.plan import apply_context_parallel
    from meshfold.memory import count_saved_activations

    torch.set_num_threads(1)
    cp = dist.get_world_size() if dist.is_initialized() else 1
    cfg = Config(model=ModelConfig(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=2, vocab_size=512, seq_len=seq),
                 parallel=ParallelConfig(cp=cp, dp_shard=1, cp_mode=mode, cp_balance=balance))
    model = Transformer(cfg.model)
    init_weights(model, cfg.model, seed=0)
    if cp > 1:
        plan = apply_context_parallel(model, cfg, build_mesh(cfg.parallel))
    else:
        plan = ContextParallelPlan(1, 1, balance, 0, None, None, None)
        cache = _MetaCache(plan)
        for block in model.layers.values():
            block.attention.core = ContextParallelAttention(plan, cache)

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (1, seq + 1), generator=gen)
    # Packed documents of random lengths (mean seq/8) when masking by document.
    cuts = torch.cumsum(torch.randint(1, seq // 4, (seq,), generator=gen), 0)
    docs = torch.bucketize(torch.arange(seq + 1), cuts[cuts < seq]).unsqueeze(0)
    batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:], "doc_ids": docs[:, :-1]}
    batch = shard_batch(batch, plan) if cp > 1 else {**batch, "positions": torch.arange(seq).unsqueeze(0)}

    ledger = reset_ledger()
    with count_saved_activations(model) as saved:
        logits = model(batch["inputs"], positions=batch["positions"],
                       doc_ids=batch["doc_ids"] if doc_mask else None)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
    loss.backward()
    w = plan.work
    return {"saved": saved.bytes, "cp_bytes": ledger.total.get("cp", 0.0), "visible": w.visible,
            "tiles": w.tiles, "skipped": w.skipped_tiles, "ulysses": plan.ulysses}


def formulas(seq: int, dim: int, cp: int, ulysses: int, b: int = 1, e: int = 4) -> tuple[float, float]:
    """(per-layer bytes, metadata bytes per forward) one rank sends."""
    H, Hkv = 8, 2
    d = dim // H
    R, U = cp // ulysses, ulysses
    hkv_sent = Hkv if Hkv % U == 0 else U  # kv heads are repeated when fewer than U
    layer = 0.0
    if U > 1:
        layer += 2 * (U - 1) / U * b * (seq // cp) * d * e * (2 * H + 2 * hkv_sent)
    if R > 1:  # after the all-to-all a rank holds hkv_sent / U kv heads of S/R tokens
        layer += (3 * R - 2) * 2 * b * (seq // R) * (hkv_sent // U) * d * e
    meta = (cp - 1) * 2 * b * (seq // cp) * 8
    return layer, meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    from meshfold.testing import run_on

    S, D, L = args.seq, args.dim, args.layers
    print(f"model: dim {D}, {L} layers, 8 heads / 2 kv heads, float32; one packed sequence of {S} tokens\n")

    base = measure(S, D, L, "ring", True, True)
    print("activation memory per rank (saved for backward, document masks on)")
    print(f"{'layout':<22}{'max MiB':>10}{'ratio to cp1':>14}{'ideal':>8}")
    print(f"{'cp1':<22}{base['saved'] / 2**20:>10.2f}{1.0:>14.3f}{1.0:>8.3f}")
    rows = []
    for cp in (2, 4):
        for mode in ("ring", "ulysses", "hybrid"):
            if mode == "hybrid" and cp == 2:
                continue
            res = run_on(cp, measure, S, D, L, mode, True, True)
            top = max(r["saved"] for r in res)
            print(f"{f'cp{cp} {mode}':<22}{top / 2**20:>10.2f}{top / base['saved']:>14.3f}{1 / cp:>8.3f}")
            rows.append((cp, mode, res))

    print("\nbytes sent per rank for cp (forward + backward), measured by the comm ledger vs formula")
    print(f"{'layout':<22}{'U x R':>7}{'per layer KiB':>15}{'formula KiB':>13}{'total/formula':>15}")
    for cp, mode, res in rows:
        u = res[0]["ulysses"]
        layer, meta = formulas(S, D, cp, u)
        sent = max(r["cp_bytes"] for r in res)
        per_layer = (sent - meta) / L
        print(f"{f'cp{cp} {mode}':<22}{f'{u}x{cp // u}':>7}{per_layer / 1024:>15.1f}{layer / 1024:>13.1f}"
              f"{sent / (L * layer + meta):>15.4f}")

    print("\ncausal attention work per rank (visible score entries), ring, no document mask")
    for cp in (2, 4):
        for balance in (True, False):
            res = run_on(cp, measure, S, D, L, "ring", balance, False)
            vis = [r["visible"] for r in res]
            mean = sum(vis) / len(vis)
            name = "balanced" if balance else "contiguous"
            print(f"cp{cp} {name:<11} per rank {vis}  max/mean {max(vis) / mean:.3f}  max/min {max(vis) / min(vis):.3f}")
    res = run_on(4, measure, S, D, L, "ring", True, True)
    skipped = sum(r["skipped"] for r in res) / sum(r["tiles"] for r in res)
    print(f"\ncp4 ring balanced with document masks: {skipped:.1%} of attention tiles skipped (fully masked)")


if __name__ == "__main__":
    main()
