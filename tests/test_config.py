"""Every bad configuration stops with one line naming the key, before any process starts."""

import subprocess
import sys

import pytest

from meshfold.config import ConfigError, load_config, parse_override, validate


def cfg(*overrides):
    return load_config("configs/debug.toml", list(overrides))


BAD = [
    # (overrides, world size, words the one-line message must contain)
    (["parallel.dp_shard=3"], 4, ["parallel", "dp_shard", "world size"]),
    (["parallel.tp=3"], 3, ["n_heads", "parallel.tp", "[1, 2, 4]"]),
    (["parallel.tp=8", "parallel.dp_shard=1"], 8, ["parallel.tp = 8", "larger than model.n_heads"]),
    (["train.global_batch=6"], 4, ["train.global_batch = 6", "multiple of 4"]),
    (["train.global_batch=8", "train.micro_batch=3"], 2, ["train.micro_batch = 3", "[1, 2, 4]"]),
    (["train.stepz=3"], 1, ["unknown key train.stepz", "train.steps"]),
    (["parallel.zero=5"], 1, ["parallel.zero"]),
    (["parallel.pp_schedule=zigzag"], 1, ["parallel.pp_schedule", "1f1b"]),
    (["model.n_heads=5"], 1, ["model.dim = 64", "model.n_heads = 5"]),
    (["model.n_kv_heads=3"], 1, ["model.n_kv_heads = 3"]),
    (["parallel.zero=0", "parallel.dp_shard=2"], 2, ["parallel.zero = 0", "dp_shard"]),
    (["train.steps=\"ten\""], 1, ["train.steps", "wrong type"]),
    (["parallel.ep=2"], 2, ["parallel.ep", "moe_experts"]),
    (["parallel.pp=2", "parallel.pp_schedule=\"zbv\"", "train.recompute=\"full\"", "model.n_layers=4"], 2,
     ["pp_schedule = zbv", "train.recompute = selective"]),
    # per-sequence context parallel: checked with the layout, before the trainer starts
    (["data.balance=\"greedy\"", "data.seq_cp_max=2", "train.global_batch=8", "train.micro_batch=2"], 2,
     ["data.seq_cp_max = 2", "one micro-batch per rank"]),
    (["data.balance=\"greedy\"", "data.seq_cp_max=4", "train.global_batch=8"], 2,
     ["data.seq_cp_max = 4", "divide the 2 data-parallel ranks"]),
]


@pytest.mark.parametrize("overrides,world,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_config_is_one_line(overrides, world, words):
    with pytest.raises(ConfigError) as err:
        validate(cfg(*overrides), world)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match=r"unknown section \[trian\].*\[train\]"):
        load_config("configs/debug.toml", ["trian.steps=3"])


def test_override_values_are_toml():
    assert parse_override("train.lr=1e-3") == ("train", "lr", 1e-3)
    assert parse_override("parallel.sp=true") == ("parallel", "sp", True)
    assert parse_override("train.run_dir=runs/x") == ("train", "run_dir", "runs/x")
    assert parse_override("parallel.pp_split=[1, 1]") == ("parallel", "pp_split", [1, 1])


def test_dp_shard_fills_the_world():
    c = validate(cfg("parallel.dp_replicate=2"), 8)
    assert (c.parallel.dp_replicate, c.parallel.dp_shard) == (2, 4)


def test_cli_bad_layout_stops_before_processes_start(tmp_path):
    # --nproc 4 with dp_shard 3: one line on stderr, exit 2, no run directory written.
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "meshfold", "train", "configs/debug.toml", "--nproc", "4",
         "--set", "parallel.dp_shard=3", "--set", f"train.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshfold: error: parallel:"), proc.stderr
    assert not run_dir.exists()
