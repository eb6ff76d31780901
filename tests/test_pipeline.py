"""Pipeline parallel against a one-process reference, float64: losses over 5 steps, every
parameter and every last-step gradient (rtol 1e-9, atol 1e-11), plus the schedules'
structure, the cost-balanced split, config errors and the timeline command."""

import json

import pytest

from meshfold.config import ConfigError, from_dict, validate
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

L4 = {"n_layers": 4}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("ref")), model=L4))


def _pp(world, parallel, tmp_path, train=None, model=L4):
    cfg = tiny_config(str(tmp_path), model=model, parallel={"dp_shard": -1, **parallel}, train=train or {})
    return run_on(world, train_collect, cfg)[0]


# Each schedule at pp 2 with micro-batches equal to and larger than pp (8 sequences).
SCHEDULES = [
    pytest.param("gpipe", 1, 2, id="gpipe-m2"),
    pytest.param("gpipe", 1, 4, id="gpipe-m4"),
    pytest.param("1f1b", 1, 1, id="1f1b-m1"),
    pytest.param("1f1b", 1, 2, id="1f1b-m2"),
    pytest.param("1f1b", 1, 8, id="1f1b-m8"),
    pytest.param("interleaved", 2, 2, id="interleaved-v2-m2"),
    pytest.param("interleaved", 2, 4, id="interleaved-v2-m4"),
    pytest.param("zbv", 1, 2, id="zbv-m2"),
    pytest.param("zbv", 1, 4, id="zbv-m4"),
]


@pytest.mark.parametrize("schedule,virtual,micro", SCHEDULES)
def test_pp2_schedules_match_one_process(schedule, virtual, micro, reference, tmp_path):
    got = _pp(2, {"pp": 2, "pp_schedule": schedule, "pp_virtual_stages": virtual, "pp_microbatches": micro},
              tmp_path)
    assert_runs_match(reference, got)


def test_pp4_1f1b_and_uneven_split(reference, tmp_path):
    got = _pp(4, {"pp": 4, "pp_schedule": "1f1b", "pp_microbatches": 8}, tmp_path)
    assert_runs_match(reference, got)
    # An explicit, uneven split gives the same numbers.
    got = _pp(2, {"pp": 2, "pp_schedule": "1f1b", "pp_split": [3, 1], "pp_microbatches": 4}, tmp_path)
    assert_runs_match(reference, got)


@pytest.fixture(scope="module")
def reference8(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("ref8")), model={"n_layers": 8}))


@pytest.mark.parametrize("schedule,virtual", [("interleaved", 2), ("zbv", 1), ("gpipe", 1)])
def test_pp4_schedules_match_one_process(schedule, virtual, reference8, tmp_path):
    got = _pp(4, {"pp": 4, "pp_schedule": schedule, "pp_virtual_stages": virtual, "pp_microbatches": 4},
              tmp_path, model={"n_layers": 8})
    assert_runs_match(reference8, got)


@pytest.mark.parametrize("parallel", [
    pytest.param({"zero": 3}, id="1f1b-zero3"),
    pytest.param({"zero": 2, "pp_schedule": "interleaved", "pp_virtual_stages": 2}, id="interleaved-zero2"),
    pytest.param({"zero": 3, "pp_schedule": "zbv"}, id="zbv-zero3"),  # whole backward in B under FSDP
    pytest.param({"zero": 2, "pp_schedule": "zbv"}, id="zbv-zero2"),
    pytest.param({"zero": 1}, id="1f1b-zero1"),  # gradients averaged by the pipeline, sharded Adam
])
def test_pp2_times_dp_shard2(parallel, reference, tmp_path):
    got = _pp(4, {"pp": 2, "dp_shard": 2, "pp_microbatches": 2, **parallel}, tmp_path)
    assert_runs_match(reference, got)


def test_pp2_times_ddp2_zbv(reference, tmp_path):
    # Data-parallel gradients averaged by the pipeline itself, with the split B/W backward.
    got = _pp(4, {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "pp_schedule": "zbv"}, tmp_path)
    assert_runs_match(reference, got)


def test_pp2_times_tp2(reference, tmp_path):
    got = _pp(4, {"pp": 2, "tp": 2, "pp_microbatches": 4}, tmp_path)
    assert_runs_match(reference, got)


