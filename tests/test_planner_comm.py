"""The planner's communication bytes use the runtime's convention (meshfold/comm.py): the
bytes rank 0 records in one real training step on gloo processes equal the prediction."""

from __future__ import annotations

import pytest

from meshfold.testing import run_on, tiny_config


def _one_step_bytes(cfg_dict: dict) -> dict | None:
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    trainer.ledger.pop_step()  # set-up traffic is not a step's
    trainer.train_step()
    out = trainer.ledger.pop_step()
    return out if dist.get_rank() == 0 else None


def _predicted(cfg_dict: dict, world: int) -> dict:
    from meshfold.config import from_dict
    from meshfold.planner.cli import layout_from_config, workload_from_config
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.cost import CostModel

    cfg = from_dict(cfg_dict)
    cluster = load_cluster("cpu", devices=world)
    layout = layout_from_config(cfg, world)
    return CostModel(workload_from_config(cfg, cluster), cluster).estimate(layout).comm_bytes


@pytest.mark.parametrize("parallel,micro", [
    ({"dp_shard": 4, "zero": 1}, 0),  # DDP all-reduce + ZeRO-1 gather of updated shards
    ({"dp_shard": 4, "zero": 2}, 1),  # FSDP2 per micro-batch, 2 micro-batches
    ({"dp_shard": 4, "zero": 3}, 0),  # FSDP2 with re-gather in backward
    ({"dp_replicate": 2, "dp_shard": 2, "zero": 3}, 0),  # HSDP
])
def test_dp_comm_bytes_match_runtime(tmp_path, parallel, micro):
    cfg = tiny_config(str(tmp_path / "run"), parallel=parallel, train={"micro_batch": micro, "steps": 1})
    measured = run_on(4, _one_step_bytes, cfg)[0]
    predicted = _predicted(cfg, 4)
    assert set(predicted) == set(measured), (predicted, measured)
    for dim, value in measured.items():
        assert predicted[dim] == pytest.approx(value, rel=1e-6, abs=2), (dim, predicted, measured)


@pytest.mark.parametrize("parallel,rel", [
    ({"tp": 2, "dp_shard": 2, "zero": 3}, 1e-6),  # Megatron tp around FSDP
    ({"tp": 2, "sp": True, "dp_shard": 2}, 1e-6),  # sequence parallel: gathers, re-gathers
    ({"cp": 2, "dp_shard": 2, "zero": 2}, 0.02),  # ring: + a few bytes of chunk metadata
    ({"pp": 2, "dp_shard": 2, "zero": 1}, 0.01),  # activations + small control messages
])
def test_model_parallel_comm_bytes_match_runtime(tmp_path, parallel, rel):
    cfg = tiny_config(str(tmp_path / "run"), parallel=parallel, train={"steps": 1})
    measured = run_on(4, _one_step_bytes, cfg)[0]
    predicted = _predicted(cfg, 4)
    assert set(predicted) == set(measured), (predicted, measured)
    for dim, value in measured.items():
        assert predicted[dim] == pytest.approx(value, rel=rel), (dim, predicted, measured)
