"""Expert tensor parallel (``parallel.expert_tp = tp``: each expert's FFN split over the tp
group, ep folded over dp x cp) against a one-process reference, float64: losses over 5
steps, every gradient and parameter; and its layout checks."""

import pytest

from meshfold.config import ConfigError, from_dict, validate
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

# 4 experts of width 64 (tiny_config's ffn): ep 2 x tp 2 holds 2 experts a rank, each half-wide
MOE = {"moe_experts": 4, "moe_topk": 2, "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 1e-3}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("ref")), model=MOE))


@pytest.mark.parametrize("parallel", [
    pytest.param({"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2}, id="ep2xetp2-fsdp"),
    pytest.param({"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2, "sp": True}, id="ep2xetp2-sp"),
    pytest.param({"dp_shard": 2, "tp": 2, "expert_tp": 2}, id="ep1-etp2-fsdp"),
    pytest.param({"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2, "zero": 1}, id="ep2xetp2-zero1"),
    pytest.param({"dp_replicate": 2, "tp": 2, "expert_tp": 2, "zero": 0}, id="ep1-etp2-ddp"),
    pytest.param({"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2, "ep_overlap_chunks": 2}, id="ep2xetp2-chunks2"),
])
def test_expert_tp_matches_one_process(parallel, ref, tmp_path):
    got = run_on(4, train_collect, tiny_config(str(tmp_path), model=MOE, parallel=parallel))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


CAPACITY = {**MOE, "moe_capacity_factor": 1.0, "moe_shared_experts": 1}


def test_expert_tp_capacity_matches_one_process(tmp_path):
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=CAPACITY))
    got = run_on(4, train_collect, tiny_config(str(tmp_path / "etp"), model=CAPACITY,
                                               parallel={"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2}))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("zero", [2], ids=["fsdp"])
def test_checkpoint_from_expert_tp_resumes_in_one_process(zero, tmp_path):
    # The experts' strided w13 (and its Adam moments) go through DCP replicated over tp and
    # reload unsharded: 3 steps at ep 2 x etp 2 + 2 resumed one-process steps = 5 one-process steps.
    train = {"min_lr_ratio": 1.0}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=MOE, train=train))
    run_dir = str(tmp_path / "etp")
    first = run_on(4, train_collect, tiny_config(
        run_dir, model=MOE, parallel={"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2, "zero": zero},
        train={**train, "steps": 3, "checkpoint_every": 3}))[0]
    got = train_collect(tiny_config(run_dir, model=MOE, train={**train, "steps": 5}))
    assert len(first["losses"]) == 3 and len(got["losses"]) == 2
    got["losses"] = first["losses"] + got["losses"]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
