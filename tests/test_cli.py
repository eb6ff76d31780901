"""The command line end to end: a 2-process run writes the contract's run directory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


def meshfold(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "meshfold", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("cli") / "run"
    proc = meshfold("train", "configs/debug.toml", "--nproc", "2", "--set", "train.steps=6",
                    "--set", f"train.run_dir={run}", "--set", "train.eval_every=3",
                    "--set", "data.max_docs=60")
    assert proc.returncode == 0, proc.stderr
    assert "final loss" in proc.stdout
    return run


def test_run_directory_contract(run_dir):
    assert (run_dir / "config.toml").exists()
    resolved = (run_dir / "config.toml").read_text()
    assert "dp_shard = 2" in resolved  # -1 resolved to the world size
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        for key in ("step", "loss", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_bytes"):
            assert key in r
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_bytes"] > 0
        assert r["comm_bytes"]["dp"] > 0
    assert "val_loss" in records[2]
    assert records[-1]["loss"] < records[0]["loss"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_plot_writes_pngs(run_dir):
    proc = meshfold("plot", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    pngs = sorted(Path(p).name for p in proc.stdout.split())
    assert {"loss.png", "tokens_per_s.png"} <= set(pngs)
    assert (run_dir / "plots" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_runtime_config_error_is_one_line(tmp_path):
    proc = meshfold("train", "configs/debug.toml", "--nproc", "2", "--set", "data.source=/no/such/corpus",
                    "--set", f"train.run_dir={tmp_path / 'r'}")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["meshfold: error: data.source = '/no/such/corpus' does not exist; give an existing path "
                     "or 'default'"], proc.stderr


def test_calibrate_cost_fits_the_measured_times(capsys):
    """``meshfold calibrate-cost`` (its command lives in cli.py, the measurement in
    data/cost_calibration.py): one JSON line whose fit reproduces what it measured."""
    from meshfold.cli import main

    assert main(["calibrate-cost", "configs/debug.toml", "--lengths", "16,32,64", "--repeats", "1", "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["a"] >= 0 and fit["b"] >= 0 and len(fit["seconds"]) == len(fit["lengths"]) == len(fit["counts"])
    assert sorted(set(fit["lengths"])) == [16, 32, 64]


def test_cpu_peak_is_measured_once_per_process(monkeypatch):
    # (the suite sets MESHFOLD_PEAK_TFLOPS to skip this probe in its many processes)
    import torch

    from meshfold.train import metrics

    monkeypatch.delenv("MESHFOLD_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(metrics, "_CPU_PEAK", None)
    peak = metrics._cpu_peak_flops(rounds=2, round_s=0.02)
    assert 1e8 < peak < 1e14  # a float32 matmul rate of this machine
    assert metrics.device_peak_flops(torch.device("cpu")) == peak  # cached: not probed again


def test_mfu_peak_by_exact_device_name_and_never_above_one(monkeypatch):
    """H100 PCIe is not an SXM (substring matching gave it 989 TF); an unknown GPU gives no
    MFU (one warning) unless train.peak_tflops names its peak; MFU is clamped to 1."""
    import warnings

    import torch

    from meshfold.train import metrics

    monkeypatch.delenv("MESHFOLD_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(metrics, "_WARNED", set())
    cuda = torch.device("cuda", 0)
    for name, tflops in (("NVIDIA H100 PCIe", 756), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 NVL", 835),
                         ("NVIDIA B200", 2250), ("NVIDIA H20", 148), ("AMD Instinct MI300X", 1307)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d, n=name: n)
        assert metrics.device_peak_flops(cuda) == tflops * 1e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA Future GPU")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert metrics.device_peak_flops(cuda) is None and metrics.device_peak_flops(cuda) is None
    assert len(caught) == 1 and "train.peak_tflops" in str(caught[0].message)
    assert metrics.device_peak_flops(cuda, peak_tflops=500) == 500e12
    assert metrics.model_flops_utilization(1e12, None, 8) is None
    assert metrics.model_flops_utilization(1e12, 1e12, 4) == 0.25
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert metrics.model_flops_utilization(3e12, 1e12, 1) == 1.0
    assert len(caught) == 1
