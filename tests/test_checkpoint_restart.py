"""Crash recovery through the real CLI: ``meshfold train --nproc 2 --max-restarts 1``, one
worker SIGKILLed mid-run, torchrun's elastic agent restarts the job, it resumes from the
last checkpoint and finishes with the losses of a run that was never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from meshfold.config import load_config
from meshfold.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY = 30, 5


def _overrides(run_dir: Path) -> list[str]:
    sets = {"model.dim": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.vocab_size": 320,
            "model.seq_len": 16, "train.dtype": '"float64"', "train.steps": STEPS, "train.global_batch": 8,
            "train.lr": 1e-2, "train.warmup_steps": 1, "train.checkpoint_every": EVERY,
            "train.run_dir": f'"{run_dir}"', "train.progress": "false", "train.tensorboard": "false",
            "data.max_docs": 40, "data.val_docs": 0, "parallel.dp_replicate": 2, "parallel.dp_shard": 1,
            "parallel.zero": 0}
    return [f"{k}={v}" for k, v in sets.items()]


def _workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes, read from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            env = dict(x.split("=", 1) for x in (entry / "environ").read_text().split("\0") if "=" in x)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def test_sigkill_restart_resumes_with_same_losses(tmp_path):
    run_dir = tmp_path / "run"
    sets = _overrides(run_dir)
    cmd = [sys.executable, "-m", "meshfold", "train", str(ROOT / "configs" / "debug.toml"), "--nproc", "2",
           "--max-restarts", "1"] + [x for s in sets for x in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / f"step-{EVERY}").exists():
                workers = _workers(proc.pid)
                if 1 in workers:
                    os.kill(workers[1], signal.SIGKILL)
                    killed = workers[1]
                    break
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "the run finished before a worker could be killed"
    assert proc.returncode == 0, out
    assert "PeerLostError: rank 0: lost the connection to a peer (it crashed or was killed)" in out, out
    assert "the launcher restarts all workers from the last checkpoint (restart 1 of 1)" in out, out
    assert "restarting all 2 workers from the last checkpoint (restart 1 of 1)" in out, out  # the launcher's line
    assert "meshfold: checkpoint: resumed from" in out, out

    # The reference: the same config in one process, never interrupted.
    ref = Trainer(load_config(ROOT / "configs" / "debug.toml", [s.replace(str(run_dir), str(tmp_path / "ref"))
                                                                  for s in sets[:-3]]))
    ref_losses = ref.fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # 2-rank DDP against one process: float64 rounding only.
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records], dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-9, atol=1e-11)
