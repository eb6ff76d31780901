"""Peak host memory of building a billion-parameter model sharded (issue 17): the model is
built on the meta device and each process materialises only its ZeRO-3 shard
(``parallel/materialize.py``), so a process's peak RSS should stay within its share of the
parameters plus 1.5 GiB (torch itself, the corpus, one 4 MiB tile of initial values at a
time: ``models/llama.py: fill_initial_`` generates only the tiles a shard overlaps).

``train.steps = 0`` builds, reports and exits. Every process reports its own peak RSS
(getrusage, whole process life, torch included) and its own parameter bytes; the script
prints them against the bound and exits 1 if a process exceeds it. Before running a case it
checks the machine's available memory (other jobs may share it) and skips a case whose
estimated total (processes x (share + 0.6 GiB)) would not fit.

Usage: python benchmarks/build_memory.py [--case llama3-1b:2] [--case llama3-3b:8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

GIB = 2**30


def _build(cfg_dict: dict) -> dict:
    import resource

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    trainer.fit()  # steps = 0: build, report (rank 0 prints), exit
    own = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in trainer.model.parameters())
    return {"param_bytes": own, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def run_case(preset: str, procs: int, run_dir: str) -> bool:
    from meshfold.models.counts import param_count
    from meshfold.models.presets import preset as preset_config
    from meshfold.testing import run_on, tiny_config

    model = preset_config(preset)
    total = param_count(model) * 4
    need = procs * (total / procs + 0.6 * GIB)
    avail = _available_bytes()
    print(f"{preset} on {procs} processes, zero 3, fp32: {total / 1e9:.2f} GB in all, "
          f"share {total / procs / GIB:.2f} GiB per process; estimated need {need / GIB:.1f} GiB, "
          f"available {avail / GIB:.1f} GiB", flush=True)
    if need > avail:
        print("  skipped: not enough free memory on this machine now")
        return True
    cfg = tiny_config(run_dir, parallel={"dp_shard": procs, "zero": 3},
                      train={"steps": 0, "dtype": "float32", "global_batch": procs})
    cfg["model"] = {"preset": preset, "seq_len": 128}
    reports = run_on(procs, _build, cfg, timeout=3600)
    ok = True
    for rank, r in enumerate(reports):
        bound = r["param_bytes"] + 1.5 * GIB
        ok &= r["peak_rss_bytes"] <= bound
        print(f"  rank {rank}: params {r['param_bytes'] / GIB:.3f} GiB, peak RSS {r['peak_rss_bytes'] / GIB:.3f} GiB "
              f"= share + {(r['peak_rss_bytes'] - r['param_bytes']) / GIB:.3f} GiB "
              f"({'within' if r['peak_rss_bytes'] <= bound else 'OVER'} share + 1.5 GiB)", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", metavar="PRESET:PROCESSES",
                    help="default: llama3-1b:2 and llama3-3b:8")
    args = ap.parse_args()
    ok = True
    for case in args.case or ["llama3-1b:2", "llama3-3b:8"]:
        preset, procs = case.rsplit(":", 1)
        with tempfile.TemporaryDirectory() as run_dir:
            ok &= run_case(preset, int(procs), run_dir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
