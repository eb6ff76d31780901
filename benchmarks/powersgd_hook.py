"""PowerSGD's DDP hook, before and after issue 16: per-step time on 4 gloo ranks, one run.

    python benchmarks/powersgd_hook.py                     # 12 layers of 256 x 256, 3 repeats
    python benchmarks/powersgd_hook.py --layers 24 --dim 512 --steps 20 --repeats 5

Three hooks on the same DDP model (several buckets, ``bucket_cap_mb`` 1), same rank:

- ``old``: the hook before issue 16: per matrix two blocking all-reduces (P, then Q), the
  uncompressed tensors in one more, and an already-finished future;
- ``new``: ``meshfold.lowcomm.compress`` today: all P with the uncompressed tensors in one
  all-reduce, all Q in one, on the codec's communication thread (unfinished future);
- ``torch``: PyTorch's ``powerSGD_hook`` (no L-GreCo), for reference, with ONE bucket: with
  several buckets on gloo it fails with a collective mismatch (its Q all-reduce is issued
  from the callback of the P all-reduce, on whichever thread completed it, so the ranks
  issue the buckets' collectives in different orders; measured: "Received data size doesn't
  match expected size"). meshfold's hook keeps the hook order on one thread instead.

``new-1`` is ``new`` with one bucket, to compare with ``torch`` at equal bucketing.

Per-step time = forward + backward (DDP waits for the hook's futures at the end of
backward), median over ``--steps`` steps after 3 warm-up steps; each repeat runs the
three hooks in turn and the script prints the old/new ratio per repeat and their median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORLD = 4


class LegacyPowerSGD:
    """The per-matrix PowerSGD of meshfold before issue 16 (same maths, same state)."""

    def __init__(self, group, rank: int, seed: int = 0):
        from meshfold.lowcomm.codecs.powersgd import PowerSGD

        self.inner = PowerSGD(group, rank, seed)  # reused for state, Q init and helpers

    def reduce(self, named) -> None:
        import torch

        from meshfold.lowcomm.codecs.base import all_reduce_mean as _all_reduce_mean
        from meshfold.lowcomm.codecs.powersgd import orthogonalize as _orthogonalize

        c = self.inner
        dense = []
        for name, g in named:
            r = c.rank_of(name, g.shape)
            if not c.compressible(g, r):
                dense.append(g)
                continue
            work = c._power_begin(name, g, r)  # M = G + E, P = M Q with the warm-started Q
            mat, comp = work["mat"], work["m"]
            p = _all_reduce_mean(work["p"], c.group)  # blocking, one per matrix
            p = _orthogonalize(p)
            q = comp.t() @ p
            _all_reduce_mean(q, c.group)  # blocking, one per matrix
            approx = p @ q.t()
            c.state[name]["q"] = q
            c.state[name]["error"] = comp - approx
            mat.copy_(approx)
        if dense:
            flat = torch.cat([d.flatten() for d in dense])
            _all_reduce_mean(flat, c.group)
            offset = 0
            for d in dense:
                d.copy_(flat[offset: offset + d.numel()].view_as(d))
                offset += d.numel()


def _legacy_hook(state, bucket):
    import torch

    named = [(state["names"][id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients())]
    state["codec"].reduce(named)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _measure(kind: str, layers: int, dim: int, rank_r: int, steps: int) -> float:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshfold.config import LowCommConfig
    from meshfold.lowcomm.compress import DDPCompression

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    ddp = DDP(model, bucket_cap_mb=1024 if kind in ("torch", "new-1") else 1)
    group = dist.group.WORLD
    if kind in ("new", "new-1"):
        DDPCompression(LowCommConfig(compression="powersgd", powersgd_rank=rank_r)).install(ddp, group)
    elif kind == "old":
        names = {id(p): n for n, p in model.named_parameters()}
        ddp.register_comm_hook({"codec": LegacyPowerSGD(group, rank_r), "names": names}, _legacy_hook)
    else:
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank_r, start_powerSGD_iter=2,
                                   min_compression_rate=1, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    x = torch.randn(32, dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for step in range(steps + 3):
        dist.barrier()
        start = time.perf_counter()
        ddp(x).square().mean().backward()
        elapsed = time.perf_counter() - start
        if step >= 3:
            times.append(elapsed)
        for p in model.parameters():
            p.grad = None
    # the slowest rank sets the step time
    t = torch.tensor([statistics.median(times)], device="cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _all_kinds(layers: int, dim: int, rank_r: int, steps: int) -> dict[str, float]:
    return {kind: _measure(kind, layers, dim, rank_r, steps) for kind in ("old", "new", "new-1", "torch")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from meshfold.testing import run_on

    ratios = []
    for rep in range(args.repeats):
        res = run_on(WORLD, _all_kinds, args.layers, args.dim, args.rank, args.steps)[0]
        ratios.append(res["old"] / res["new"])
        print(f"repeat {rep}: per-step ms  old {res['old'] * 1e3:.1f}  new {res['new'] * 1e3:.1f}  "
              f"| one bucket: new {res['new-1'] * 1e3:.1f}  torch powerSGD_hook {res['torch'] * 1e3:.1f}  "
              f"| old/new {ratios[-1]:.2f}x  torch/new (one bucket) {res['torch'] / res['new-1']:.2f}x", flush=True)
    print(f"powersgd_hook: {WORLD} gloo ranks, {args.layers} x Linear({args.dim}, {args.dim}), rank {args.rank}: "
          f"old/new median {statistics.median(ratios):.2f}x over {args.repeats} repeats")


if __name__ == "__main__":
    main()
