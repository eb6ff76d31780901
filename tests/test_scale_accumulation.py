"""Gradient accumulation without per-micro-batch traffic: data-parallel bytes per step,
measured at the communication layer (FSDP2's own collectives routed through it, DDP's comm
hook, the GradReducer), are the same with 4 micro-batches as with 1 for zero 0, 1 and 2,
and the 4-micro-batch run still matches one process exactly (float64)."""

import pytest

from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect


def _step_bytes(cfg_dict: dict) -> dict | None:
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    trainer.ledger.pop_step()  # set-up traffic is not a step's
    out = []
    for _ in range(2):
        trainer.train_step()
        out.append(trainer.ledger.pop_step())
    return out if dist.get_rank() == 0 else None


LAYOUTS = [
    pytest.param(2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}, id="ddp-zero0"),
    pytest.param(2, {"dp_shard": 2, "zero": 1}, id="zero1"),
    pytest.param(2, {"dp_shard": 2, "zero": 2}, id="fsdp-zero2"),
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 2, "zero": 2}, id="hsdp-zero2"),
    pytest.param(4, {"tp": 2, "dp_shard": 2, "zero": 1}, id="tp2-zero1"),
    pytest.param(4, {"pp": 2, "dp_shard": 2, "zero": 1}, id="pp2-zero1"),
    pytest.param(4, {"pp": 2, "dp_shard": 2, "zero": 2}, id="pp2-zero2"),
]


@pytest.mark.parametrize("world,parallel", LAYOUTS)
def test_dp_bytes_independent_of_micro_batches(world, parallel, tmp_path):
    dp = parallel.get("dp_replicate", 1) * parallel.get("dp_shard", 1)
    local = 4  # sequences per data-parallel rank
    runs = {}
    for m in (1, 4):
        train = {"steps": 2, "global_batch": local * dp}
        if "pp" in parallel:
            par = {**parallel, "pp_microbatches": m}
        else:
            par, train["micro_batch"] = parallel, local // m
        runs[m] = run_on(world, _step_bytes, tiny_config(str(tmp_path / str(m)), parallel=par, train=train))[0]
    for one, four in zip(runs[1], runs[4]):
        assert one["dp"] > 0
        assert four["dp"] == one["dp"], (one, four)


def test_zero3_gathers_per_micro_batch_but_reduces_once(tmp_path):
    # ZeRO-3 re-gathers parameters for every micro-batch (its meaning), but its
    # reduce-scatter runs once: 4 micro-batches cost less than 4x one.
    runs = {}
    for m in (1, 4):
        cfg = tiny_config(str(tmp_path / str(m)), parallel={"dp_shard": 2, "zero": 3},
                          train={"steps": 2, "micro_batch": 4 // m})
        runs[m] = run_on(2, _step_bytes, cfg)[0][1]["dp"]
    assert runs[1] < runs[4] < 4 * runs[1]


@pytest.mark.parametrize("parallel", [
    pytest.param({"dp_shard": 2, "zero": 2}, id="zero2"),
    pytest.param({"dp_shard": 2, "zero": 3}, id="zero3"),
])
def test_accumulated_fsdp_matches_one_process(parallel, tmp_path):
    ref = train_collect(tiny_config(str(tmp_path / "ref")))
    got = run_on(2, train_collect, tiny_config(str(tmp_path / "run"), parallel=parallel,
                                               train={"micro_batch": 1}))[0]
    assert_runs_match(ref, got)


@pytest.mark.parametrize("zero", [1, 2])
def test_zbv_dp_bytes_independent_of_micro_batches(zero, tmp_path):
    # ZB-V: two chunks per pipeline rank (stages r and 2p-1-r), each reduced once, in its
    # last backward of the step: by the gradient reducer (zero 1, in the chunk's last W of
    # the split backward) or by FSDP2 (zero 2, in its last B; FSDP keeps the backward
    # whole); with 4 micro-batches it still matches one process exactly.
    def cfg(m: int, run: str) -> dict:
        return tiny_config(str(tmp_path / run), model={"n_layers": 4},
                           parallel={"pp": 2, "pp_schedule": "zbv", "dp_shard": 2, "zero": zero,
                                     "pp_microbatches": m},
                           train={"steps": 2, "global_batch": 8})

    runs = {m: run_on(4, _step_bytes, cfg(m, str(m)))[0] for m in (1, 4)}
    for one, four in zip(runs[1], runs[4]):
        assert one["dp"] > 0
        assert four["dp"] == one["dp"], (one, four)
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model={"n_layers": 4}, train={"steps": 2}))
    assert_runs_match(ref, run_on(4, train_collect, cfg(4, "run"))[0])
