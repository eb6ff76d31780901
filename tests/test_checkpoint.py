"""Checkpoints: exact resume, resharding into other layouts, atomic publish, corrupted and
mismatched checkpoints skipped, a failed save (file-size limit = full disk) keeps the last
good one, keep-last-k. float64, one-process references computed here."""

import json
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch

from meshfold.config import from_dict
from meshfold.testing import run_on, tiny_config, train_chain, train_segment
from meshfold.train.checkpoint_files import CheckpointError, published, validate_checkpoint

STEPS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, STEPS steps straight, no checkpoints."""
    return train_segment(tiny_config(str(tmp_path_factory.mktemp("ref")), train={"steps": STEPS}), STEPS, save=False)


def _cfg(run_dir, parallel=None, **train):
    return tiny_config(str(run_dir), parallel=parallel or {"dp_shard": -1},
                       train={"steps": STEPS, **train})


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_exact_resume_is_bitwise(reference, tmp_path, async_save):
    # N/2 steps, stop, resume, N/2 steps == N steps straight, bit for bit (same layout, CPU).
    cfg = _cfg(tmp_path, async_checkpoint=async_save)
    first = train_segment(cfg, STEPS // 2)
    second = train_segment(cfg, STEPS, save=False)
    assert second["start"] == STEPS // 2
    assert first["losses"] + second["losses"] == reference["losses"]
    for name, value in reference["params"].items():
        assert torch.equal(second["params"][name], value), name


def test_exact_resume_on_two_ranks_is_bitwise(tmp_path):
    # The same holds inside a process group: FSDP2 (ZeRO-3) on 2 ranks, 3 + 3 steps == 6 steps.
    parallel = {"dp_shard": 2, "zero": 3}
    straight = run_on(2, train_segment, _cfg(tmp_path / "straight", parallel), STEPS, save=False)[0]
    run_on(2, train_segment, _cfg(tmp_path / "resumed", parallel), STEPS // 2)
    second = run_on(2, train_segment, _cfg(tmp_path / "resumed", parallel), STEPS, save=False)[0]
    assert second["start"] == STEPS // 2
    assert second["losses"] == straight["losses"][STEPS // 2:]
    for name, value in straight["params"].items():
        assert torch.equal(second["params"][name], value), name


RESHARD_CHAIN = [  # (world, [parallel], stop step): every segment resumes the previous one's checkpoint
    (4, {"dp_shard": 4, "zero": 3}, 1),  # FSDP2 ZeRO-3
    (4, {"dp_replicate": 2, "dp_shard": 2, "zero": 3}, 2),  # HSDP
    (2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}, 3),  # DDP, on 2 ranks (asynchronous save)
    (4, {"tp": 2, "dp_shard": 2}, 4),  # Megatron TP on DTensors inside FSDP2
    (4, {"pp": 2, "dp_shard": 2}, STEPS),  # pipeline: each stage holds only its layers
]


def test_reshard_through_every_layout(reference, tmp_path):
    # Saved under one [parallel], loaded under the next: dp_shard 4 -> dp_replicate 2 x dp_shard 2
    # -> DDP 2 -> tp 2 x dp_shard 2 -> pp 2 x dp_shard 2. Every step's loss and the final
    # parameters equal the one-process run that never stopped, to float64 rounding (the
    # layouts reduce in different orders): rtol 1e-9, atol 1e-11.
    starts, losses, params = train_chain(
        RESHARD_CHAIN, lambda world, parallel: _cfg(tmp_path, parallel, async_checkpoint=world == 2))
    assert starts == [0, 1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-9, atol=1e-11)
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")


def test_reshard_zero1_to_one_process(reference, tmp_path):
    # ZeRO-1 ranks each write the Adam state of the parameters they own; one process reads it all.
    a = run_on(2, train_segment, _cfg(tmp_path, {"dp_shard": 2, "zero": 1}), 3)[0]
    b = train_segment(_cfg(tmp_path), STEPS, save=False)
    got = torch.tensor(a["losses"] + b["losses"], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-9, atol=1e-11)


# --------------------------------------------------------------------------- safety


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run directory with checkpoints at steps 2 and 4 (one process)."""
    run = tmp_path_factory.mktemp("saved")
    train_segment(_cfg(run), 2)
    train_segment(_cfg(run), 4)
    return run


