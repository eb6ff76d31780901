"""SkipPipe (``parallel.pp_schedule = "skippipe"``, docs/pipeline.md): without skips it is
1F1B bit for bit; with skips and reordering (pp 4, two slow links) it equals a one-process
float64 reference that runs each micro-batch through the same stages in the same order and
so accumulates no gradient on a stage the micro-batch skipped (losses, parameters and
last-step gradients at rtol 1e-9, atol 1e-11), under strict mode. The path plan itself:
caps, the makespan it buys, NCCL-safe exchange, the planner's price."""

import torch

from meshfold.parallel.pp.p2p_plan import exchange_plan
from meshfold.schedules import get_schedule
from meshfold.schedules.simulate import makespan, simulate
from meshfold.schedules.skippipe import paths as skippipe
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect, train_segment

MODEL = {"n_layers": 4}
TRAIN = {"steps": 2, "micro_batch": 2}  # 8 sequences: 4 micro-batches
SLOW = [[0, 1, 1.0], [2, 3, 1.0]]  # Mbit/s; the other links are free (pp_link_mbit = 0)
SKIP = {"pp": 4, "pp_schedule": "skippipe", "pp_microbatches": 4, "pp_skip": 0.5, "pp_reorder": True,
        "pp_links": SLOW}


def _resume(cfg: dict) -> list:
    """Train to step 1, checkpoint, resume from there to step 2."""
    return [train_segment(cfg, 1), train_segment(cfg, 2, save=False)]


def _paths(cfg_dict: dict):
    from meshfold.config import from_dict
    from meshfold.parallel.pp.run_orders import run_facts
    from meshfold.parallel.pp.stage_modules import stage_split

    cfg = from_dict(cfg_dict)
    split = stage_split(cfg)[0]
    sched = get_schedule("skippipe")
    return split, sched.run_paths_orders(cfg.parallel.pp_microbatches, run_facts(cfg, sched, split, 2, 8))[0]


def _skipping_reference(cfg_dict: dict, split: list[int], paths) -> dict:
    """One process: micro-batch i runs the embedding, then the blocks of the stages on
    ``paths[i]`` in path order, then the norm, output and loss."""
    from meshfold.config import from_dict
    from meshfold.parallel.dp.plan import unwrap
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    trainer.capture_grads = True
    engine, model = trainer.engine, unwrap(trainer.engine.model)
    first = [sum(split[:s]) for s in range(len(split))]
    calls = [0]

    def forward_loss(mb):
        path = paths[calls[0] % len(paths)]
        calls[0] += 1
        h = model.tok_embeddings(mb["inputs"])
        rope = model._rope(mb.get("positions"), h.shape[1], h.device)
        doc_ids = mb["doc_ids"] if engine.use_doc_mask else None
        for s in path:
            for layer in range(first[s], first[s] + split[s]):
                h = model.layers[str(layer)](h, rope, mb.get("positions"), doc_ids)
        return engine.loss_fn(model.project(model.norm(h)), mb["labels"])

    engine.forward_loss = forward_loss
    losses = trainer.fit()
    return {"losses": losses, "params": trainer.full_state(), "grads": trainer.last_grads}


