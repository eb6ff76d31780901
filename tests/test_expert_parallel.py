"""Expert parallel (folded onto dp_shard x cp, composed with tp and FSDP) against a
one-process reference, float64: losses over 5 steps, every gradient and parameter."""

import json
from pathlib import Path

import pytest

from meshfold.config import ConfigError, from_dict, validate
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

# z-loss and a large balance coefficient so the auxiliary gradients matter in the comparison.
MOE = {"moe_experts": 4, "moe_topk": 2, "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 1e-3}
CAPACITY = {**MOE, "moe_capacity_factor": 1.0, "moe_shared_experts": 1, "moe_bias_balance": True,
            "moe_bias_update_rate": 1e-2}


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dropless_ref(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    out = train_collect(tiny_config(str(run_dir), model=MOE))
    return out, _metrics(run_dir)


@pytest.fixture(scope="module")
def capacity_ref(tmp_path_factory):
    # train_collect's result, plus the rows the experts computed and the shared experts' class
    # (forward hooks that only count)
    run_dir = tmp_path_factory.mktemp("refcap")
    out = _collect_counting_expert_rows(tiny_config(str(run_dir), model=CAPACITY))
    return out, _metrics(run_dir)


LAYOUTS = [
    pytest.param(2, {"dp_shard": 2, "ep": 2}, id="ep2"),
    pytest.param(4, {"dp_shard": 4, "ep": 4}, id="ep4"),
    pytest.param(4, {"dp_shard": 4, "ep": 2, "zero": 2}, id="ep2-folded-on-dp_shard4-zero2"),
    pytest.param(4, {"dp_shard": 2, "tp": 2, "ep": 2}, id="ep2xtp2"),
    # ep 1: the experts are split over the tp ranks (each computes half of them), with FSDP2,
    # with ZeRO-1 (gradient reducer) and without data parallel (every parameter a tp DTensor).
    pytest.param(4, {"dp_shard": 2, "tp": 2}, id="tp2-experts-split"),
    pytest.param(4, {"dp_shard": 2, "tp": 2, "zero": 1}, id="tp2-zero1-experts-split"),
    pytest.param(2, {"tp": 2}, id="tp2-dp1-experts-split"),
    pytest.param(4, {"dp_shard": 2, "cp": 2, "ep": 4}, id="ep4-folded-on-dp_shard2xcp2"),
    # HSDP for the dense part; the experts' FSDP group (edp) spans the replicas.
    pytest.param(4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, id="ep2-hsdp2x2"),
    pytest.param(2, {"dp_shard": 2}, id="dp2-ep1-global-balance-loss"),
    # DDP-style data parallel (DeepSeek-V3's ep over ZeRO-1): dense gradients averaged over the 4
    # data ranks, the experts' over their edp = 2 replicas; ZeRO-1 shards the Adam state over each.
    pytest.param(4, {"dp_replicate": 4, "ep": 2, "zero": 0}, id="ep2-ddp4-zero0"),
    pytest.param(4, {"dp_shard": 4, "ep": 2, "zero": 1}, id="ep2-dp4-zero1"),
    # Recomputation re-runs the all-to-all in backward and must not count the tokens twice.
    pytest.param(2, {"dp_shard": 2, "ep": 2}, {"recompute": "full"}, id="ep2-recompute-full"),
]


@pytest.mark.parametrize("world,parallel,train", [p if len(p.values) == 3 else pytest.param(*p.values, {}, id=p.id)
                                                  for p in LAYOUTS])
def test_dropless_matches_one_process(world, parallel, train, dropless_ref, tmp_path):
    ref, ref_metrics = dropless_ref
    got = run_on(world, train_collect, tiny_config(str(tmp_path), model=MOE, parallel=parallel, train=train))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
    metrics = _metrics(tmp_path)
    for mine, theirs in zip(metrics, ref_metrics, strict=True):
        assert mine["expert_load"] == theirs["expert_load"]  # global tokens per expert, every step
        assert mine["expert_imbalance"] == pytest.approx(theirs["expert_imbalance"], rel=1e-12)
        if parallel.get("ep", 1) > 1:
            assert mine["comm_bytes"]["ep"] > 0  # all-to-all traffic recorded under "ep"


def test_capacity_drops_the_same_tokens(capacity_ref, tmp_path):
    # Per-sequence capacity: the dropped (token, expert) pairs do not depend on the layout.
    ref, ref_metrics = capacity_ref
    got = run_on(4, train_collect, tiny_config(str(tmp_path), model=CAPACITY, parallel={"dp_shard": 4, "ep": 2}))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
    metrics = _metrics(tmp_path)
    assert all(m["dropped_tokens"] > 0 for m in ref_metrics)  # the test really drops tokens
    assert [m["dropped_tokens"] for m in metrics] == [m["dropped_tokens"] for m in ref_metrics]
    assert [m["expert_load"] for m in metrics] == [m["expert_load"] for m in ref_metrics]


def _collect_counting_expert_rows(cfg_dict: dict) -> dict:
    """train_collect's run (losses, unsharded parameters and last gradients, on global rank 0),
    counting the rows every MoE layer's experts compute on this rank ("rows", every rank); also
    the class of the shared experts ("shared": tensor-parallel split or not)."""
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.models.moe import moe_layers
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    trainer.capture_grads = True
    rows = [0]
    layers = moe_layers(trainer.model)
    for _, moe in layers:
        moe.experts.register_forward_hook(lambda mod, args, out: rows.__setitem__(0, rows[0] + args[0].shape[0]))
    losses = trainer.fit()
    params, grads = trainer.full_state(), trainer.last_grads
    out = {"rows": rows[0], "shared": type(layers[0][1].shared_experts).__name__}
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.update(losses=losses, params=params, grads=grads)
    return out


@pytest.mark.parametrize("world,parallel", [
    (2, {"tp": 2}),
    (4, {"dp_shard": 2, "tp": 2}),
    (4, {"dp_shard": 2, "tp": 2, "ep": 2}),
    # sequence parallel: each tp rank routes its slice, the capacity slots are the whole sequences'
    (2, {"tp": 2, "sp": True}),
    (4, {"dp_shard": 2, "tp": 2, "sp": True, "ep": 2}),
])
def test_tensor_parallel_computes_no_expert_row_twice(world, parallel, capacity_ref, tmp_path):
    # Shared experts, capacity and bias balancing with tp: the same run as one process (the same
    # tokens dropped), the rows computed by the routed experts over all ranks add up to the
    # one-process count (tp ranks split the experts, they do not repeat them), and the shared
    # experts are tp-split.
    # One run per side checks both (the counting hooks change nothing the comparison sees).
    cfg = tiny_config(str(tmp_path), model=CAPACITY, parallel=parallel)
    per_rank = run_on(world, _collect_counting_expert_rows, cfg)
    ref = capacity_ref[0]
    assert_runs_match(ref, per_rank[0], rtol=1e-9, atol=1e-11)
    assert [m["dropped_tokens"] for m in _metrics(tmp_path)] == [m["dropped_tokens"] for m in capacity_ref[1]]
    assert sum(r["rows"] for r in per_rank) == ref["rows"]
    assert ref["shared"] == "FeedForward" and {r["shared"] for r in per_rank} == {"TensorParallelFeedForward"}


@pytest.mark.parametrize("parallel,key", [
    ({"dp_shard": 4, "ep": 3}, "parallel.ep"),
    ({"dp_shard": 2, "dp_replicate": 2, "ep": 4}, "parallel.ep"),
    ({"dp_replicate": 4, "ep": 2, "zero": 0, "offload": "optimizer"}, "train.offload"),
    ({"dp_shard": 2, "cp": 2, "ep": 2}, "model.moe_capacity_factor"),
    ({"dp_shard": 2, "tp": 2, "ep": 2, "moe_experts": 6}, "model.moe_experts"),
    ({"dp_shard": 4, "ep_overlap_chunks": 2}, "parallel.ep_overlap_chunks"),  # nothing to overlap without ep
])
def test_bad_layouts_fail_before_any_process_group(parallel, key, tmp_path):
    parallel = dict(parallel)
    experts = {"moe_experts": parallel.pop("moe_experts")} if "moe_experts" in parallel else {}
    train = {"offload": parallel.pop("offload")} if "offload" in parallel else {}
    cfg = from_dict(tiny_config(str(tmp_path), model={**MOE, "moe_capacity_factor": 1.0 if "cp" in parallel else 0.0,
                                                      **experts}, parallel=parallel, train=train))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, 4)


BIAS = {**MOE, "moe_bias_balance": True, "moe_bias_update_rate": 1e-2}


@pytest.mark.parametrize("zero", [3, 1], ids=["fsdp", "zero1"])
def test_pipeline_with_expert_parallel(zero, tmp_path):
    # zero 1: each stage's dense and expert reducers (dp x cp, edp) and the split ZeRO-1 optimizer
    model = BIAS
    # Each stage's MoE layers: balance terms join that stage's backward; bias updated per stage. One
    # micro-batch per rank, so the balance loss is the exact global-batch one (see docs/moe.md).
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=model))
    got = run_on(4, train_collect, tiny_config(str(tmp_path / "pp"), model=model,
                                               parallel={"pp": 2, "dp_shard": 2, "ep": 2, "pp_microbatches": 1,
                                                         "pp_schedule": "gpipe", "zero": zero}))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("experts", [4, 2], ids=["experts-dim0", "experts-dim1"])