def _damage_truncate(ckpt: Path):
    f = ckpt / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _damage_flip(ckpt: Path):
    f = ckpt / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _damage_shape(ckpt: Path, tmp_path: Path):
    # step-4 replaced by an intact checkpoint of a model with another shape (dim 48).
    other = tmp_path / "other"
    cfg = _cfg(other)
    cfg["model"]["dim"] = 48
    train_segment(cfg, 1)
    shutil.rmtree(ckpt)
    shutil.copytree(other / "checkpoints" / "step-1", ckpt)


def _damage_partial(ckpt: Path):
    (ckpt / "meshfold.json").unlink()


@pytest.mark.parametrize("damage,expected", [
    ("truncate", "bytes, the manifest says"),
    ("flip", "does not match its SHA-256"),
    ("shape", "has shape (320, 48) in the checkpoint but (320, 32)"),
    ("partial", "no meshfold.json"),
])
def test_damaged_checkpoint_is_skipped(reference, saved_run, tmp_path, capfd, damage, expected):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    step4 = run / "checkpoints" / "step-4"
    if damage == "shape":
        _damage_shape(step4, tmp_path)
    else:
        {"truncate": _damage_truncate, "flip": _damage_flip, "partial": _damage_partial}[damage](step4)
    capfd.readouterr()
    resumed = train_segment(_cfg(run), STEPS, save=False)
    err = capfd.readouterr().err
    assert "skipping step-4" in err and expected in err, err
    assert resumed["start"] == 2  # the previous good checkpoint
    assert resumed["losses"] == reference["losses"][2:]


def test_validate_names_missing_file(saved_run, tmp_path):
    ckpt = tmp_path / "step-2"
    shutil.copytree(saved_run / "checkpoints" / "step-2", ckpt)
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"file \.metadata is missing"):
        validate_checkpoint(ckpt)


def test_failed_save_keeps_last_good_and_publishes_atomically(reference, tmp_path, capfd):
    # A real write failure: RLIMIT_FSIZE makes the kernel refuse writes past 200 kB (EFBIG),
    # as a full disk would refuse them (ENOSPC). The save fails, nothing half-written is
    # visible, step-1 is untouched and still resumes exactly.
    from meshfold.train.trainer import Trainer

    cfg = _cfg(tmp_path, checkpoint_every=1)
    tr = Trainer(from_dict(cfg))
    tr.train_step()
    assert tr.checkpointer.save()
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "step-1").iterdir()}
    tr.train_step()
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, old_limit[1]))
    try:
        ok = tr.checkpointer.save()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert not ok
    assert "saving step 2 failed" in capfd.readouterr().err
    root = tmp_path / "checkpoints"
    assert [p.name for p in published(root)] == ["step-1"]
    assert not list(root.glob(".tmp-*"))
    assert {p.name: p.read_bytes() for p in (root / "step-1").iterdir()} == before
    validate_checkpoint(root / "step-1")
    resumed = train_segment(cfg, STEPS, save=False)
    assert resumed["start"] == 1 and resumed["losses"] == reference["losses"][1:]


def test_keep_last_k_and_manifest(tmp_path):
    from meshfold.train.trainer import Trainer

    cfg = _cfg(tmp_path, steps=4, checkpoint_every=1, keep_checkpoints=2)
    Trainer(from_dict(cfg)).fit()
    root = tmp_path / "checkpoints"
    assert [p.name for p in published(root)] == ["step-4", "step-3"]
    manifest = json.loads((root / "step-4" / "meshfold.json").read_text())
    assert manifest["step"] == 4 and manifest["model"]["dim"] == 32
    assert set(manifest["files"]) == {f for f in os.listdir(root / "step-4") if f != "meshfold.json"}
    # train.resume = never starts fresh even with checkpoints present.
    cfg["train"]["resume"] = "never"
    tr = Trainer(from_dict(cfg))
    assert tr.checkpointer.resume() is None and tr.step == 0


