"""Tensor parallel: meshfold's own Megatron ops vs PyTorch's DTensor ``parallelize_module``.

On tp = 2 real gloo processes, one forward+backward (with the vocabulary-parallel loss) of
the same Llama, from the same initial weights and batch, under two implementations:

* meshfold: ``parallel/tp/`` (explicit autograd collectives on local shards,
  sequence-parallel linears that save only the sequence slice) + ``parallel/loss.py``;
* baseline: ``torch.distributed.tensor.parallel.parallelize_module`` with the torchtitan-style
  plan (Colwise/Rowwise, SequenceParallel norms, vocab-sharded embedding/output) and
  ``loss_parallel()``.

Prints the median step time of each, their ratio, the saved-activation bytes per rank
(``meshfold/memory.py``) and their ratio, and checks both give the same loss.

    .venv/bin/python benchmarks/tensor_parallel.py [--dim 256] [--seq 256] [--batch 4] [--iters 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _torch_plan(model, mesh, sp: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    } if sp else {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                desired_input_layouts=(Replicate(), None, None, None),
                                                use_local_output=True),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True),
            })
        parallelize_module(block, mesh, plan)


class _hooks:
    def __init__(self, counter):
        import torch

        self.counter = counter
        self.ctx = torch.autograd.graph.saved_tensors_hooks(counter._pack, lambda t: t)

    def __enter__(self):
        self.ctx.__enter__()
        return self.counter

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def measure(impl: str, sp: bool, dim: int, seq: int, batch: int, iters: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from meshfold.config import Config, ModelConfig, ParallelConfig
    from meshfold.mesh import build_mesh
    from meshfold.models.llama import Transformer, init_weights
    from meshfold.parallel.loss import vocab_parallel_loss
    from meshfold.parallel.tp.plan import parallelize_tensor
    from meshfold.memory import SavedActivationCounter

    class Counter(SavedActivationCounter):
        """The baseline's autograd saves DTensors: count their local storage."""

        def add(self, t):
            t = getattr(t, "_local_tensor", t)
            try:
                super().add(t)
            except RuntimeError:  # a storage-less wrapper: count its bytes, no dedup
                self.bytes += t.numel() * t.element_size()

    def count_saved_activations(model):
        counter = Counter(model)
        return _hooks(counter)

    torch.set_num_threads(1)
    tp = dist.get_world_size()
    cfg = Config(model=ModelConfig(dim=dim, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=2048, seq_len=seq),
                 parallel=ParallelConfig(tp=tp, sp=sp, dp_shard=1))
    model = Transformer(cfg.model)
    init_weights(model, cfg.model, seed=0)
    dims = build_mesh(cfg.parallel)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 2048, (batch, seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq).expand(batch, seq)  # full positions: rotary angles under sp

    if impl == "meshfold":
        parallelize_tensor(model, dims, cfg)
        loss_fn = vocab_parallel_loss(dims, cfg)

        def step():
            with count_saved_activations(model) as counted:
                loss = loss_fn(model(inputs, positions=positions), labels) / labels.numel()
            loss.backward()
            return loss, counted.bytes
    else:
        _torch_plan(model, dims["tp"], sp)

        def step():
            with loss_parallel():
                with count_saved_activations(model) as counted:
                    logits = model(inputs, positions=positions)
                    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                loss.backward()
            return loss, counted.bytes

    times = []
    for i in range(iters + 2):
        dist.barrier()
        start = time.perf_counter()
        loss, saved = step()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    loss = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
    return {"time_s": statistics.median(times[2:]), "saved_bytes": saved, "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    from meshfold.testing import run_on

    print(f"tp={args.tp}, dim {args.dim}, 2 layers, 8 heads, vocab 2048, seq {args.seq}, batch {args.batch}, float32")
    print(f"{'':6} {'impl':9} {'step ms':>9} {'saved MiB/rank':>15} {'loss':>9}")
    for sp in (False, True):
        res = {}
        for impl in ("meshfold", "torch"):
            res[impl] = run_on(args.tp, measure, impl, sp, args.dim, args.seq, args.batch, args.iters,
                               timeout=600)[0]
            r = res[impl]
            print(f"{'sp' if sp else 'no sp':6} {impl:9} {r['time_s'] * 1e3:9.1f} {r['saved_bytes'] / 2**20:15.2f} "
                  f"{r['loss']:9.5f}")
        assert abs(res["meshfold"]["loss"] - res["torch"]["loss"]) < 1e-4, res
        print(f"{'':6} ratio torch/meshfold: step time {res['torch']['time_s'] / res['meshfold']['time_s']:.2f}x, "
              f"saved activations {res['torch']['saved_bytes'] / res['meshfold']['saved_bytes']:.2f}x")


if __name__ == "__main__":
    main()
