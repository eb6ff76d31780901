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
])
def test_expert_tp_matches_one_process(parallel, ref, tmp_path):
    got = run_on(4, train_collect, tiny_config(str(tmp_path), model=MOE, parallel=parallel))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