class Counter:
    """A component with its own state (as the low-comm outer optimizer registers)."""

    def __init__(self):
        self.value = torch.zeros(3, dtype=torch.float64)
        self.calls = 0

    def state_dict(self):
        return {"value": self.value, "calls": self.calls}

    def load_state_dict(self, state):
        self.value.copy_(state["value"])
        self.calls = state["calls"]


def test_registered_extra_state_round_trips(tmp_path):
    from meshfold.train.trainer import Trainer

    cfg = _cfg(tmp_path)
    tr = Trainer(from_dict(cfg))
    extra = Counter()
    tr.checkpointer.register("outer", extra)
    extra.value += torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    extra.calls = 7
    tr.train_step()
    tr.checkpointer.save()
    again = Trainer(from_dict(cfg))
    restored = Counter()
    again.checkpointer.register("outer", restored)
    assert again.checkpointer.resume() == 1
    assert restored.calls == 7 and torch.equal(restored.value, extra.value)


# ---------------------------------------------------------------------------- no pickle

PACKAGE = Path(__file__).resolve().parent.parent / "meshfold"


def test_package_loads_nothing_with_pickle():
    """No pickle-based loading anywhere in the package: no ``weights_only=False``, torch.load
    only with weights_only=True, no pickle/dill/marshal loads, DCP metadata read only from
    JSON (DCP's reader unpickles .metadata) and dcp.load only with the safe reader+planner
    (DCP's default planner loads plain values with weights_only=False)."""
    import re

    banned = re.compile(r"weights_only\s*=\s*False|pickle\.loads?\(|Unpickler|^\s*(import|from) (c?pickle|dill)\b|"
                        r"\bdill\b|cloudpickle|marshal\.loads?\(|read_metadata\(|dcp\.load\(")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        text = path.read_text()
        for no, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            hit = banned.search(code)
            if not hit:
                continue
            ok = (rel == "meshfold/train/checkpoint_files.py" and (
                "def read_metadata(" in code or  # SafeReader's own JSON reader
                ("dcp.load(" in code and "storage_reader=SafeReader" in code and "planner=SafeLoadPlanner" in code)))
            if not ok:
                found.append(f"{rel}:{no}: {line.strip()}")
        for call in re.finditer(r"torch\.load\(", text):  # every torch.load names weights_only=True
            if "weights_only=True" not in text[call.end(): call.end() + 200].split(")\n")[0]:
                found.append(f"{rel}: torch.load without weights_only=True")
    assert not found, "pickle-based loading in the package:\n" + "\n".join(found)


