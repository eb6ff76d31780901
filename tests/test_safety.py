"""Nothing lost, whatever the user or the machine does (docs/checkpoints.md, "What is safe").

Each case runs the real command line (in this process where it can, a subprocess where a
signal or a killed launcher is the point) and asserts the exit code, the single line it
prints, and that every file that existed before is byte-identical afterwards."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from meshfold.cli import main
from meshfold.data.prepared import read_manifest, write_manifest
from meshfold.testing import tiny_config
from meshfold.train.checkpoint_files import published
from meshfold.train.run_dir import RunLock

ROOT = Path(__file__).resolve().parent.parent


def snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file under ``roots`` (or the file itself) and its bytes."""
    out = {}
    for root in roots:
        if root.is_file():
            out[str(root)] = root.read_bytes()
        elif root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    out[str(p)] = p.read_bytes()
    return out


def unchanged(before: dict[str, bytes]) -> None:
    """Every file that existed before still exists with the same bytes."""
    for path, data in before.items():
        assert Path(path).is_file(), f"{path} was removed"
        assert Path(path).read_bytes() == data, f"{path} was changed"


def the_line(err: str, start: str = "meshfold: ") -> str:
    """The one line meshfold printed about the failure (torch's own warnings aside), and no traceback."""
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith(start)]
    assert len(lines) == 1, err
    return lines[0]


def write_config(tmp: Path, run: Path, **train) -> str:
    cfg = tiny_config(str(run), train={"steps": 2, "checkpoint_every": 2, "dtype": "float32", **train})
    path = tmp / f"cfg-{len(list(tmp.glob('cfg-*')))}.toml"
    path.write_text(tomli_w.dumps(cfg))
    return str(path)


