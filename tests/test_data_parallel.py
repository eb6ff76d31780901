"""Data parallel (DDP, ZeRO-1/2/3, HSDP) against a one-process reference, float64."""

import pytest

from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = tiny_config(str(tmp_path_factory.mktemp("ref")))
    return train_collect(cfg)


LAYOUTS = [
    pytest.param(2, {"dp_replicate": 2, "dp_shard": 1}, id="ddp2"),
    pytest.param(2, {"dp_shard": 2, "zero": 1}, id="fsdp2-zero1"),
    pytest.param(2, {"dp_shard": 2, "zero": 2}, id="fsdp2-zero2"),
    pytest.param(2, {"dp_shard": 2, "zero": 3}, id="fsdp2-zero3"),
    pytest.param(4, {"dp_shard": 4, "zero": 1}, id="fsdp4-zero1"),
    pytest.param(4, {"dp_shard": 4, "zero": 2}, id="fsdp4-zero2"),
    pytest.param(4, {"dp_shard": 4, "zero": 3}, id="fsdp4-zero3"),
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 2, "zero": 3}, id="hsdp2x2"),
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 2, "zero": 1}, id="hsdp2x2-zero1"),
]


@pytest.mark.parametrize("world,parallel", LAYOUTS)
def test_matches_one_process(world, parallel, reference, tmp_path):
    got = run_on(world, train_collect, tiny_config(str(tmp_path), parallel=parallel))[0]
    assert_runs_match(reference, got)


def test_micro_batches_match_one_process(reference, tmp_path):
    # 8 sequences over 2 ranks in micro-batches of 2: gradient accumulation is exact.
    got = run_on(2, train_collect, tiny_config(str(tmp_path), parallel={"dp_shard": 2, "zero": 3},
                                               train={"micro_batch": 2}))[0]
    assert_runs_match(reference, got)
