"""ZeRO-1 under bf16 compute (``optim/sharded.py::ShardedAdamW`` with a compute dtype):
the updated parameters cross dp in bf16, gathered into the step's compute weights; each
rank keeps fp32 values for its own segment only, and the module's fp32 parameters are
freed between steps and gathered where they are read whole. Checked against the same layout with ZeRO-0 (every rank
updating whole fp32 parameters: the same reductions, so bit for bit), through checkpoints
(what is saved is the current fp32 masters; a resume continues bit for bit)."""

import shutil

import pytest
import torch

from meshfold.config import from_dict
from meshfold.testing import run_on, tiny_config, train_collect, train_segment

STEPS, SPLIT = 4, 2


MOE = {"moe_experts": 4, "moe_topk": 2}


def _bf16(run_dir, parallel, **train):
    # expert parallel needs MoE blocks
    cfg = tiny_config(str(run_dir), parallel=parallel, model=MOE if parallel.get("ep", 1) > 1 else {})
    cfg["train"].update({"dtype": "bfloat16", "steps": STEPS, **train})
    return cfg


def _zero1_source(cfg_dict: dict) -> dict:
    """The optimizer and compute-weights wiring a bf16 ZeRO-1 run builds (rank 0)."""
    from meshfold.optim.expert_split import ExpertSplitAdamW
    from meshfold.optim.sharded import ShardedAdamW
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg_dict))
    opt = tr.optimizer
    # (ep: the dense and the expert part, each a ShardedAdamW over its own ranks)
    segment = sum(o.segment for o in getattr(opt, "parts", [opt]))
    out = {"sharded": isinstance(opt, (ShardedAdamW, ExpertSplitAdamW)), "dtype": getattr(opt, "compute_dtype", None),
           "source": tr.engine.weights is not None and tr.engine.weights.source is opt}
    tr.train_step()
    # after a step the rank holds fp32 values for its own segment only (the module's fp32
    # parameters have no storage), until a checkpoint or full_state gathers them
    out["held"] = opt.held_param_bytes() / (segment * 4)
    tr.full_state()
    out["synced"] = opt.held_param_bytes() / (sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in tr.model.parameters()) * 4 + segment * 4)
    tr.checkpointer.close()
    tr.fault.close()
    return out


@pytest.mark.parametrize("zero1, zero0", [
    ({"dp_shard": 2, "zero": 1}, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}),  # DDP
    ({"tp": 2, "dp_shard": 2, "zero": 1}, {"tp": 2, "dp_replicate": 2, "dp_shard": 1, "zero": 0}),  # GradReducer
    ({"pp": 2, "dp_shard": 2, "zero": 1, "pp_microbatches": 2},  # pipeline stages: plain parameters, GradReducer
     {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "zero": 0, "pp_microbatches": 2}),
    # expert parallel: the experts' gradients over edp = 2, their bf16 gather over edp too
    ({"dp_shard": 4, "ep": 2, "zero": 1}, {"dp_replicate": 4, "dp_shard": 1, "ep": 2, "zero": 0}),
], ids=["ddp", "tp2", "pp2", "ep2-dp4"])
def test_bf16_zero1_equals_zero0_bitwise(tmp_path, zero1, zero0):
    # Same split, same reduction: the only difference is who updates which fp32 values and
    # that the bf16 compute weights arrive by an all-gather instead of a cast on every rank.
    # A rank computing from stale or bf16-rounded masters would differ after step 2.
    world = zero1["dp_shard"] * zero1.get("tp", 1) * zero1.get("pp", 1)
    wiring = run_on(world, _zero1_source, _bf16(tmp_path / "w", zero1))[0]
    assert {k: wiring[k] for k in ("sharded", "dtype", "source")} == {
        "sharded": True, "dtype": torch.bfloat16, "source": True}
    assert 0.9 < wiring["held"] <= 1.0 and 0.99 < wiring["synced"] <= 1.0, wiring
    a = run_on(world, train_collect, _bf16(tmp_path / "z1", zero1))[0]
    b = run_on(world, train_collect, _bf16(tmp_path / "z0", zero0))[0]
    assert a["losses"] == b["losses"]
    for name, value in b["params"].items():
        assert value.dtype == torch.float32 and torch.equal(a["params"][name], value), name


def _loaded(cfg_dict: dict) -> dict:
    """One process: resume from the run directory; the step and the fp32 parameters."""
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg_dict))
    start = tr.checkpointer.resume()
    tr.checkpointer.close()
    tr.fault.close()
    return {"start": start, "params": tr.full_state()}


@pytest.mark.parametrize("zero1", [{"dp_shard": 2, "zero": 1}, {"tp": 2, "dp_shard": 2, "zero": 1}],
                         ids=["ddp", "tp2"])
def test_bf16_zero1_checkpoint_holds_current_masters_and_resumes_bitwise(tmp_path, zero1):
    world = 2 * zero1.get("tp", 1)
    straight = run_on(world, train_segment, _bf16(tmp_path / "straight", zero1), STEPS, save=False)[0]
    run_dir = tmp_path / "split"
    first = run_on(world, train_segment, _bf16(run_dir, zero1), SPLIT)[0]
    # The checkpoint holds every rank's current fp32 values (not a stale non-owner copy):
    # loaded into one process (another dp size) they are the run's parameters, bit for bit.
    copy = tmp_path / "one"
    shutil.copytree(run_dir, copy)
    one = _loaded(_bf16(copy, {"dp_shard": 1, "zero": 0}))
    assert one["start"] == SPLIT
    for name, value in first["params"].items():
        assert torch.equal(one["params"][name], value), name
    if "tp" not in zero1:  # resumed on 4 ranks (other segments): the run goes on (bf16: another split
        # rounds differently, so within 1 % of the straight run, not bit for bit)
        four_dir = tmp_path / "four"
        shutil.copytree(run_dir, four_dir)
        four = run_on(4, train_segment, _bf16(four_dir, {"dp_shard": 4, "zero": 1}), STEPS, save=False)[0]
        assert four["start"] == SPLIT
        torch.testing.assert_close(torch.tensor(four["losses"]), torch.tensor(straight["losses"][SPLIT:]),
                                   rtol=1e-2, atol=0)
    # Resumed in the same layout, the compute weights are recast from the loaded masters.
    second = run_on(world, train_segment, _bf16(run_dir, zero1), STEPS, save=False)[0]
    assert second["start"] == SPLIT
    assert first["losses"] + second["losses"] == straight["losses"]
    for name, value in straight["params"].items():
        assert torch.equal(second["params"][name], value), name
