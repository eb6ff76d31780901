"""A checkpoint saved before the MoE experts' w1 and w3 became one w13 still resumes, in its
own layout bit for bit and in others to float64 rounding (train/renamed_keys.py). The old
checkpoint is written by the one-process run with its state dict cut the way meshfold
saved it then: w1 = w13[:, :F], w3 = w13[:, F:] for the weights and their Adam moments."""

import shutil

import pytest
import torch

from meshfold.testing import run_on, tiny_config, train_segment
from meshfold.train.checkpoint import Checkpointer
from meshfold.train.checkpoint_files import CheckpointError, read_dcp_metadata, validate_checkpoint

STEPS, SPLIT = 4, 2
MOE = {"moe_experts": 4, "moe_topk": 2, "n_layers": 2}


def _cfg(run_dir, parallel=None):
    return tiny_config(str(run_dir), model=MOE, parallel=parallel or {"dp_shard": -1}, train={"steps": STEPS})


def _as_before_w13(sd: dict) -> dict:
    for top in ("model", "optim"):
        part = sd[top]
        for key in [k for k in part if ".experts.w13" in k]:
            value = part.pop(key)
            w1, w3 = key.replace(".w13", ".w1"), key.replace(".w13", ".w3")
            if torch.is_tensor(value) and value.ndim == 3:
                f = value.shape[1] // 2
                part[w1], part[w3] = value[:, :f].contiguous(), value[:, f:].contiguous()
            else:
                part[w1] = part[w3] = value
    return sd


def _train_saving_old_names(cfg: dict, stop: int) -> dict:
    own = Checkpointer.state_dict
    Checkpointer.state_dict = lambda self: _as_before_w13(own(self))
    try:
        return train_segment(cfg, stop)
    finally:
        Checkpointer.state_dict = own


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """(the straight one-process run's result, a run dir holding a step-SPLIT checkpoint in the old names)."""
    root = tmp_path_factory.mktemp("renamed")
    straight = train_segment(_cfg(root / "straight"), STEPS, save=False)
    _train_saving_old_names(_cfg(root / "old"), SPLIT)
    return straight, root / "old"


def test_old_checkpoint_has_only_the_old_names(old_run):
    meta = read_dcp_metadata(old_run[1] / "checkpoints" / f"step-{SPLIT}").state_dict_metadata
    key = "layers.0.feed_forward.experts"
    assert f"model.{key}.w1" in meta and f"model.{key}.w3" in meta and f"optim.state.{key}.w1.exp_avg" in meta
    assert not any(".w13" in k for k in meta)


def test_old_names_resume_bitwise_in_one_process(old_run, tmp_path):
    straight, old = old_run
    shutil.copytree(old, tmp_path / "run")
    second = train_segment(_cfg(tmp_path / "run"), STEPS, save=False)
    assert second["start"] == SPLIT
    assert second["losses"] == straight["losses"][SPLIT:]
    for name, value in straight["params"].items():
        assert torch.equal(second["params"][name], value), name


@pytest.mark.parametrize("world,parallel", [
    (2, {"dp_shard": 2, "ep": 2}),  # experts as DTensor shards over ep (FSDP over edp = 1)
    (4, {"tp": 2, "dp_shard": 2, "zero": 1}),  # ZeRO-1 boxes: w13's rows cut at w1|w3 inside a box
], ids=["ep2", "tp2xdp2-zero1"])
def test_old_names_resume_in_other_layouts(old_run, tmp_path, world, parallel):
    # Each step's loss and the final parameters equal the one-process run that never stopped,
    # to float64 rounding (the layouts reduce in other orders): rtol 1e-9, atol 1e-11.
    straight, old = old_run
    shutil.copytree(old, tmp_path / "run")
    got = run_on(world, train_segment, _cfg(tmp_path / "run", parallel), STEPS, save=False)[0]
    assert got["start"] == SPLIT
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(straight["losses"][SPLIT:]),
                               rtol=1e-9, atol=1e-11)
    for name, value in straight["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")


def test_old_names_export_like_new_ones(old_run, tmp_path):
    # convert export / btm read whole tensors: the old checkpoint gives the new names, the same
    # values as a checkpoint of the same run saved with them
    from meshfold.convert import read_checkpoint_model

    train_segment(_cfg(tmp_path / "new"), SPLIT)
    new, _ = read_checkpoint_model(tmp_path / "new" / "checkpoints" / f"step-{SPLIT}")
    old, _ = read_checkpoint_model(old_run[1] / "checkpoints" / f"step-{SPLIT}")
    assert set(old) == set(new) and any(k.endswith(".w13") for k in new)
    for name, value in new.items():
        assert torch.equal(old[name], value), name


def test_old_names_of_another_shape_are_refused(old_run):
    path = old_run[1] / "checkpoints" / f"step-{SPLIT}"
    key = "model.layers.0.feed_forward.experts.w13"
    shape = tuple(read_dcp_metadata(path).state_dict_metadata[key.replace("w13", "w1")].size)
    validate_checkpoint(path, {key: (shape[0], 2 * shape[1], shape[2])})
    with pytest.raises(CheckpointError, match=r"saved as .*w1, .*w3, which do not join into its shape"):
        validate_checkpoint(path, {key: (shape[0], 2 * shape[1] + 2, shape[2])})
