"""What a new user meets in the first hour (issue #46): a preset is a whole shape, the
memory estimate before any process starts, one run per run directory, and a plan that
runs as written."""

import json
import subprocess
import sys

import pytest

from meshfold.cli import build_parser
from meshfold.config import from_dict, load_config, model_keys, validate
from meshfold.models.presets import preset
from meshfold.planner.fit import check_fit
from meshfold.planner.workload import Layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def meshfold(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "meshfold", *args], capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------------------- a preset is a whole shape


def test_a_set_preset_replaces_the_files_model():
    """The README's line: debug.toml's dim 64 / 2 layers are another shape, not overrides."""
    cfg = load_config("configs/debug.toml", ["model.preset=llama3-1b"])
    assert cfg.model == preset("llama3-1b")
    assert "configs/debug.toml's own [model] keys (dim, n_heads, n_kv_heads, n_layers, seq_len, vocab_size)" \
        in cfg.model_note and "are not used" in cfg.model_note


def test_set_keys_override_a_set_preset_whatever_their_order():
    for sets in (["model.preset=llama3-1b", "model.n_layers=2"], ["model.n_layers=2", "model.preset=llama3-1b"]):
        cfg = load_config("configs/debug.toml", sets)
        assert cfg.model == preset("llama3-1b", n_layers=2)
        assert cfg.model_note.startswith("model.preset = 'llama3-1b' with n_layers=2;")


def test_a_files_preset_takes_the_files_own_keys_and_then_set(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npreset = "llama3-8b"\nseq_len = 256\n')
    cfg = load_config(path)
    assert cfg.model == preset("llama3-8b", seq_len=256)
    assert cfg.model_note == "model.preset = 'llama3-8b' with seq_len=256"
    cfg = load_config(path, ["model.n_layers=4"])
    assert cfg.model == preset("llama3-8b", seq_len=256, n_layers=4)
    # another preset on the command line: the file's keys belonged to the first one
    cfg = load_config(path, ["model.preset=llama3-1b"])
    assert cfg.model == preset("llama3-1b") and "(seq_len) belong to another shape" in cfg.model_note


def test_no_preset_no_note():
    assert load_config("configs/debug.toml").model_note == ""


def test_model_keys_give_the_model_back():
    for m in (preset("llama3-1b"), preset("llama3-1b", n_layers=2, ffn_dim=0), load_config("configs/debug.toml").model):
        assert from_dict({"model": model_keys(m)}).model == m


# ---------------------------------------------------------------------------- memory before any process starts


def test_a_shape_too_large_for_the_host_is_refused_before_the_build_with_one_line(tmp_path):
    proc = meshfold("train", "configs/debug.toml", "--set", "model.preset=llama3-70b", "--set", "train.steps=1",
                    "--set", f"train.run_dir={tmp_path / 'run'}", "--set", "train.device=cpu")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("meshfold: error: llama3-70b (70.6 B parameters) on 1 process needs an estimated ")
    assert "GiB on the host at peak, and this host has " in lines[0] and lines[0].endswith("(--force to start anyway)")
    assert "no layout of 1 process fits" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing was built


def test_force_is_accepted():
    args = build_parser("train").parse_args(["train", "configs/debug.toml", "--force"])
    assert args.force is True and build_parser("train").parse_args(["train", "x.toml"]).force is False


def test_the_estimate_line_and_the_smallest_change_that_fits():
    cfg = validate(load_config("configs/debug.toml", ["model.preset=llama3-1b", "model.seq_len=256"]), 1)
    fit = check_fit(cfg, 1, 1, "configs/debug.toml", have=1e15)
    assert fit.fits and fit.building_line().startswith(
        "building llama3-1b (1.24 B parameters) on 1 process, estimated peak ")
    # just too little: more recompute on the same layout fits, and is named as one --set
    fit = check_fit(cfg, 1, 1, "configs/debug.toml", have=fit.need_bytes - 1)
    assert not fit.fits and "--set train.recompute=" in fit.fix, fit.fix
    # on 4 processes with far too little for any recompute: a layout of 4 processes that fits
    cfg = validate(load_config("configs/debug.toml", ["model.preset=llama3-1b", "model.seq_len=256"]), 4)
    ample = check_fit(cfg, 4, 4, "c", have=1e15).need_bytes
    fit = check_fit(cfg, 4, 4, "c", have=ample * 0.7)
    assert not fit.fits and ("the layout " in fit.fix or "--set train.recompute=" in fit.fix), fit.fix


# ---------------------------------------------------------------------------- one run per run directory


def test_two_new_runs_into_one_directory_never_mix(tmp_path):
    run = tmp_path / "run"
    common = ("train", "configs/debug.toml", "--set", "train.steps=2", "--set", f"train.run_dir={run}",
              "--set", "data.max_docs=60", "--set", "train.progress=false")
    first = meshfold(*common)
    assert first.returncode == 0, first.stderr
    second = meshfold(*common)
    assert second.returncode == 0, second.stderr
    assert f"meshfold: {run} holds another run's metrics and no checkpoint to resume; this run writes to {run}-2" \
        in second.stderr
    assert f"run directory {run}-2" in second.stdout
    for folder in (run, tmp_path / "run-2"):
        steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2], folder
        assert len(list((folder / "tensorboard").glob("events.out.tfevents.*"))) == 1


# ---------------------------------------------------------------------------- a plan that runs as written


def test_layout_labels_read_as_words():
    assert Layout(pp=2, pp_schedule="1f1b").short() == "dp1x1 z0 tp1 pp2 1f1b mb1 none"
    assert "pp4 interleaved v2" in Layout(pp=4, pp_schedule="interleaved", pp_virtual_stages=2).short()
    assert "cp2 ring" in Layout(cp=2).short()


def test_plan_out_is_a_config_train_runs_as_planned(tmp_path):
    out, run = tmp_path / "plan.toml", tmp_path / "run"
    proc = meshfold("plan", "configs/debug.toml", "--cluster", "cpu:2", "--set", "model.n_layers=4",
                    "--set", f"train.run_dir={run}", "--set", "data.max_docs=60", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = tomllib.loads(out.read_text())
    assert plan["model"]["n_layers"] == 4 and plan["data"]["max_docs"] == 60
    proc = meshfold("train", str(out), "--nproc", "2", "--set", "train.steps=2", "--set", "train.progress=false")
    assert proc.returncode == 0, proc.stderr
    ran = tomllib.loads((run / "config.toml").read_text())
    for key, value in plan["parallel"].items():
        assert ran["parallel"][key] == value, key
    for key in ("global_batch", "micro_batch", "recompute"):
        assert ran["train"][key] == plan["train"][key], key
    assert ran["model"]["n_layers"] == 4 and ran["model"]["dim"] == 64
