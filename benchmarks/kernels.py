"""Fused kernels on the hot paths (issue 18): ratios measured in one run on this machine.

1. Packed documents, seq 4096, ~100-token documents (50-150), a 2-layer model, forward +
   backward, float32: training tokens/s of the model as built (``Transformer(cfg)`` given
   ``doc_ids``, the trainer's default ``data.pack`` + ``data.doc_mask`` path: windowed
   per-document tiles, no S x S mask) against plain causal attention over the same tokens
   (goal >= 1.0x), next to ``VarlenCoreAttention``, the dense-mask SDPA path (the default
   before issue 26), the cp = 1 block-skipping ring tiles
   and the previous varlen implementation (per row, per length, host reads).
2. MoE step time (forward + backward, float32) against a dense model of equal active FLOPs:
   64 experts top-8 each 1/8 as wide (goal <= 1.3x) and 8 experts top-2 each 1/2 as wide
   (goal <= 1.15x); grouped GEMM (``torch._grouped_mm``), the same with CUDA's 16-byte group
   padding (the CPU's layout before issue 47) and the previous per-expert loop.
3. Ring attention at seq 8192 (b 1, 8 query / 2 key-value heads of 64, float32, causal,
   balanced), forward + backward on cp = 2 and 4 gloo processes: per-rank time and peak
   extra resident memory of the attention call, for the fused ring and for the previous
   tiled ring (loaded from git ``--baseline-rev``), against one-process SDPA on the whole
   sequence. Each configuration runs in fresh processes (peak RSS is per process).

Variants alternate step by step so machine noise hits all of them; medians are printed.
``--clock cpu`` times sections 1-2 by this process's CPU time on one thread: on a machine
shared with other jobs the load stretches wall time by 10x and more, CPU time much less.

    .venv/bin/python benchmarks/kernels.py [--steps 5] [--only docs moe window ring] [--clock cpu]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from meshfold.config import ModelConfig  # noqa: E402
from meshfold.models import attention_ops, moe_experts  # noqa: E402
from meshfold.models.llama import CoreAttention, Transformer, init_weights  # noqa: E402


CLOCK = time.perf_counter  # --clock cpu: time.process_time (this process's CPU time, 1 thread)


def _median_times(fns: dict, steps: int) -> dict:
    times = defaultdict(list)
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(steps):
        for name, fn in fns.items():
            t0 = CLOCK()
            fn()
            times[name].append(CLOCK() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


# --------------------------------------------------------------------------- 1. packed documents


class _PreviousVarlen(torch.nn.Module):
    """The varlen attention before issue 18: per row, spans grouped by exact length, host reads."""

    def forward(self, q, k, v, positions=None, doc_ids=None):
        rows = []
        for row in range(q.shape[0]):
            values, counts = torch.unique_consecutive(doc_ids[row], return_counts=True)
            spans, start = [], 0
            for c in counts.tolist():
                spans.append((start, c))
                start += c
            by_len = defaultdict(list)
            for s, n in spans:
                by_len[n].append(s)
            pieces = {}
            for n, starts in by_len.items():
                def take(t):
                    return torch.stack([t[row, s: s + n] for s in starts]).transpose(1, 2)
                o = F.scaled_dot_product_attention(take(q), take(k), take(v), is_causal=True,
                                                   enable_gqa=q.shape[2] != k.shape[2])
                for j, s in enumerate(starts):
                    pieces[s] = o[j].transpose(0, 1)
            rows.append(torch.cat([pieces[s] for s, _ in spans], dim=0))
        return torch.stack(rows)


def bench_docs(steps: int, quick: bool = False) -> dict:
    from meshfold.models.varlen_attention import VarlenCoreAttention
    from meshfold.parallel.cp.attention import ContextParallelAttention, _MetaCache
    from meshfold.parallel.cp.groups import ContextParallelPlan

    seq, batch = 4096, 2
    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=1024, seq_len=seq, ffn_dim=512)
    rng = random.Random(0)
    docs, pos = [], []
    for _ in range(batch):
        lens = []
        while sum(lens) < seq:
            lens.append(rng.randint(50, 150))
        lens[-1] -= sum(lens) - seq
        docs.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)))
        pos.append(torch.cat([torch.arange(n) for n in lens]))
    doc_ids, positions = torch.stack(docs), torch.stack(pos)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))

    def model_with(core_factory):
        torch.manual_seed(0)
        m = Transformer(cfg)
        init_weights(m, cfg, 0)
        for block in m.layers.values():
            block.attention.core = core_factory()
        return m

    plan = ContextParallelPlan(1, 1, False, 0, None, None, None)
    cache = _MetaCache(plan)
    def as_built():  # the default config path: Transformer(cfg) untouched, doc_ids given
        torch.manual_seed(0)
        m = Transformer(cfg)
        init_weights(m, cfg, 0)
        return m

    variants = {
        "causal (no documents)": (as_built(), False),
        "documents: default (CoreAttention as built)": (as_built(), True),
        "documents: VarlenCoreAttention": (model_with(VarlenCoreAttention), True),
        "documents: dense mask SDPA (before)": (model_with(lambda: CoreAttention(dense=True)), True),
        "documents: cp=1 ring tiles (skip_masked_blocks)": (model_with(lambda: ContextParallelAttention(plan, cache)),
                                                            True),
        "documents: previous varlen": (model_with(_PreviousVarlen), True),
    }
    if quick:  # --docs-quick: the default path against causal and the dense mask it replaced
        variants = {k: v for k, v in variants.items() if "ring" not in k and "previous" not in k}

    def step(model, with_docs):
        def run():
            kw = {"positions": positions, "doc_ids": doc_ids} if with_docs else {}
            model(tokens, **kw).float().logsumexp(-1).mean().backward()
        return run

    t = _median_times({k: step(*v) for k, v in variants.items()}, steps)
    base = t["causal (no documents)"]
    print(f"\n1. packed documents, seq {seq}, batch {batch}, ~100-token docs, 2 layers dim 256, fwd+bwd, fp32")
    print(f"{'variant':52s} {'s/step':>8s} {'tokens/s':>9s} {'vs causal':>9s}")
    for k, v in t.items():
        print(f"{k:52s} {v:8.3f} {batch * seq / v:9.0f} {base / v:8.2f}x")
    return t


# --------------------------------------------------------------------------- 2. MoE


def _previous_experts_forward(self, x, counts, groups=None, gates=None):
    """Before issue 18: one expert at a time after a host read of the counts (the gates
    applied where the current kernel applies them, so only the expert loop differs)."""
    from meshfold.models.moe_experts import _local

    w1, w3 = _local(self.w13).chunk(2, dim=1)
    w2 = _local(self.w2)
    outs = []
    for e, chunk in enumerate(torch.split(x, counts.tolist())):
        h = F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())
        outs.append(h @ w2[e].t())
    y = torch.cat(outs)
    return y if gates is None else y * gates[:, None]


def _padded_groups(self, x, w1, w2, counts, groups, gates, biases=None):
    """``GroupedExperts._grouped`` with CUDA's 16-byte group padding, as the CPU ran it before
    issue 47 (the padded layout's copies in and out of the grouped GEMM)."""
    align = max(1, moe_experts.GROUP_ALIGN_BYTES // x.element_size())
    groups = moe_experts._Groups(counts, x.shape[0], "grouped_mm", align=align)
    x = moe_experts._ScatterRows.apply(x, groups.dest, groups.padded_rows)
    gates = moe_experts._ScatterRows.apply(gates, groups.dest, groups.padded_rows)
    return self._run(x, w1, w2, groups, gates, biases).index_select(0, groups.dest)


def bench_moe(steps: int) -> dict:
    seq, batch, dim, hidden = 512, 8, 256, 1024
    base = dict(dim=dim, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=1024, seq_len=seq, ffn_dim=hidden)
    configs = {
        "dense": ModelConfig(**base),
        "64 experts top-8 (1/8 wide)": ModelConfig(**base, moe_experts=64, moe_topk=8, moe_ffn_dim=hidden // 8),
        "8 experts top-2 (1/2 wide)": ModelConfig(**base, moe_experts=8, moe_topk=2, moe_ffn_dim=hidden // 2),
    }
    tokens = torch.randint(0, 1024, (batch, seq))
    fns = {}
    for name, cfg in configs.items():
        impls = ("padded bmm", "grouped_mm", "grouped_mm, 16-byte groups", "previous loop")
        for impl in (("grouped",) if name == "dense" else impls):
            torch.manual_seed(0)
            m = Transformer(cfg)
            init_weights(m, cfg, 0)
            for mod in m.modules():
                if type(mod).__name__ == "GroupedExperts":
                    if impl == "previous loop":  # rows sorted by expert, then the loop
                        mod.kernel = "grouped_mm"
                        mod.forward = types.MethodType(_previous_experts_forward, mod)
                    elif impl.endswith("16-byte groups"):  # CUDA's padded groups (on the CPU before #47)
                        mod.kernel = "grouped_mm"
                        mod._grouped = types.MethodType(_padded_groups, mod)
                    else:
                        mod.kernel = impl.replace(" ", "_")

            def run(m=m):
                m(tokens).logsumexp(-1).mean().backward()
                m.zero_grad(set_to_none=True)
            fns[name if name == "dense" else f"{name}, {impl}"] = run
    t = _median_times(fns, steps)
    print(f"\n2. MoE vs dense at equal active FLOPs: seq {seq}, batch {batch}, dim {dim}, dense ffn {hidden}, "
          "2 layers, fwd+bwd, fp32")
    print(f"{'variant':48s} {'s/step':>8s} {'vs dense':>9s}")
    for k, v in t.items():
        print(f"{k:48s} {v:8.3f} {v / t['dense']:8.2f}x")
    return t


# --------------------------------------------------------------------------- 3. ring attention


def _baseline_context(rev: str):
    """parallel/context.py as of ``rev`` (the tiled ring before issue 18), as a module."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:meshfold/parallel/context.py"],
                         capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType("meshfold_context_baseline")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, "context_baseline.py", "exec"), mod.__dict__)
    return mod


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _ring_worker(rank, world, variant, seq, reps, rev, init, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if variant == "previous":
        ctx = _baseline_context(rev)
    else:
        from meshfold.parallel.cp import attention, batch, groups
        ctx = types.SimpleNamespace(ContextParallelPlan=groups.ContextParallelPlan, _MetaCache=attention._MetaCache,
                                    ContextParallelAttention=attention.ContextParallelAttention,
                                    token_indices=batch.token_indices)
    b, H, Hkv, d = 1, 8, 2, 64
    group = dist.group.WORLD
    plan = ctx.ContextParallelPlan(world, 1, True, rank, group, None, group)
    core = ctx.ContextParallelAttention(plan, ctx._MetaCache(plan))
    idx = ctx.token_indices(seq, world, rank, 1, True)
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(b, len(idx), H, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, len(idx), Hkv, d, generator=gen, requires_grad=True) for _ in range(2))
    pos = idx.unsqueeze(0).contiguous()
    dout = torch.randn(b, len(idx), H, d, generator=gen)
    before = _rss_mib()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        core(q, k, v, positions=pos).backward(dout)
        times.append(time.perf_counter() - t0)
    peak = _rss_mib() - before
    res = torch.tensor([statistics.median(times), peak], dtype=torch.float64)
    gathered = [torch.zeros_like(res) for _ in range(world)]
    dist.all_gather(gathered, res)
    if rank == 0:
        torch.save(torch.stack(gathered), out)
    dist.destroy_process_group()


def _one_process_sdpa(seq, reps, out):
    torch.set_num_threads(1)
    b, H, Hkv, d = 1, 8, 2, 64
    q = torch.randn(b, H, seq, d, requires_grad=True)
    k, v = (torch.randn(b, Hkv, seq, d, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, H, seq, d)
    before = _rss_mib()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)
        times.append(time.perf_counter() - t0)
    torch.save(torch.tensor([[statistics.median(times), _rss_mib() - before]], dtype=torch.float64), out)


def bench_ring(seq: int, reps: int, rev: str, variants=("fused", "previous")) -> dict:
    import torch.multiprocessing as mp

    print(f"\n3. ring attention, seq {seq}, b 1, 8 q / 2 kv heads of 64, fp32, causal balanced, fwd+bwd, "
          "1 thread per process, median of per-rank medians")
    print(f"{'variant':34s} {'s (max rank)':>12s} {'peak extra MiB/rank (max)':>26s}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.pt")
        p = mp.get_context("spawn").Process(target=_one_process_sdpa, args=(seq, reps, out))
        p.start()
        p.join()
        r = torch.load(out)
        results["one process SDPA"] = r
        print(f"{'one process SDPA (whole seq)':34s} {r[0, 0]:12.3f} {r[0, 1]:26.0f}")
        for cp in (2, 4):
            for variant in variants:
                init = f"file://{tmp}/store_{cp}_{variant}"
                mp.spawn(_ring_worker, args=(cp, variant, seq, reps, rev, init, out), nprocs=cp)
                r = torch.load(out)
                results[f"cp {cp} {variant}"] = r
                print(f"{'ring cp ' + str(cp) + ' ' + variant:34s} {r[:, 0].max():12.3f} {r[:, 1].max():26.0f}")
    return results


# --------------------------------------------------------------------------- 4. sliding windows


def bench_window(steps: int, seq: int = 8192, window: int = 1024) -> dict:
    """Sliding-window attention (window 1,024 of 8,192 on a CPU: the issue's 4,096 of 32,768
    scaled by 4) against full causal attention over the same tokens, forward + backward, one
    row, 8 query heads over 2 kv heads of 64: meshfold's banded tiles (``window_attention``
    on plain rows), the banded [S, S] mask it replaced, and plain causal SDPA."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, h, 64, generator=g).requires_grad_() for h in (8, 2, 2))
    dout = torch.randn(1, seq, 8, 64, generator=g)

    def run(fn):
        def step():
            fn().backward(dout)
        return step

    def band_mask():
        mask = attention_ops.window_mask(seq, window, q.device)
        return attention_ops.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask).transpose(1, 2)

    fns = {"full causal": run(lambda: F.scaled_dot_product_attention(
               q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)),
           "window, banded tiles": run(lambda: attention_ops.window_attention(q, k, v, window)),
           "window, [S, S] band mask": run(band_mask)}
    times = _median_times(fns, steps)
    full = times["full causal"]
    print(f"\n== sliding window {window} of {seq}, fwd + bwd, median of {steps}")
    for name, t in times.items():
        print(f"  {name:28s} {t * 1e3:8.1f} ms   {seq / t:10.0f} tokens/s   {full / t:5.2f}x full causal")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--docs-quick", action="store_true", help="docs: only causal, the default path, varlen, dense")
    ap.add_argument("--only", nargs="*", default=["docs", "moe", "window", "ring"])
    ap.add_argument("--seq", type=int, default=8192, help="ring attention sequence length")
    ap.add_argument("--baseline-rev", default="8e01949", help="git revision of the previous ring (tiles)")
    ap.add_argument("--ring-variants", nargs="*", default=["fused", "previous"],
                    help="ring implementations to run: fused (current) and/or previous (tiles at --baseline-rev)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: one thread, time = this process's CPU time (robust to a machine shared with "
                         "other jobs, whose load only stretches wall time); docs and moe only")
    args = ap.parse_args()
    if args.clock == "cpu":
        global CLOCK
        CLOCK = time.process_time
        torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    if "docs" in args.only:
        bench_docs(args.steps, args.docs_quick)
    if "moe" in args.only:
        bench_moe(args.steps)
    if "window" in args.only:
        bench_window(args.steps)
    if "ring" in args.only:
        bench_ring(args.seq, max(2, args.steps // 2), args.baseline_rev, args.ring_variants)


if __name__ == "__main__":
    main()