def train(capfd, config: str, *sets: str) -> tuple[int, str]:
    capfd.readouterr()
    rc = main(["train", config, *[x for s in sets for x in ("--set", s)]])
    return rc, capfd.readouterr().err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory trained 2 steps (checkpoint step-2), copied by each test that changes it."""
    tmp = tmp_path_factory.mktemp("trained")
    run = tmp / "run"
    assert main(["train", write_config(tmp, run)]) == 0
    assert [p.name for p in published(run / "checkpoints")] == ["step-2"]
    return run


def copy_run(trained: Path, tmp: Path) -> Path:
    import shutil

    run = tmp / "run"
    shutil.copytree(trained, run)
    return run


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("key,value,expected", [
    ("train.lr", "0", "train.lr must be a finite number > 0, got 0.0"),
    ("train.lr", "inf", "train.lr must be a finite number > 0, got inf"),
    ("train.grad_clip", "-1", "train.grad_clip must be a finite number >= 0"),
    ("train.checkpoint_every", "-1", "train.checkpoint_every must be >= 0, got -1"),
    ("train.keep_checkpoints", "-2", "train.keep_checkpoints must be >= 0, got -2"),
])
def test_bad_train_values_are_refused(tmp_path, capfd, key, value, expected):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    rc, err = train(capfd, write_config(tmp_path, run), f"{key}={value}")
    assert rc == 2 and expected in the_line(err), err
    unchanged(before)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_nproc_zero_is_refused(tmp_path, capfd):
    capfd.readouterr()
    assert main(["train", write_config(tmp_path, tmp_path / "run"), "--nproc", "0"]) == 2
    assert "--nproc must be >= 1, got 0" in the_line(capfd.readouterr().err)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- resume


def test_resume_refuses_another_model_or_data_and_logs_allowed_changes(trained, tmp_path, capfd):
    run = copy_run(trained, tmp_path)
    config = write_config(tmp_path, run, steps=3)
    before = snapshot(run)
    for sets, named in ((["model.n_layers=4"], "model.n_layers 2 -> 4"),
                        (["model.n_layers=1"], "model.n_layers 2 -> 1"),
                        (["data.max_docs=30"], "data.train_sequences")):
        rc, err = train(capfd, config, *sets)
        line = the_line(err)
        assert rc == 2 and named in line and "train.init_from=" in line and "step-2" in line, err
        unchanged(before)
    # Every checkpoint unreadable: one line, nothing started over.
    bad = run / "checkpoints" / "step-2" / "__0_0.distcp"
    bad.write_bytes(b"x" * bad.stat().st_size)
    damaged = snapshot(run)
    rc, err = train(capfd, config)
    assert rc == 1 and "every checkpoint in" in the_line(err, "meshfold: error") and "nothing was changed" in err
    unchanged(damaged)
    # resume = never on top of checkpoints would replace them: refused.
    rc, err = train(capfd, config, "train.resume='never'")
    assert rc == 2 and "train.resume = never" in the_line(err), err
    unchanged(damaged)


def test_allowed_changes_on_resume_are_logged(trained, tmp_path, capfd):
    run = copy_run(trained, tmp_path)
    before = snapshot(run / "checkpoints")
    rc, err = train(capfd, write_config(tmp_path, run, steps=3, checkpoint_every=0), "train.global_batch=16",
                    "train.lr=0.005")
    assert rc == 0, err
    line = the_line(err, "meshfold: resuming at step 2 with changes")
    assert "train.global_batch 8 -> 16" in line and "train.lr 0.01 -> 0.005" in line
    unchanged(before)
    assert json.loads((run / "run.json").read_text())["train"]["global_batch"] == 16


# ---------------------------------------------------------------------------- one run per directory


def test_run_directory_lock(trained, tmp_path, capfd):
    run = copy_run(trained, tmp_path)
    config = write_config(tmp_path, run, steps=3)
    lock = RunLock(run)
    lock.acquire()  # another run holds it
    try:
        before = snapshot(run)
        rc, err = train(capfd, config)
        line = the_line(err)
        assert rc == 1 and "is in use by another run" in line and f":{os.getpid()}" in line, err
        unchanged(before)
    finally:
        lock.release()
    # A lock whose holder is gone (it crashed): taken over, said so.
    (run / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 999999999, "since": 0}))
    rc, err = train(capfd, config)
    assert rc == 0 and "taking over a stale lock of elsewhere:999999999" in err, err


# ---------------------------------------------------------------------------- I/O failures


def test_run_dir_that_is_a_file_or_under_one(tmp_path, capfd):
    f = tmp_path / "afile"
    f.write_text("mine")
    before = snapshot(f)
    for run, cause in ((f, "is a file, not a folder"), (f / "sub", "Not a directory")):
        rc, err = train(capfd, write_config(tmp_path, run))
        assert rc == 1 and cause in the_line(err) and str(f) in the_line(err), err
        unchanged(before)
    assert not list(tmp_path.glob("afile*/error-*"))


def test_full_disk_final_save_fails_the_run(tmp_path, capfd):
    # A real write refusal: RLIMIT_FSIZE makes the kernel refuse writes past 300 kB (EFBIG),
    # as a full disk refuses them (ENOSPC); the checkpoint (~1 MB) cannot be written.
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    config = write_config(tmp_path, run, dtype="float64")
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, old[1]))
    try:
        rc, err = train(capfd, config)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    line = the_line(err, "meshfold: error")
    assert rc == 1 and "saving step 2 failed" in line and "file size limit" in line, err
    assert "unexpected pos" not in line
    unchanged(before)
    assert published(run / "checkpoints") == [] and not list((run / "checkpoints").glob(".tmp-*"))


# ---------------------------------------------------------------------------- NaN guard


def test_nan_guard_cannot_loop(tmp_path, capfd):
    run = tmp_path / "run"
    config = write_config(tmp_path, run, steps=60, checkpoint_every=1, keep_checkpoints=1, nan_guard_rollback=1,
                          lr=1e30, warmup_steps=0)
    rc, err = train(capfd, config)
    line = the_line(err, "meshfold: rank 0: NonFiniteError")
    assert rc == 1 and ("giving up" in line), err
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) < 20  # bounded: not 60 steps of rollbacks
    steps = [p.name for p in published(run / "checkpoints")]
    assert "step-1" in steps  # the known-good checkpoint (the one rolled back to) was never rotated out
    good = {r["step"] for r in metrics if not r.get("nonfinite")}
    assert {int(s[5:]) for s in steps} <= good  # nothing published from a non-finite step


# ---------------------------------------------------------------------------- signals


def _meshfold(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshfold", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _wait_for_step(run: Path, proc: subprocess.Popen, step: int, timeout: float = 600) -> None:
    """Until the run logged ``step`` (a generous limit: the shared test machine can be very
    loaded); the process is killed if it never does, so no run is left behind."""
    end = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(proc.communicate())
        if metrics.exists() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines()
                                    if x.strip().endswith("}")):
            return
        time.sleep(0.1)
    proc.kill()
    proc.communicate()
    raise AssertionError("no step logged")


def test_sigterm_under_nproc_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = _meshfold(["train", write_config(tmp_path, run, steps=10_000, checkpoint_every=0), "--nproc", "2"])
    try:
        _wait_for_step(run, proc, 1)
        proc.send_signal(signal.SIGTERM)  # to the launcher, which passes it on
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    line = the_line(err, "meshfold: stopped by SIGTERM after step")
    assert "Traceback" not in err and "SignalException" not in err
    step = int(line.split("after step ")[1].split(";")[0])
    assert [p.name for p in published(run / "checkpoints")] == [f"step-{step}"]  # written by both ranks


def test_worker_dies_with_its_launcher(tmp_path):
    # A launcher killed with SIGKILL: its worker (die_with_parent, as under --nproc) goes with it.
    child = ("import os, time; os.environ.update(LOCAL_RANK='0', WORLD_SIZE='1'); "
             "from meshfold.launch import die_with_parent; die_with_parent(); print('ready', flush=True); "
             "time.sleep(120)")
    parent = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}], "
              f"stdout=subprocess.PIPE, text=True); p.stdout.readline(); print(p.pid, flush=True); "
              f"import time; time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    try:
        assert _running(worker)
    finally:
        proc.kill()
        proc.wait()
    end = time.monotonic() + 20
    while time.monotonic() < end and _running(worker):
        time.sleep(0.05)
    assert not _running(worker), "a worker outlived its launcher"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_second_signal_exits_at_once(tmp_path):
    run = tmp_path / "run"
    proc = _meshfold(["train", write_config(tmp_path, run, steps=10_000, checkpoint_every=0)])
    try:
        _wait_for_step(run, proc, 1)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), err  # the kernel picks the order
    assert "again: stopping now, without a checkpoint" in the_line(err, "meshfold: rank 0:")
    assert "Traceback" not in err and published(run / "checkpoints") == []


# ---------------------------------------------------------------------------- convert


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, vocab_size=320, max_position_embeddings=16)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf") / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def test_convert_never_destroys(hf_folder, tmp_path, capfd):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(hf_folder, hf)
    imported, exported = tmp_path / "imported", tmp_path / "exported"
    assert main(["convert", "import", str(hf), str(imported)]) == 0
    assert main(["convert", "export", str(imported), str(exported)]) == 0
    capfd.readouterr()
    before = snapshot(hf, imported, exported)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    before.update(snapshot(other))
    for argv, expected in (
        (["export", str(imported), str(hf)], "is (or holds, or is inside) the input"),  # the model's own source
        (["export", str(imported), str(hf), "--overwrite"], "is (or holds, or is inside) the input"),
        (["export", str(imported), str(imported / "hf")], "is (or holds, or is inside) the input"),
        (["export", str(imported), str(other)], "is not empty"),
        (["export", str(imported), str(other), "--overwrite"], "replaces only a folder meshfold wrote"),
        (["export", str(imported), str(exported)], "or --overwrite: meshfold wrote it"),
        (["import", str(hf), str(imported)], "or --overwrite: meshfold wrote it"),
        (["import", str(hf), str(hf / "sub")], "is (or holds, or is inside) the input"),
    ):
        assert main(["convert", *argv]) == 2, argv
        assert expected in the_line(capfd.readouterr().err), argv
        unchanged(before)
    assert main(["convert", "export", str(imported), str(exported), "--overwrite"]) == 0  # meshfold wrote it


def test_convert_import_checks_shapes_and_corrupt_files(hf_folder, tmp_path, capfd):
    import shutil

    cases = {
        "shape": (lambda d: (d / "config.json").write_text(json.dumps(
            {**json.loads((d / "config.json").read_text()), "intermediate_size": 64})),
            "do not have the shapes"),
        "config": (lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        "weights": (lambda d: (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!"),
                    "model.safetensors is not a readable safetensors file"),
    }
    for name, (damage, expected) in cases.items():
        hf = tmp_path / name
        shutil.copytree(hf_folder, hf)
        damage(hf)
        before = snapshot(hf)
        capfd.readouterr()
        assert main(["convert", "import", str(hf), str(tmp_path / f"out-{name}")]) == 2, name
        assert expected in the_line(capfd.readouterr().err), name
        unchanged(before)
        assert not (tmp_path / f"out-{name}").exists() and not list(tmp_path.glob(".tmp-*"))


# ---------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from meshfold.config import DataConfig
    from meshfold.data.sources import load_documents
    from meshfold.data.tokenizer import get_tokenizer

    root = tmp_path_factory.mktemp("data")
    docs = load_documents(DataConfig(max_docs=40))
    tok = get_tokenizer("", docs, 320, str(root / "cache"))
    tok.save(str(root / "tokenizer.json"))
    with (root / "a.jsonl").open("w") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d}) + "\n")
    assert main(["prepare", str(root / "a.jsonl"), "--tokenizer", str(root / "tokenizer.json"),
                 "--out", str(root / "ds"), "--quiet"]) == 0
    return root


def test_corrupt_shard_and_out_of_vocabulary_ids(prepared, tmp_path, capfd):
    import shutil

    for case in ("flip", "oov"):
        ds = tmp_path / case
        shutil.copytree(prepared / "ds", ds)
        shard = ds / "shard-00000.bin"
        tokens = np.fromfile(shard, dtype="<u2")
        if case == "flip":  # same size, other bytes
            tokens[len(tokens) // 2] ^= 0x0001
            tokens.tofile(shard)
        else:  # an id past the vocabulary, with the manifest's hash made to match
            tokens[len(tokens) // 2] = 5000
            tokens.tofile(shard)
            m = read_manifest(ds)
            import hashlib

            m["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
            write_manifest(ds, m)
        before = snapshot(ds)
        rc, err = train(capfd, write_config(tmp_path, tmp_path / f"run-{case}"), f"data.source='{ds}'",
                        "data.max_docs=0")
        line = the_line(err)
        assert rc == 2 and str(shard) in line, err
        assert ("sha256 differs" if case == "flip" else "token id 5000 is outside the vocabulary") in line
        unchanged(before)


def test_non_utf8_source_and_failed_prepare_leave_nothing(prepared, tmp_path, capfd):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    binary = tmp_path / "blob"
    binary.write_bytes(bytes(range(256)) * 10)
    before = snapshot(bad, binary)
    for src, expected in ((bad, "not UTF-8 text"), (binary, "a binary file")):
        rc, err = train(capfd, write_config(tmp_path, tmp_path / "run"), f"data.source='{src}'")
        assert rc == 2 and str(src) in the_line(err) and expected in the_line(err), err
    # prepare on bad input: one line, and no half-written --out the next run would refuse
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{broken\n')
    before.update(snapshot(bad_jsonl))
    for src, expected in ((bad_jsonl, "bad.jsonl:2: not valid JSON"), (bad, "not UTF-8 text")):
        capfd.readouterr()
        assert main(["prepare", str(src), "--tokenizer", str(prepared / "tokenizer.json"),
                     "--out", str(tmp_path / "out"), "--quiet"]) == 2
        assert expected in the_line(capfd.readouterr().err)
        assert not (tmp_path / "out").exists()
    unchanged(before)