def test_pp2_times_tp2_sequence_parallel_zbv(reference, tmp_path):
    # Stages hand over 1/tp slices of the sequence; the split backward runs through DTensor params.
    got = _pp(4, {"pp": 2, "tp": 2, "sp": True, "pp_schedule": "zbv"}, tmp_path)
    assert_runs_match(reference, got)


def test_pp2_times_dp2_times_tp2(reference, tmp_path):
    got = _pp(8, {"pp": 2, "dp_shard": 2, "tp": 2, "zero": 3, "pp_microbatches": 2}, tmp_path)
    assert_runs_match(reference, got)


def test_pp2_moe_with_aux_loss(tmp_path):
    # Each stage's MoE balance loss joins its own backward (1f1b, and zbv's split backward).
    moe = {"n_layers": 4, "moe_experts": 4, "moe_topk": 2, "moe_aux_loss_coef": 0.1}
    # The balance loss is per micro-batch (nonlinear in its tokens): the reference uses the same 2.
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=moe, train={"micro_batch": 4}))
    for schedule in ("1f1b", "zbv"):
        got = _pp(2, {"pp": 2, "pp_schedule": schedule, "pp_microbatches": 2}, tmp_path / schedule, model=moe)
        assert_runs_match(ref, got)


def _train_metrics(cfg: dict) -> list[dict]:
    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    Trainer(from_dict(cfg)).fit()
    path = f"{cfg['train']['run_dir']}/metrics.jsonl"
    return [json.loads(line) for line in open(path).read().splitlines()]


def test_pp2_validation_loss_matches_one_process(tmp_path):
    # Evaluation runs a forward-only pass through the stages (loss on the last one).
    extra = dict(model=L4, train={"steps": 2, "eval_every": 2, "eval_batches": 2},
                 data={"max_docs": 40, "val_docs": 8})
    ref = _train_metrics(tiny_config(str(tmp_path / "ref"), **extra))
    got = run_on(2, _train_metrics, tiny_config(str(tmp_path / "pp"), parallel={"pp": 2, "dp_shard": 1}, **extra))
    assert ref[-1]["val_loss"] == pytest.approx(got[0][-1]["val_loss"], rel=1e-9, abs=1e-11)


# --------------------------------------------------------------------------- no processes


def test_schedules_are_complete_and_deadlock_free():
    from meshfold.schedules import get_schedule
    from meshfold.schedules.simulate import bubble_fractions, simulate

    for schedule in ("gpipe", "1f1b", "interleaved", "zbv"):
        for pp in (2, 3, 4):
            for m in (1, 2, 3, 4, 6, 8):
                v = 2 if schedule == "interleaved" else 1
                sched = get_schedule(schedule)
                if sched.microbatch_problem(pp, m):
                    continue
                orders = sched.actions(pp, v, m)
                events = simulate(sched, orders)  # raises on deadlock
                chunks = sched.chunks_per_rank(v)
                for rank, order in enumerate(orders):
                    assert len(set(order)) == len(order)
                    for kind in "FB":
                        got = sorted((a.chunk, a.mb) for a in order if a.kind == kind)
                        assert got == [(c, i) for c in range(chunks) for i in range(m)], (schedule, pp, m, rank)
                frac = bubble_fractions(events)
                mean = sum(frac.values()) / len(frac)
                if schedule != "zbv":  # the simulation reproduces the closed form
                    assert mean == pytest.approx(sched.theoretical_bubble(pp, v, m)), (schedule, pp, m)
                elif m >= pp:  # the V shape and split backward beat 1F1B's bubble
                    assert mean < get_schedule("1f1b").theoretical_bubble(pp, 1, m), (pp, m)


def test_balanced_split_weighs_output_layer():
    from meshfold.models.presets import preset
    from meshfold.models.stage_balance import balanced_split, stage_costs

    cfg = preset("llama3-8b")
    split = balanced_split(cfg, 4)
    assert sum(split) == 32 and split[-1] < 8 < max(split)  # the vocab-heavy last stage holds fewer blocks
    assert max(stage_costs(cfg, split)) < max(stage_costs(cfg, [8, 8, 8, 8]))
    # Exhaustive check on a small case: no contiguous split has a smaller maximum.
    from itertools import combinations

    small = preset("llama3-8b", n_layers=7)
    best = min(max(stage_costs(small, [b - a for a, b in zip((0,) + cuts, cuts + (7,))]))
               for cuts in combinations(range(1, 7), 2))
    assert max(stage_costs(small, balanced_split(small, 3))) == pytest.approx(best)