def test_checkpoint_from_expert_parallel_resumes_in_one_process(experts, tmp_path):
    # Sharded experts (ep x FSDP), Adam state and the balancing bias go through the distributed
    # checkpoint and reload unsharded: 3 steps at ep 2 + 2 resumed steps = 5 one-process steps.
    # Constant LR after warm-up, so the shorter first run has the same schedule. With 2 experts
    # FSDP2 shards the experts' dim 1 (1 local expert over edp = 2 ranks).
    model = {**MOE, "moe_experts": experts, "moe_bias_balance": True, "moe_bias_update_rate": 1e-2}
    train = {"min_lr_ratio": 1.0}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=model, train=train))
    run_dir = str(tmp_path / "ep")
    first = run_on(4, train_collect, tiny_config(run_dir, model=model, parallel={"dp_shard": 4, "ep": 2},
                                                 train={**train, "steps": 3, "checkpoint_every": 3}))[0]
    got = train_collect(tiny_config(run_dir, model=model, train={**train, "steps": 5}))
    assert len(first["losses"]) == 3 and len(got["losses"]) == 2  # the resumed run reports steps 4 and 5
    got["losses"] = first["losses"] + got["losses"]  # steps 1-3 from the ep run itself: all 5 compared
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


# Fewer local experts than edp ranks: 2 experts at ep 2 over 4 data ranks leave E_l = 1 expert
# per ep rank for edp = 2 FSDP ranks. Dim 0 would pad to a whole expert per rank; FSDP2 shards
# dim 1 instead (parallel/facts/sizes.py). train.offload = params reaches the experts' group too.
TWO = {**MOE, "moe_experts": 2}