def test_skippipe_is_1f1b_without_skips_and_the_skipping_reference_with_them(tmp_path):
    def cfg(name, parallel):
        return tiny_config(str(tmp_path / name), model=MODEL, train=TRAIN,
                           parallel={"dp_shard": -1, "pp_microbatches": 4, **parallel})

    # one pooled call per run, as in the other pipeline tests (each well inside the pool's timeout)
    one_f_one_b, no_skip, skipping = (run_on(4, train_collect, c)[0] for c in [
        cfg("1f1b", {"pp": 4, "pp_schedule": "1f1b"}),
        cfg("noskip", {"pp": 4, "pp_schedule": "skippipe", "pp_links": SLOW}),
        cfg("skip", SKIP)])
    first, second = run_on(4, _resume, cfg("resume", SKIP))[0]
    assert one_f_one_b["losses"] == no_skip["losses"]
    for kind in ("params", "grads"):
        for name, value in one_f_one_b[kind].items():
            assert torch.equal(value, no_skip[kind][name]), f"{kind} of {name}"
    split, paths = _paths(cfg("plan", SKIP))
    full = (0, 1, 2, 3)
    # the plan really skips and reorders, and every stage still trains on some micro-batch
    assert any(len(p) < 4 for p in paths) and any(list(p) != sorted(p) for p in paths), paths
    assert all(sum(s in p for p in paths) >= 2 for s in full), paths  # cap: 2 of 4 may skip
    ref = _skipping_reference(cfg("ref", {"pp": 1}), split, paths)
    assert_runs_match(ref, skipping)
    assert abs(skipping["losses"][0] - no_skip["losses"][0]) > 1e-6  # skipping changes the function
    # checkpoint at step 1, resume: the same paths are planned again, the same run results
    assert second["start"] == 1 and first["losses"] + second["losses"] == skipping["losses"]
    for name, value in skipping["params"].items():
        assert torch.equal(second["params"][name], value), name


def _tables(pp=4):
    stage = tuple((1.0, 2.0) for _ in range(pp))
    return stage, skippipe.link_table(pp, 0.05, {(0, 1): 3.0, (2, 3): 3.0})


def test_paths_keep_the_caps_and_beat_1f1b_on_slow_links():
    pp, m = 4, 8
    stage, links = _tables()
    full = skippipe.table_step_time(pp, (tuple(range(pp)),) * m, stage, links)
    assert skippipe.plan_orders(pp, m, 0.0, False, stage, links)[1] == get_schedule("1f1b").actions(pp, 1, m)
    times = {}
    for skip, reorder in ((0.25, False), (0.0, True), (0.25, True), (0.5, True)):
        paths, orders = skippipe.plan_orders(pp, m, skip, reorder, stage, links)
        per_mb, per_stage = skippipe.limits(pp, m, skip)
        assert all(p[0] == 0 and p[-1] == pp - 1 and len(set(p)) == len(p) for p in paths)
        assert all(pp - len(p) <= per_mb for p in paths)
        assert all(sum(s not in p for p in paths) <= per_stage for s in range(pp))
        assert reorder or all(list(p) == sorted(p) for p in paths)
        times[(skip, reorder)] = t = skippipe.table_step_time(pp, paths, stage, links)
        assert t < full
        # the executor's inputs: a deadlock-free order and an NCCL-safe exchange plan
        assert makespan(simulate(get_schedule("skippipe"), orders)) > 0
        assert len(exchange_plan(get_schedule("skippipe"), orders)) == pp
        held = [sum(1 for a in o if a.kind == "F") for o in orders]
        assert held == [sum(s in p for p in paths) for s in range(pp)]
    assert times[(0.25, True)] <= times[(0.0, True)]


def test_planner_prices_skippipe_below_1f1b_on_slow_links():
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.cost import CostModel, Layout, Workload
    from meshfold.models.config import ModelConfig

    w = Workload(ModelConfig(dim=64, n_layers=4, n_heads=4, vocab_size=512, seq_len=64), global_batch=8)
    cm = CostModel(w, load_cluster("cpu", nodes=1, devices=4))
    base = dict(pp=4, dp_shard=1, zero=0, micro_batch=1, pp_links=((0, 1, 1.0), (2, 3, 1.0)))
    fast = cm.estimate(Layout(pp_schedule="1f1b", **{**base, "pp_links": ()})).step_time_s
    t_1f1b = cm.estimate(Layout(pp_schedule="1f1b", **base)).step_time_s
    t_plain = cm.estimate(Layout(pp_schedule="skippipe", **base)).step_time_s
    t_skip = cm.estimate(Layout(pp_schedule="skippipe", pp_skip=0.25, pp_reorder=True, **base)).step_time_s
    assert t_1f1b > fast  # the slow links are priced, link by link ...
    assert t_plain == t_1f1b  # ... skippipe without skips is 1F1B ...
    assert t_skip < t_plain  # ... and its paths around the slow links win time back
