"""Megatron's layouts (tensor x pipeline x data parallel with DDP or a ZeRO-1 distributed
optimizer) and once-per-step gradient reduction, against a one-process reference, float64.

Tolerances: rtol 1e-9 / atol 1e-11 (only the summation order differs from one process).
"""

import pytest

from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

RTOL, ATOL = 1e-9, 1e-11


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("ref"))))


LAYOUTS = [
    pytest.param(4, {"tp": 2, "dp_replicate": 2, "dp_shard": 1, "zero": 0}, {}, id="tp2xddp2-zero0"),
    pytest.param(4, {"tp": 2, "dp_shard": 2, "zero": 1}, {}, id="tp2xdp_shard2-zero1"),
    pytest.param(4, {"pp": 2, "dp_shard": 2, "zero": 1, "pp_microbatches": 2}, {}, id="pp2xdp_shard2-zero1"),
    pytest.param(8, {"tp": 2, "pp": 2, "dp_shard": 2, "zero": 1, "pp_microbatches": 2}, {},
                 id="tp2xpp2xdp2-zero1"),
    # Gradient accumulation over 2 micro-batches: the reducer runs once, in the last backward.
    pytest.param(4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 1}, {"micro_batch": 2}, id="tp2-sp-zero1-micro"),
]


@pytest.mark.parametrize("world,parallel,train", LAYOUTS)
def test_matches_one_process(world, parallel, train, reference, tmp_path):
    got = run_on(world, train_collect, tiny_config(str(tmp_path), parallel=parallel, train=train))[0]
    assert_runs_match(reference, got, rtol=RTOL, atol=ATOL)