def _train_and_expert_layout(cfg_dict: dict) -> dict | None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from meshfold.models.moe import moe_layers
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    trainer.capture_grads = True
    losses = trainer.fit()
    params, grads = trainer.full_state(), trainer.last_grads
    layout = []
    for _, moe in moe_layers(trainer.model):
        assert isinstance(moe.experts, FSDPModule)
        for group in moe.experts._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                layout.append((fp.fsdp_placement.dim, tuple(fp.sharded_param.to_local().shape),
                               tuple(fp.sharded_param.placements), fp.offload_to_cpu,
                               fp.sharded_param.to_local().device.type))
    if dist.get_rank() != 0:
        return None
    return {"losses": losses, "params": params, "grads": grads, "layout": layout}


@pytest.mark.parametrize("train", [{}, {"offload": "params"}], ids=["fsdp", "offload-params"])
def test_fewer_local_experts_than_edp_ranks_shard_dim1(train, tmp_path):
    from torch.distributed.tensor import Shard

    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=TWO))
    got = run_on(4, _train_and_expert_layout, tiny_config(str(tmp_path / "ep"), model=TWO,
                                                          parallel={"dp_shard": 4, "ep": 2}, train=train))[0]
    layout = got.pop("layout")
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
    m = from_dict(tiny_config("/tmp/x", model=TWO)).model
    h, d = m.expert_dim, m.dim
    # w13 [1, 2h, d] and w2 [1, d, h] of each MoE layer halved on out; Shard(1) on edp, Shard(0) on ep
    assert layout and {x[:3] for x in layout} == {(1, (1, h, d), (Shard(1), Shard(0))),
                                                  (1, (1, d // 2, h), (Shard(1), Shard(0)))}
    assert {x[3] for x in layout} == {train.get("offload") == "params"}


def test_expert_shard_dim_picks_the_dimension_that_wastes_least():
    from meshfold.parallel.facts.sizes import expert_shard_dim, expert_shard_padding

    cases = [((8, 6, 6), 4, 0, 1.0),           # edp divides the experts: whole experts per rank
             ((4, 1408, 2048), 32, 1, 1.0),    # deepseek-moe-16b w1 at ep 8, tp 2, edp 32
             ((6, 1408, 2048), 4, 1, 1.0),     # more experts than ranks, but uneven
             ((1, 3, 4), 2, 2, 1.0),           # only `in` divides
             ((1, 3, 5), 2, 0, 2.0),           # nothing divides: dim 0 padded, a whole expert each
             ((3, 5, 5), 2, 0, 4 / 3),
             ((3, 5, 5), 1, 0, 1.0)]           # no FSDP peers
    for shape, edp, dim, padding in cases:
        assert expert_shard_dim(shape, edp) == dim, shape
        assert expert_shard_padding(shape, edp) == pytest.approx(padding), shape


@pytest.mark.parametrize("section,key,value", [
    ("lowcomm", "method", "diloco"),
    ("lowcomm", "compression", "onebit"),
    ("train", "live_recovery", True),
    ("train", "offload", "optimizer"),
])
def test_ep_with_ddp_or_zero1_refuses_what_replaces_its_reduction(section, key, value, tmp_path):
    # Features that replace the data-parallel reduction or the optimizer, or move the state to the
    # host, are not built for the dense/expert split: refused before any process group, naming the key.
    for zero, parallel in ((1, {"dp_shard": 4}), (0, {"dp_replicate": 4, "dp_shard": 1})):
        d = tiny_config(str(tmp_path), model=MOE, parallel={**parallel, "ep": 2, "zero": zero})
        d.setdefault(section, {})[key] = value
        with pytest.raises(ConfigError, match=rf"{section}\.{key}.*parallel\.zero = {zero}"):
            validate(from_dict(d), 4)


# parallel.ep_overlap_chunks: the exchange pipelined in chunks (async all-to-alls overlapping
# the experts, forward and backward) gives the one-process run, dropless (ep x tp with sp:
# gathered tokens, column dispatch) and under a capacity (slot ranges, equal splits).
OVERLAP = [
    pytest.param(4, {"dp_shard": 2, "tp": 2, "sp": True, "ep": 2, "ep_overlap_chunks": 3}, MOE,
                 id="dropless-ep2xtp2-sp-chunks3"),
    pytest.param(2, {"dp_shard": 2, "ep": 2, "ep_overlap_chunks": 2}, CAPACITY, id="capacity-ep2-chunks2"),
    # recomputation re-runs the pipelined forward (its async exchanges) inside backward
    pytest.param(2, {"dp_shard": 2, "ep": 2, "ep_overlap_chunks": 2}, MOE, {"recompute": "full"},
                 id="dropless-ep2-chunks2-recompute-full"),
]


def _train_counting_exchanges(cfg_dict: dict) -> tuple:
    """train_collect, counting the MoE dispatcher's forwards and the asynchronous all-to-alls."""
    from meshfold.parallel.ep import dispatch as expert

    calls = {"async": 0, "forward": 0}
    start, forward = expert._a2a_async, expert.AllToAllDispatcher.forward

    def counted_start(*args):
        calls["async"] += 1
        return start(*args)

    def counted_forward(self, *args):
        calls["forward"] += 1
        return forward(self, *args)

    expert._a2a_async, expert.AllToAllDispatcher.forward = counted_start, counted_forward
    try:
        return train_collect(cfg_dict), calls
    finally:
        expert._a2a_async, expert.AllToAllDispatcher.forward = start, forward


@pytest.mark.parametrize("world,parallel,model,train", [p if len(p.values) == 4 else pytest.param(*p.values, {}, id=p.id)
                                                        for p in OVERLAP])
def test_overlapped_exchange_matches_one_process(world, parallel, model, train, dropless_ref, capacity_ref, tmp_path):
    ref, ref_metrics = dropless_ref if model is MOE else capacity_ref
    got, calls = run_on(world, _train_counting_exchanges, tiny_config(str(tmp_path), model=model,
                                                                      parallel=parallel, train=train))[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
    assert [m["expert_load"] for m in _metrics(tmp_path)] == [m["expert_load"] for m in ref_metrics]
    # every chunk's dispatch and combine went out asynchronously, forward and backward: 4n per
    # forward; recomputed, half the forwards are the backward's re-runs (2n each, no backward)
    per = 3 if train.get("recompute") == "full" else 4
    assert calls["forward"] > 0 and calls["async"] == per * parallel["ep_overlap_chunks"] * calls["forward"]
