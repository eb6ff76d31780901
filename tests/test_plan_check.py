"""``meshfold plan --check RUN_DIR`` compares like with like: ``comm_bytes`` (one definition,
docs/communication.md: bytes this rank sends per optimizer step under the ring algorithms,
global rank 0) is what the planner predicts exactly, on a cluster file written by
``meshfold calibrate``; peak memory is split into what the planner models and what the
process holds beyond it."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from meshfold.config import load_config
from meshfold.planner.cli import workload_from_config
from meshfold.planner.cluster import cluster_to_toml, load_cluster


def _calibrated_cpu_file(tmp_path):
    """A cluster file as ``meshfold calibrate`` writes it (a device of its own name)."""
    c = load_cluster("cpu-gloo", devices=4)
    c = replace(c, name="calibrated-cpu", device=replace(c.device, name="cpu-calibrated"))
    path = tmp_path / "cluster-cpu-4.toml"
    path.write_text(cluster_to_toml(c))
    return path


def test_a_calibrated_cpu_cluster_file_plans_float32(tmp_path):
    """It did not: the file named no device, which loaded as "custom", a GPU to the planner,
    so it predicted bf16 wires (comm_bytes 0.5-0.67 of the measured)."""
    cluster = load_cluster(str(_calibrated_cpu_file(tmp_path)))
    assert workload_from_config(load_config("configs/debug.toml"), cluster).dtype == "float32"


@pytest.mark.parametrize("sets", [["--set", "parallel.tp=2"]])
def test_plan_check_comm_bytes_ratio_is_one(tmp_path, sets):
    run = tmp_path / "run"
    train = subprocess.run([sys.executable, "-m", "meshfold", "train", "configs/debug.toml", "--nproc", "4",
                            "--set", "train.steps=4", "--set", "data.max_docs=120", "--set", f"train.run_dir={run}",
                            *sets], capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr
    check = subprocess.run([sys.executable, "-m", "meshfold", "plan", "configs/debug.toml", "--check", str(run),
                            "--cluster", str(_calibrated_cpu_file(tmp_path)), "--json"],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    out = json.loads(check.stdout)
    assert set(out["comm_bytes"]) == {"dp", "tp"}
    for dim, v in out["comm_bytes"].items():  # deterministic bytes: exact
        assert v["measured"] > 0 and v["predicted"] == v["measured"], (dim, v)
    split = out["peak_mem_split"]
    assert split["process"]["measured"] > 0 and split["model"]["measured"] > 0
    assert split["model"]["predicted"] + split["process"]["predicted"] == pytest.approx(out["peak_mem_bytes"]["predicted"])
    assert split["model"]["measured"] + split["process"]["measured"] == out["peak_mem_bytes"]["measured"]
    text = subprocess.run([sys.executable, "-m", "meshfold", "plan", "x", "--check", str(run), "--cluster",
                           str(_calibrated_cpu_file(tmp_path))], capture_output=True, text=True, timeout=300).stdout
    assert "peak memory: model " in text and "process overhead" in text, text
