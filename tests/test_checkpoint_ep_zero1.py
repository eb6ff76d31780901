"""Checkpoints of expert parallel over DDP (zero 0) and ZeRO-1 data parallel: the experts'
Adam state sharded over edp, the dense state over the data ranks (``ExpertSplitAdamW``).
Resume is bit for bit in the same layout, the checkpoint loads into one process with the
parameters and moments the one-process run has, and checkpoints reshard between one process,
ep over ZeRO-1 and ep over DDP. float64."""

import shutil

import pytest
import torch

from meshfold.testing import run_on, tiny_config, train_chain, train_segment
from tests.test_checkpoint_zero1_tp import state_at

STEPS, SPLIT = 4, 2
MOE = {"moe_experts": 4, "moe_topk": 2, "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 1e-3,
       "moe_bias_balance": True, "moe_bias_update_rate": 1e-2}
LAYOUTS = {"ep2-dp4-zero1": {"dp_shard": 4, "ep": 2, "zero": 1},
           "ep2-ddp4-zero0": {"dp_replicate": 4, "ep": 2, "zero": 0}}


def _cfg(run_dir, parallel=None, **train):
    return tiny_config(str(run_dir), parallel=parallel or {"dp_shard": -1}, model=MOE,
                       train={"steps": STEPS, **train})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each layout: SPLIT steps, checkpointed (a run directory to copy)."""
    out = {}
    for name, parallel in LAYOUTS.items():
        run_dir = tmp_path_factory.mktemp(name)
        out[name] = run_dir, run_on(4, train_segment, _cfg(run_dir, parallel), SPLIT)[0]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_resume_is_bitwise(saved, layout, tmp_path):
    # SPLIT steps, checkpoint, resume, the rest == STEPS steps straight, bit for bit.
    parallel = LAYOUTS[layout]
    straight = run_on(4, train_segment, _cfg(tmp_path / "straight", parallel), STEPS, save=False)[0]
    shutil.copytree(saved[layout][0], tmp_path / "resumed")
    second = run_on(4, train_segment, _cfg(tmp_path / "resumed", parallel), STEPS, save=False)[0]
    assert second["start"] == SPLIT
    assert saved[layout][1]["losses"] + second["losses"] == straight["losses"]
    for name, value in straight["params"].items():
        assert torch.equal(second["params"][name], value), name


RESHARD_CHAIN = [  # (world, [parallel], stop step): every segment resumes the previous one's checkpoint
    (1, None, 1),  # one process
    (4, LAYOUTS["ep2-dp4-zero1"], 2),  # reads whole tensors into both parts' boxes (dense over 4, experts over 2)
    (4, LAYOUTS["ep2-ddp4-zero0"], 3),  # reads those boxes into replicated state (experts: DTensors over ep)
    (1, None, STEPS),  # one process again
]


def test_reshard_through_ep_zero1_and_zero0(tmp_path):
    # One process -> ep 2 over ZeRO-1 dp 4 -> ep 2 over DDP 4 -> one process: every step's loss and
    # the final parameters equal the one-process run that never stopped, to float64 rounding of
    # the reordered data-parallel sums (rtol 1e-9, atol 1e-11). Adam moments loaded wrong into any
    # part would move the parameters of the steps after far more than that.
    reference = train_segment(_cfg(tmp_path / "ref"), STEPS, save=False)
    starts, losses, params = train_chain(RESHARD_CHAIN, lambda _, parallel: _cfg(tmp_path / "chain", parallel))
    assert starts == [0, 1, 2, 3]
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-9, atol=1e-11)
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"{n}: {m}")


def test_ep_zero1_checkpoint_loads_into_one_process(saved, tmp_path):
    # Both parts' boxes (dense over 4 ranks, experts over edp = 2) tile every moment once: loaded
    # by one process they are the one-process run's moments at that step, to float64 rounding of
    # the reordered data-parallel sums (tolerances as tests/test_checkpoint_zero1_tp.py's).
    train_segment(_cfg(tmp_path / "one"), SPLIT)
    own = state_at(_cfg(tmp_path / "one"))
    shutil.copytree(saved["ep2-dp4-zero1"][0], tmp_path / "loaded")
    loaded = state_at(_cfg(tmp_path / "loaded"))
    assert own["start"] == loaded["start"] == SPLIT
    assert loaded["steps"] == own["steps"] and set(own["steps"].values()) == {float(SPLIT)}
    assert set(loaded["moments"]) == set(own["moments"]) and any(".experts." in k for k in own["moments"])
    for name, value in own["params"].items():
        torch.testing.assert_close(loaded["params"][name], value, rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for name, value in own["moments"].items():
        scale = value.abs().max().item()
        torch.testing.assert_close(loaded["moments"][name], value, rtol=1e-8, atol=1e-12 * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")