class _Exploit:
    """Unpickling this runs code (what a tampered checkpoint would carry)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tamper_plain_value(ckpt: Path, key: str, payload) -> None:
    """Rewrite ``key`` (a plain value) to unpickle ``payload``, the way an attacker who
    controls the folder would: new bytes appended to the data file, DCP's metadata
    pointed at them and every hash in the manifest recomputed (so validation passes)."""
    import io

    meta = json.loads((ckpt / "dcp_metadata.json").read_text())
    entry = next(s for s in meta["storage_data"] if s["fqn"] == key)
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = ckpt / entry["path"]
    entry["start"], entry["length"] = data.stat().st_size, len(buf.getvalue())
    with data.open("ab") as f:
        f.write(buf.getvalue())
    (ckpt / "dcp_metadata.json").write_text(json.dumps(meta))
    with (ckpt / ".metadata").open("wb") as f:  # and the pickled metadata DCP wrote: never read
        torch.save(payload, f)
    manifest = json.loads((ckpt / "meshfold.json").read_text())
    from meshfold.train.checkpoint_files import sha256_of

    for name in manifest["files"]:
        manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": sha256_of(ckpt / name)}
    (ckpt / "meshfold.json").write_text(json.dumps(manifest))


def test_tampered_state_file_is_refused_never_executed(tmp_path):
    from meshfold.train.trainer import Trainer

    cfg = _cfg(tmp_path / "run")
    tr = Trainer(from_dict(cfg))
    extra = Counter()
    tr.checkpointer.register("outer", extra)
    tr.train_step()
    tr.checkpointer.save()
    ckpt = tmp_path / "run" / "checkpoints" / "step-1"
    marker = tmp_path / "pwned"
    _tamper_plain_value(ckpt, "extra.outer.calls", _Exploit(marker))
    validate_checkpoint(ckpt)  # the attacker kept the manifest consistent
    again = Trainer(from_dict(cfg))
    again.checkpointer.register("outer", Counter())
    with pytest.raises(CheckpointError) as err:
        again.checkpointer.resume()
    msg = str(err.value)
    assert "refusing extra.outer.calls: not plain data" in msg and "\n" not in msg, msg
    assert not marker.exists()  # nothing ran
    # A plain value stays loadable (the refusal is about what the file holds, not its path).
    _tamper_plain_value(ckpt, "extra.outer.calls", 11)
    third = Trainer(from_dict(cfg))
    restored = Counter()
    third.checkpointer.register("outer", restored)
    assert third.checkpointer.resume() == 1 and restored.calls == 11


def _save_and_resume_hashes(run_dir: str) -> dict:
    """Two ranks save, then resume: which files each rank hashed at save and at resume."""
    import torch.distributed as dist

    import meshfold.train.checkpoint_files as files_mod
    from meshfold.train.trainer import Trainer

    hashed: list[str] = []
    real = files_mod.sha256_of

    def counting(path):
        hashed.append(Path(path).name)
        return real(path)

    files_mod.sha256_of = counting
    try:
        cfg = _cfg(run_dir, parallel={"dp_shard": 2})
        tr = Trainer(from_dict(cfg))
        tr.train_step()
        tr.checkpointer.save()
        at_save = sorted(hashed)
        hashed.clear()
        dist.barrier()
        again = Trainer(from_dict(cfg))
        assert again.checkpointer.resume() == 1
        at_resume = sorted(hashed)
    finally:
        files_mod.sha256_of = real
    return {"rank": dist.get_rank(), "save": at_save, "resume": at_resume}


def test_each_rank_hashes_the_files_it_wrote(tmp_path):
    res = run_on(2, _save_and_resume_hashes, str(tmp_path))
    ckpt = tmp_path / "checkpoints" / "step-1"
    files = set(json.loads((ckpt / "meshfold.json").read_text())["files"])
    assert not list(ckpt.glob("*_sha256.json"))  # sidecars merged into the manifest
    by_rank = {r["rank"]: r for r in res}
    for rank in (0, 1):
        mine = {f for f in files if f.startswith(f"__{rank}_")}
        assert mine and mine <= set(by_rank[rank]["save"])  # a rank hashes what it wrote...
        others = {f for f in files if f.startswith(f"__{1 - rank}_")}
        assert not others & set(by_rank[rank]["save"])  # ...and nothing another rank wrote
    # DCP's own metadata (written by the coordinator) is hashed by rank 0 alone.
    assert set(by_rank[1]["save"]) == {f for f in files if f.startswith("__1_")}
    # At resume the ranks split the files: disjoint shares covering everything.
    shares = [set(by_rank[r]["resume"]) for r in (0, 1)]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == files


def test_onebit_adam_owns_its_step_count():
    """1-bit Adam's checkpoint state (optim/state.py's protocol) carries its step count, which
    decides warm-up or compressed: a resume does not start the warm-up over. A checkpoint
    written before it kept the count reads as before (count 0)."""
    from meshfold.lowcomm.onebit_adam import OneBitAdam
    from meshfold.optim.state import ParamNames, state_of

    def built():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        return model, OneBitAdam(model.parameters(), None, 1, warmup_steps=2, lr=0.1)

    model, opt = built()
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    saved = state_of(opt).checkpoint_state(ParamNames(model))
    assert saved["onebit_t"] == 3
    again, restored = built()
    assert "onebit_t" in restored.checkpoint_template(ParamNames(again), set(saved))
    restored.load_checkpoint_state(ParamNames(again), saved)
    assert restored.t == 3 and restored.frozen
    first, second = next(iter(model.parameters())), next(iter(again.parameters()))
    assert torch.equal(restored.state[second]["m"], opt.state[first]["m"])
    older, before = built()
    old = {k: v for k, v in saved.items() if k != "onebit_t"}
    assert "onebit_t" not in before.checkpoint_template(ParamNames(older), set(old))
    before.load_checkpoint_state(ParamNames(older), old)
    assert before.t == 0
