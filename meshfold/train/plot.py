"""``meshfold plot RUN_DIR``: PNG curves of a run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

from meshfold.errors import ConfigError


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a run directory written by `meshfold train`")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    panels = [("loss", "loss"), ("tokens_per_s", "tokens / s"), ("mfu", "MFU"),
              ("peak_mem_bytes", "peak memory (bytes)")]
    written = []
    for key, label in panels:
        values = [r.get(key) for r in records]
        if all(v is None for v in values):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, values, label=key)
        if key == "loss" and any("val_loss" in r for r in records):
            vs = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
            ax.plot(*zip(*vs), "o-", label="val_loss")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(f"{run_dir.name}: {label}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