def _cfg(**parallel):
    return from_dict(tiny_config("/tmp/unused", model=L4, parallel={"dp_shard": 1, **parallel}))


@pytest.mark.parametrize("parallel,world,needle", [
    ({"pp": 4, "pp_schedule": "zbv", "pp_microbatches": 2}, 4, "pp_schedule = zbv needs 8 stages"),
    ({"pp": 4, "pp_schedule": "interleaved", "pp_virtual_stages": 1}, 4, "pp_virtual_stages >= 2"),
    ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual_stages": 2, "pp_microbatches": 1}, 2,
     "needs a multiple of parallel.pp = 2"),
    ({"pp": 2, "pp_split": [4, 0]}, 2, "parallel.pp_split"),
    ({"pp": 2, "pp_microbatches": 3}, 2, "does not divide"),
])
def test_bad_pipeline_config_is_one_line(parallel, world, needle):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(**parallel), world)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_microbatches_fail_before_processes_start(tmp_path, capsys):
    # Through the CLI with --nproc: one line, exit code 2, no process group, no hang.
    from meshfold.cli import main

    code = main(["train", "configs/debug.toml", "--nproc", "2", "--set", "parallel.pp=2",
                 "--set", "parallel.pp_schedule='interleaved'", "--set", "parallel.pp_virtual_stages=2",
                 "--set", "model.n_layers=4", "--set", "parallel.pp_microbatches=1",
                 "--set", f"train.run_dir='{tmp_path}'"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "parallel.pp_microbatches" in err


def test_timeline_written_and_drawn(tmp_path):
    from meshfold.cli import main

    run = tmp_path / "run"
    got = _pp(2, {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4}, run)
    assert got["losses"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["bubble_frac"] < 1.0 and len(r["bubble_frac_stages"]) == 2 for r in metrics)
    assert metrics[0]["bubble_theory"] == pytest.approx(1 / 5)
    records = [json.loads(line) for line in (run / "pipeline_timeline.jsonl").read_text().splitlines()]
    assert len(records) == 5
    events = records[-1]["events"]
    assert sorted({e["stage"] for e in events}) == [0, 1]
    assert sum(e["kind"] == "F" for e in events) == 8 and sum(e["kind"] == "B" for e in events) == 8
    assert main(["timeline", str(run), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert main(["timeline", "--schedule", "zbv", "--pp", "4", "--microbatches", "8",
                 "--out", str(tmp_path / "z.png")]) == 0
    assert (tmp_path / "z.png").stat().st_size > 1000


def test_zbv_runs_the_order_the_planner_prices(tmp_path):
    # The executor's measured timeline (zbv, pp 2, 4 micro-batches) runs, on every rank,
    # the order the planner simulates; replaying that measured order with the planner's
    # action costs gives the planner's pipeline time.
    from meshfold.planner.simulate import schedule_events
    from meshfold.schedules import Action, get_schedule
    from meshfold.schedules.simulate import makespan, simulate

    run = tmp_path / "run"
    got = _pp(2, {"pp": 2, "pp_schedule": "zbv", "pp_microbatches": 4}, run)
    assert got["losses"]
    events = [json.loads(line) for line in (run / "pipeline_timeline.jsonl").read_text().splitlines()][-1]["events"]

    def orders(evs):
        return [[Action(e["kind"], e["chunk"], e["mb"]) for e in sorted((e for e in evs if e["stage"] == r),
                                                                        key=lambda e: e["start"])] for r in (0, 1)]

    ran = orders(events)
    assert {a.kind for o in ran for a in o} == {"F", "B", "W"}
    assert ran == orders(schedule_events("zbv", 2, 4, 1, 1.0, 2.0))
    for t_f, t_b in ((1.0, 2.0), (1.0, 3.5)):
        zbv = get_schedule("zbv")
        replay = makespan(simulate(zbv, ran, zbv.chunk_costs(1, t_f, t_b)))
        assert replay == pytest.approx(zbv.pipeline_time(2, 4, 1, t_f, t_b)[0], rel=1e-12)
