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
    pytest.param({"pp": 2, "tp": 2, "expert_tp": 2, "pp_microbatches": 1, "pp_schedule": "gpipe"}, id="pp2xetp2"),
])
def test_expert_tp_matches_one_process(parallel, ref, tmp_path):
    got = run_on(4, train_collect, tiny_config(str(tmp_path), model=MOE, parallel=parallel))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)



def test_expert_tp_with_fewer_local_experts_than_edp_ranks(tmp_path):
    # 2 experts at ep 2 over dp_shard 4: one local expert (half wide) for edp = 2 FSDP ranks.
    # FSDP2 shards another dimension than the one tp splits (w13 on dim, w2 on its rows), never
    # the strided w13 rows twice (parallel/ep/plan.py ``_expert_placement``).
    two = {**MOE, "moe_experts": 2}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=two))
    got = run_on(8, train_collect, tiny_config(str(tmp_path / "etp"), model=two,
                                               parallel={"dp_shard": 4, "tp": 2, "ep": 2, "expert_tp": 2}))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


CAPACITY = {**MOE, "moe_capacity_factor": 1.0, "moe_shared_experts": 1}


def test_expert_tp_capacity_matches_one_process(tmp_path):
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=CAPACITY))
    got = run_on(4, train_collect, tiny_config(str(tmp_path / "etp"), model=CAPACITY,
                                               parallel={"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2}))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("parallel", [
    pytest.param({"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2}, id="ep2xetp2-fsdp"),
    pytest.param({"dp_shard": 2, "tp": 2, "ep": 2, "expert_tp": 2, "zero": 1}, id="ep2xetp2-zero1"),
    # ZeRO-1 over dp_shard 2 cuts the split w13's Adam state mid-piece (zero_state.strided_boxes)
    pytest.param({"dp_shard": 2, "tp": 2, "expert_tp": 2, "zero": 1}, id="ep1-etp2-zero1"),
])
def test_checkpoint_from_expert_tp_resumes_in_one_process(parallel, tmp_path):
    # The experts' strided w13 (and its Adam moments) go through DCP (FSDP: replicated over tp;
    # ZeRO-1: in boxes per piece) and reload unsharded: 3 steps at etp 2 + 2 resumed one-process
    # steps = 5 one-process steps.
    train = {"min_lr_ratio": 1.0}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=MOE, train=train))
    run_dir = str(tmp_path / "etp")
    first = run_on(4, train_collect, tiny_config(run_dir, model=MOE, parallel=parallel,
                                                 train={**train, "steps": 3, "checkpoint_every": 3}))[0]
    got = train_collect(tiny_config(run_dir, model=MOE, train={**train, "steps": 5}))
    assert len(first["losses"]) == 3 and len(got["losses"]) == 2
    got["losses"] = first["losses"] + got["losses"]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


def test_checkpoint_of_whole_experts_resumes_with_experts_split_over_tp(tmp_path):
    # The other way: 3 steps at ep 2 x tp 2 with whole experts, resumed for 2 at ep 2 x etp 2
    # (FSDP): the w13 read from the whole experts' checkpoint into each rank's two pieces.
    train = {"min_lr_ratio": 1.0}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=MOE, train=train))
    run_dir, whole = str(tmp_path / "run"), {"dp_shard": 2, "tp": 2, "ep": 2}
    first = run_on(4, train_collect, tiny_config(run_dir, model=MOE, parallel=whole,
                                                 train={**train, "steps": 3, "checkpoint_every": 3}))[0]
    got = run_on(4, train_collect, tiny_config(run_dir, model=MOE, parallel={**whole, "expert_tp": 2},
                                               train={**train, "steps": 5}))[0]
    assert len(first["losses"]) == 3 and len(got["losses"]) == 2
    got["losses"] = first["losses"] + got["losses"]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("parallel,model,fix", [
    ({"tp": 2, "ep": 4, "dp_shard": 4}, {}, "parallel.expert_tp = tp"),  # 4 experts over ep x tp = 8
    ({"tp": 2, "expert_tp": 4, "dp_shard": 2}, {}, "parallel.expert_tp = 4 must be 1"),
    ({"tp": 2, "expert_tp": 2, "dp_shard": 2}, {"moe_ffn_dim": 33}, "must divide the experts' width 33"),
    ({"tp": 2, "expert_tp": 2, "dp_shard": 2}, {"moe_bias": True}, "biased experts"),
])
def test_bad_expert_tp_layouts_fail_in_one_line(parallel, model, fix, tmp_path):
    cfg = from_dict(tiny_config(str(tmp_path), model={**MOE, **model}, parallel=parallel))
    with pytest.raises(ConfigError, match=fix.replace("(", r"\(").replace(")", r"\)")) as err:
        validate(cfg, world_size=parallel.get("dp_shard", 1) * parallel.get("tp", 1))
    assert "\n" not in str(err.value)


def _planner_case(experts: int, devices: int, seq: int):
    from meshfold.config import ModelConfig
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.cost import Workload

    m = ModelConfig(dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000, seq_len=seq,
                    moe_experts=experts, moe_topk=2)
    return Workload(m, 1), load_cluster("h100", devices=devices)


def test_search_picks_between_the_two_foldings():
    # One long sequence a step: the ep ranks fold over cp. With 4 experts on 8 H100s the best
    # layout is tp 2 x cp 4 with ep 4, which only experts split over tp allow (ep x tp = 8 > 4
    # whole experts): no expert FSDP peers, all-to-all inside the node. With 16 experts on 16
    # H100s whole experts over ep 4 x tp 4 win, their experts split the other way priced slower
    # (every tp rank sends all its tokens' rows, 4 times the all-to-all bytes).
    import dataclasses

    from meshfold.planner.cost import CostModel
    from meshfold.planner.search import search

    w, cluster = _planner_case(4, 8, 8192)
    best = search(w, cluster, top=1).ranked[0].layout
    assert (best.tp, best.ep, best.expert_tp) == (2, 4, 2), best.short()
    assert best.ep * best.tp > w.model.moe_experts

    w, cluster = _planner_case(16, 16, 32768)
    best = search(w, cluster, top=1).ranked[0].layout
    assert best.tp > 1 and best.expert_tp == 1 and w.model.moe_experts % (best.ep * best.tp) == 0, best.short()
    cm = CostModel(w, cluster)
    whole, split = cm.estimate(best), cm.estimate(dataclasses.replace(best, expert_tp=best.tp))
    assert whole.step_time_s < split.step_time_s
    assert split.collectives["ep"]["bytes"] > whole.collectives["ep"]["bytes"]
    assert split.collectives["ep"]["count"] == whole.collectives["ep"]["count"]


# Runtime vs planner for expert tp layouts (meshfold dry-run): tests/test_dryrun_moe.py's AGREEMENT.
