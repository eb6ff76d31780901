"""Every pipeline schedule at pp 2 and 4 with micro-batches = pp, 2pp and 3pp equals one
process (float64; losses, every parameter and last-step gradient at rtol 1e-9, atol
1e-11), under strict mode (tests/conftest.py): tagged p2p is refused and host tensors at
collectives fail, so these runs exercise exactly what NCCL would accept: tagless FIFO
exchange planned per channel (``pipeline.exchange_plan``), compute-dtype messages, no
per-step barrier, one all-gather for the loss and timings."""

import pytest

from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

MODEL = {"n_layers": 8}  # 8 stages at pp 4 for interleaved (v 2) and zbv
TRAIN = {"steps": 2, "global_batch": 24}  # divisible by every micro-batch count below


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("ref")), model=MODEL, train=TRAIN))


CASES = [pytest.param(schedule, pp, k * pp, id=f"{schedule}-pp{pp}-m{k * pp}")
         for pp in (2, 4) for schedule in ("gpipe", "1f1b", "interleaved", "zbv") for k in (1, 2, 3)]


@pytest.mark.parametrize("schedule,pp,micro", CASES)
def test_schedule_matches_one_process_under_strict_mode(schedule, pp, micro, reference, tmp_path):
    parallel = {"dp_shard": -1, "pp": pp, "pp_schedule": schedule, "pp_microbatches": micro,
                "pp_virtual_stages": 2 if schedule == "interleaved" else 1}
    got = run_on(pp, train_collect, tiny_config(str(tmp_path), model=MODEL, parallel=parallel, train=TRAIN))[0]
    assert_runs_match(reference, got)


def _pp_bytes(cfg_dict: dict) -> dict | None:
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg_dict))
    tr.train_step()
    sent = tr.ledger.pop_step().get("pp", 0)
    return {"pp": sent, "rank": dist.get_rank()}


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_activations_and_gradients_travel_in_the_compute_dtype(schedule, tmp_path):
    # Under bf16 autocast (fp32 parameters) a stage sends bf16: half the bytes of the same
    # run in fp32. The step's one pp all-gather of float64 loss/timings adds 4 x 8 bytes
    # x (pp - 1) = 32 bytes either way.
    parallel = {"dp_shard": -1, "pp": 2, "pp_schedule": schedule, "pp_microbatches": 2}
    got = {}
    for dtype in ("float32", "bfloat16"):
        cfg = tiny_config(str(tmp_path / dtype), model=MODEL, parallel=parallel,
                          train={"steps": 1, "dtype": dtype, "device": "cpu"})
        got[dtype] = run_on(2, _pp_bytes, cfg)
    for r in range(2):
        fp32, bf16 = got["float32"][r]["pp"] - 32, got["bfloat16"][r]["pp"] - 32
        assert fp32 > 0 and bf16 * 2 == fp32, (r, fp32, bf16)
