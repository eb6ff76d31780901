"""How long a checkpoint stops training: synchronous save vs ``train.async_checkpoint``.

One process, a ~14M-parameter Llama (llama-20m shape, vocab 512) in float32 with AdamW state
(~170 MB per checkpoint). Measures, in the same run, the time ``Checkpointer.save()`` blocks
the training loop for a synchronous save (write + hash + publish) and for an asynchronous one
(copy the state to CPU memory, then return; writing, hashing and publishing run on a background thread), and the async save's time until published. Prints the
ratio sync-block / async-block. Usage: python benchmarks/checkpoint_async.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from meshfold.config import from_dict
from meshfold.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = from_dict({
            "model": {"preset": "llama-20m", "vocab_size": 512, "seq_len": 64},
            "train": {"steps": 100, "global_batch": 2, "run_dir": run_dir, "dtype": "float32", "progress": False,
                      "tensorboard": False, "keep_checkpoints": 1, "straggler_every": 0,
                      "async_checkpoint": True},
            "data": {"max_docs": 200, "val_docs": 0},
        })
        tr = Trainer(cfg)
        n_params = sum(p.numel() for p in tr.model.parameters())
        tr.train_step()
        sync, blocked, published = [], [], []
        for i in range(args.repeats + 1):  # the first round warms allocations up and is dropped
            tr.checkpointer.use_async = False
            tr.train_step()
            t0 = time.perf_counter()
            tr.checkpointer.save()
            sync.append(time.perf_counter() - t0)

            tr.checkpointer.use_async = True
            tr.train_step()
            t0 = time.perf_counter()
            tr.checkpointer.save()
            blocked.append(time.perf_counter() - t0)
            tr.checkpointer.wait()
            published.append(time.perf_counter() - t0)
            if i == 0:
                sync, blocked, published = [], [], []
        tr.checkpointer.close()
        size = sum(f.stat().st_size for f in (tr.checkpointer.root).glob("step-*/*"))
    s, b, p = (statistics.median(x) for x in (sync, blocked, published))
    print(f"model {n_params / 1e6:.1f}M params, checkpoint {size / 2**20:.0f} MiB, {args.repeats} repeats (medians)")
    print(f"sync save blocks training      {s:.3f} s")
    print(f"async save blocks training     {b:.3f} s   (published after {p:.3f} s)")
    print(f"ratio sync/async blocking      {s / b:.2f}x")


if __name__ == "__main__":
    main()
