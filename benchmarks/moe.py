"""MoE benchmarks: all-to-all bytes against the formula, and MoE vs dense step time.

1. All-to-all bytes. Real ``Trainer`` steps with expert parallel on gloo processes; the
   bytes the ledger records under "ep" for global rank 0 are compared with

       exact:    per MoE layer, 2 * (S + R) * dim * b  +  (ep - 1) * (E/ep) * 8
                 S = rows this rank sends to other ranks (its assignments to remote experts),
                 R = rows it receives from other ranks; each crosses once in the forward
                 (dispatch, combine) and once in the backward; b = bytes per element;
                 the second term is the exchange of per-expert row counts (int64)
       balanced: S = R = T * k * (ep - 1) / ep  (T tokens on the rank), what a perfectly
                 balanced router would send: 4 * T * k * (ep-1)/ep * dim * b per layer

   S and R are read from the routing decisions themselves (a forward hook on the
   dispatcher), so "exact" must equal the measurement; "balanced" shows what imbalance
   costs.

2. Step time, MoE vs dense at equal active parameters, one process, float32: a dense
   model with ffn_dim = k * expert_dim against an MoE with E experts of expert_dim each,
   top-k (same active FFN parameters per token, plus the router). Steps alternate between
   the two so machine noise hits both; the ratio of median step times is printed.

3. Exposed expert all-to-all, with and without overlap (``parallel.ep_overlap_chunks``):
   ep 4 on gloo, one process per network namespace of ``meshfold netlab`` (root), every
   link shaped to --rate-mbit. Each rank runs a stack of MoE blocks (the real ``MoE`` with
   its experts sliced to the rank and the real ``AllToAllDispatcher``) forward and
   backward; the chunk counts alternate step by step so machine noise hits each alike.
   Per chunk count, medians over the steps of rank 0:

       step      wall-clock of one forward + backward of the stack
       blocked   time the rank spent blocked in the ep all-to-alls: inside a synchronous
                 all-to-all (chunks 1, and the dropless per-chunk counts) or in ``wait()``
                 on an asynchronous one (chunks > 1); ``comm.timer().wait_s``. This is the
                 exposed all-to-all time: what the step waits for the wire
       ratio     each against chunks 1

    .venv/bin/python benchmarks/moe.py [--world 4] [--ep 2 4] [--steps 6]
    sudo .venv/bin/python benchmarks/moe.py overlap [--rate-mbit 200] [--chunks 1 2 4] [--steps 12]
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

import torch  # noqa: E402

MODEL = {"dim": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "seq_len": 64,
         "moe_experts": 8, "moe_topk": 2, "moe_ffn_dim": 128}


def config(run_dir: str, model: dict, parallel: dict, steps: int, dtype: str = "float32") -> dict:
    return {
        "model": model,
        "parallel": parallel,
        "train": {"steps": steps, "global_batch": 16, "lr": 1e-3, "dtype": dtype, "run_dir": run_dir,
                  "progress": False, "tensorboard": False, "warmup_steps": 1},
        "data": {"max_docs": 200, "val_docs": 0},
    }


def measure_a2a(cfg: dict) -> dict | None:
    """On every rank: train, recording S and R per MoE forward; rank 0 returns the numbers."""
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.parallel.ep.dispatch import AllToAllDispatcher
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg))
    dispatchers = {id(m): m for m in trainer.model.modules() if isinstance(m, AllToAllDispatcher)}
    per_step = {"S": 0, "R": 0, "T": 0, "layers": 0}

    def hook(mod, args, _out):
        x, expert, n_experts = args[0], args[2], args[5]
        per_rank = torch.bincount(expert // (n_experts // mod.ep), minlength=mod.ep)
        table = [torch.zeros_like(per_rank) for _ in range(mod.ep)]
        dist.all_gather(table, per_rank, group=mod.group)  # table[src][dst]: rows src sends to dst
        me = mod.ep_rank
        per_step["S"] += int(per_rank.sum() - per_rank[me])
        per_step["R"] += int(sum(int(t[me]) for j, t in enumerate(table) if j != me))
        per_step["T"] += x.shape[0]
        per_step["layers"] += 1

    for m in dispatchers.values():
        m.register_forward_hook(hook)
    trainer.fit()
    if dist.get_rank() != 0:
        return None
    metrics = [json.loads(line) for line in (Path(cfg["train"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = len(metrics)
    return {"measured": sum(m["comm_bytes"].get("ep", 0) for m in metrics) / steps,
            "S": per_step["S"] / steps, "R": per_step["R"] / steps, "T": per_step["T"] / steps,
            "layer_calls": per_step["layers"] / steps,
            "imbalance": statistics.mean(m["expert_imbalance"] for m in metrics)}


def a2a_bytes(world: int, ep_list: list[int], steps: int) -> None:
    from meshfold.testing import run_on

    m = MODEL
    print(f"all-to-all bytes per step, global rank 0, world {world}, dim {m['dim']}, "
          f"E {m['moe_experts']}, top-{m['moe_topk']}, float32, {steps} steps")
    print(f"{'ep':>3} {'measured':>12} {'exact':>12} {'ratio':>7} {'balanced':>12} {'meas/bal':>8} {'imbal':>6}")
    for ep in ep_list:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = config(tmp, m, {"dp_shard": world, "ep": ep}, steps)
            r = run_on(world, measure_a2a, cfg, timeout=600)[0]
        b, d, e_local = 4, m["dim"], m["moe_experts"] // ep
        exact = 2 * (r["S"] + r["R"]) * d * b + r["layer_calls"] * (ep - 1) * e_local * 8
        balanced = (4 * r["T"] * m["moe_topk"] * (ep - 1) / ep * d * b
                    + r["layer_calls"] * (ep - 1) * e_local * 8)
        print(f"{ep:>3} {r['measured']:>12,.0f} {exact:>12,.0f} {r['measured'] / exact:>7.4f} "
              f"{balanced:>12,.0f} {r['measured'] / balanced:>8.3f} {r['imbalance']:>6.2f}")


def step_times(steps: int) -> None:
    from meshfold.config import from_dict
    from meshfold.models.counts import param_count
    from meshfold.train.trainer import Trainer

    torch.set_num_threads(1)
    moe_model = dict(MODEL)
    dense_model = {k: v for k, v in MODEL.items() if not k.startswith("moe_")}
    dense_model["ffn_dim"] = MODEL["moe_topk"] * MODEL["moe_ffn_dim"]
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name, model in (("dense", dense_model), ("moe", moe_model)):
            trainers[name] = Trainer(from_dict(config(f"{tmp}/{name}", model, {}, steps + 1)))
        times = {name: [] for name in trainers}
        for step in range(steps + 1):
            for name, tr in trainers.items():
                start = time.perf_counter()
                tr.train_step()
                tr.pop_step_metrics()
                if step:  # the first step warms up
                    times[name].append(time.perf_counter() - start)
    cfgs = {name: tr.cfg.model for name, tr in trainers.items()}
    print(f"\nstep time, one process, float32, global batch 16 x {MODEL['seq_len']} tokens, median of {steps}")
    for name in trainers:
        print(f"  {name:>5}: {statistics.median(times[name]) * 1e3:8.1f} ms   params {param_count(cfgs[name]):>9,}"
              f"   active {param_count(cfgs[name], active=True):>9,}")
    ratio = statistics.median(times["moe"]) / statistics.median(times["dense"])
    print(f"  moe/dense step time ratio at equal active parameters: {ratio:.2f}")


OVERLAP_MODEL = {"dim": 256, "n_layers": 1, "n_heads": 4, "vocab_size": 512, "seq_len": 256,
                 "moe_experts": 8, "moe_topk": 2, "moe_ffn_dim": 512}


def overlap_worker(args) -> None:
    """One rank of part 3 (inside its namespace): prints rank 0's medians as JSON."""
    import datetime

    import torch.distributed as dist

    from meshfold import comm
    from meshfold.models.config import ModelConfig
    from meshfold.models.moe import MoE
    from meshfold.parallel.ep.dispatch import AllToAllDispatcher

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=600))
    rank, ep = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig(**{**OVERLAP_MODEL, "moe_capacity_factor": args.capacity})
    torch.manual_seed(0)
    blocks = [MoE(cfg) for _ in range(args.layers)]
    dispatcher = AllToAllDispatcher(dist.group.WORLD, rank, ep)
    for moe in blocks:  # this rank's experts only, as expert parallel shards them
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            setattr(moe.experts, name, torch.nn.Parameter(p.detach().chunk(ep)[rank].clone()))
        moe.dispatcher = dispatcher
    torch.manual_seed(1 + rank)
    x = torch.randn(args.batch, cfg.seq_len, cfg.dim, requires_grad=True)
    times = {n: {"step": [], "blocked": []} for n in args.chunks}
    for step in range(args.steps + 1):
        for n in args.chunks:
            dispatcher.chunks = n
            dist.barrier()
            blocked0, start = comm.timer().wait_s, time.perf_counter()
            h = x
            for moe in blocks:
                h = h + moe(h)
            h.square().mean().backward()
            if step:  # the first round warms up
                times[n]["step"].append(time.perf_counter() - start)
                times[n]["blocked"].append(comm.timer().wait_s - blocked0)
    if rank == 0:
        print(json.dumps({str(n): {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}))
    dist.destroy_process_group()


def overlap(args) -> None:
    """Part 3: ep = --world ranks in a netlab (every link at --rate-mbit), chunk counts compared."""
    import subprocess

    from meshfold.lowcomm.netlab import NetLab

    results = {}
    for mode, capacity in (("dropless", 0.0), ("capacity 1.0", 1.0)):
        with NetLab(nodes=args.world, rate_mbit=args.rate_mbit) as lab:
            procs = [lab.popen(i, [sys.executable, __file__, "overlap-worker", "--rank", str(i),
                                   "--world", str(args.world), "--addr", lab.addr(0), "--port", "29517",
                                   "--steps", str(args.steps), "--layers", str(args.layers),
                                   "--batch", str(args.batch), "--capacity", str(capacity),
                                   "--chunks", *map(str, args.chunks)], stdout=subprocess.PIPE, text=True)
                     for i in range(args.world)]
            outs = [p.communicate(timeout=1500)[0] for p in procs]
            if any(p.returncode for p in procs):
                raise SystemExit(f"overlap worker failed: {[p.returncode for p in procs]}")
        results[mode] = json.loads(outs[0].strip().splitlines()[-1])
    m = OVERLAP_MODEL
    tokens = args.batch * m["seq_len"]
    print(f"exposed ep all-to-all, ep {args.world} on gloo over {args.rate_mbit:g} Mbit/s netlab links, "
          f"{args.layers} MoE blocks (dim {m['dim']}, E {m['moe_experts']}, top-{m['moe_topk']}, expert "
          f"{m['moe_ffn_dim']}), {tokens} tokens/rank, float32, forward + backward, median of {args.steps} steps")
    print(f"{'mode':>13} {'chunks':>6} {'step ms':>9} {'blocked ms':>11} {'step ratio':>10} {'blocked ratio':>13}")
    for mode, r in results.items():
        base = r[str(args.chunks[0])]
        for n in args.chunks:
            t = r[str(n)]
            print(f"{mode:>13} {n:>6} {t['step'] * 1e3:>9.1f} {t['blocked'] * 1e3:>11.1f} "
                  f"{t['step'] / base['step']:>10.2f} {t['blocked'] / base['blocked']:>13.2f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("overlap", "overlap-worker"):
        parser = argparse.ArgumentParser(description="part 3: exposed ep all-to-all with and without overlap")
        parser.add_argument("part")
        parser.add_argument("--world", type=int, default=4)
        parser.add_argument("--rate-mbit", type=float, default=200.0)
        parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
        parser.add_argument("--steps", type=int, default=12)
        parser.add_argument("--layers", type=int, default=2)
        parser.add_argument("--batch", type=int, default=4)
        parser.add_argument("--capacity", type=float, default=0.0)
        parser.add_argument("--rank", type=int, default=0)
        parser.add_argument("--addr", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=29517)
        args = parser.parse_args()
        (overlap if args.part == "overlap" else overlap_worker)(args)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    a2a_bytes(args.world, args.ep, args.steps)
    step_times(args.steps)


if __name__ == "__main__":
    main()
