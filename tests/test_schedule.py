"""The one schedule model (the registered objects of ``meshfold/schedules``): the executor
and the planner use the same objects, generators and simulator, the planner's closed forms equal the simulation,
and the pure layers (schedule, ring table, planner) load without torch or the trainer.
No processes: the executor's measured order is checked in test_pipeline.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshfold.planner.simulate import schedule_events
from meshfold.schedules import Action, get_schedule
from meshfold.schedules.held import schedule_inflight
from meshfold.schedules.simulate import makespan, simulate

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zbv", 1)]


def _per_rank(events: list[dict]) -> list[list[Action]]:
    """Per rank (the events' stage row), the actions in the order they ran."""
    ranks = sorted({e["stage"] for e in events})
    return [[Action(e["kind"], e["chunk"], e["mb"]) for e in sorted((e for e in events if e["stage"] == r),
                                                                    key=lambda e: (e["start"], e["end"]))]
            for r in ranks]


def test_executor_and_planner_share_the_schedule_objects():
    import meshfold.parallel.pp.executor as executor
    import meshfold.planner.memory as memory
    import meshfold.planner.simulate as planner
    import meshfold.schedules as schedules
    import meshfold.schedules.held as held
    from meshfold.planner.workload import Layout

    # the executor and the planner look the same registered object up, and ask it
    assert executor.get_schedule is schedules.get_schedule and planner.get_schedule is schedules.get_schedule
    for name, v in CASES:
        obj = schedules.get_schedule(name)
        layout = Layout(pp=4, pp_schedule=name, pp_virtual_stages=v)
        assert layout.schedule is obj and layout.virtual == obj.virtual_of(v)
        assert memory._rank_held(obj, 4, layout.virtual, 8)[1][1] is obj.rank_held_counts(4, layout.virtual, 8, 1)
    assert memory.held_peak is held.held_peak
    assert not hasattr(planner, "stage_orders") and not hasattr(planner, "simulate_schedule")


def test_unknown_schedule_names_the_registered_ones():
    from meshfold.errors import ConfigError
    from meshfold.schedules import get_schedule, schedule_names

    assert schedule_names() == ("gpipe", "1f1b", "interleaved", "zbv", "skippipe")
    with pytest.raises(ConfigError, match="choose one of gpipe, 1f1b, interleaved, zbv, skippipe"):
        get_schedule("zigzag")


@pytest.mark.parametrize("schedule,v", CASES)
def test_planner_timeline_runs_the_executor_orders(schedule, v):
    # Costs that are not the unit ones the zbv order was built with: the planner still
    # replays the executor's order, in the executor's order on every rank.
    sched = get_schedule(schedule)
    for pp in (2, 3, 4):
        for m in (1, 2, 4, 8):
            if sched.microbatch_problem(pp, m):
                continue
            events = schedule_events(schedule, pp, m, v, 1.0, 2.7)
            assert _per_rank(events) == sched.actions(pp, v, m), (schedule, pp, m)


@pytest.mark.parametrize("schedule,v", CASES)
def test_pipeline_time_is_the_simulated_makespan(schedule, v):
    sched = get_schedule(schedule)
    for pp in (2, 4):
        for m in (pp, 2 * pp, 3 * pp):
            for t_f, t_b in ((1.0, 2.0), (1.0, 1.3), (0.7, 3.1)):
                orders = sched.actions(pp, v, m)
                span = makespan(simulate(sched, orders, sched.chunk_costs(v, t_f, t_b)))
                got, bubble = sched.pipeline_time(pp, m, v, t_f, t_b)
                assert got == pytest.approx(span, rel=1e-12), (schedule, pp, m, t_f, t_b)
                assert bubble == pytest.approx(span - m * (t_f + t_b), abs=1e-9)
                assert bubble >= -1e-9


def test_zbv_with_its_cost_ratio_beats_one_f_one_b():
    # B = W = F (t_b = 2 t_f, the unit costs its order is built for): the V's bubble is
    # below 1F1B's (p-1)(t_f+t_b) and below ZB-V's published (p-1) t_f bound.
    for pp in (2, 4, 8):
        m = 4 * pp
        _, zbv = get_schedule("zbv").pipeline_time(pp, m, 1, 1.0, 2.0)
        _, one = get_schedule("1f1b").pipeline_time(pp, m, 1, 1.0, 2.0)
        assert zbv < one and zbv <= (pp - 1) * 1.0 + 1e-12, (pp, zbv, one)


def test_inflight_counts_the_executor_order():
    for pp in (2, 4):
        for m in (1, 2, 4, 8, 16):
            # activations of a chunk-micro-batch live from its F to its W (stage 0: its B)
            orders = get_schedule("zbv").actions(pp, 1, m)
            held = []
            for order in orders:
                live, peak = set(), 0
                has_w = {(a.chunk, a.mb) for a in order if a.kind == "W"}
                for a in order:
                    if a.kind == "F":
                        live.add((a.chunk, a.mb))
                    elif a.kind == "W" or (a.kind == "B" and (a.chunk, a.mb) not in has_w):
                        live.discard((a.chunk, a.mb))
                    peak = max(peak, len(live))
                held.append(peak)
            assert get_schedule("zbv").inflight_microbatches(pp, m, 1) == max(held) / 2 == schedule_inflight(orders)
            # 1F1B's count is the same rule on its own order
            for name in ("1f1b", "gpipe"):
                sched = get_schedule(name)
                assert sched.inflight_microbatches(pp, m, 1) == schedule_inflight(sched.actions(pp, 1, m))


def test_chunk_costs_split_a_ranks_times():
    for schedule, v in CASES:
        sched = get_schedule(schedule)
        c, n = sched.chunk_costs(v, 3.0, 5.0), sched.chunks_per_rank(v)
        assert n * c["F"] == pytest.approx(3.0) and n * (c["B"] + c["W"]) == pytest.approx(5.0)
        assert (c["W"] > 0) == (schedule == "zbv")


def test_one_ring_table():
    import meshfold.comm as comm
    import meshfold.planner.cost as cost
    import meshfold.ring as ring

    assert comm.FACTORS is ring.FACTORS and cost.RING is ring.FACTORS and cost.STEPS is ring.HOPS
    assert set(ring.HOPS) == set(ring.FACTORS)


def test_schedule_and_planner_load_without_torch_or_trainer():
    code = ("import sys; import meshfold.schedules, meshfold.ring, "
            "meshfold.planner.cost, meshfold.planner.cli, meshfold.planner.search, meshfold.planner.simulate, "
            "meshfold.planner.calibrate; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('meshfold.train', 'meshfold.testing', "
            "'meshfold.calibration'))]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_search_offers_zbv_where_it_prices_it():
    from meshfold.models.presets import preset
    from meshfold.planner.cost import Workload
    from meshfold.planner.search import schedules
    from meshfold.schedules.zbv import ZBV_MAX_PRICED

    w = Workload(preset("llama3-8b"), global_batch=4096)
    for pp, m in ((4, ZBV_MAX_PRICED // 4), (4, ZBV_MAX_PRICED // 4 + 4), (8, 16)):
        offered = ("zbv", 1) in schedules(w, pp, m)
        assert offered == (pp * m <= ZBV_MAX_PRICED), (pp, m)
    # one estimate still replays a longer order: the V's bubble at B = W = F stays below 1F1B's
    zbv, one_f_one_b = get_schedule("zbv"), get_schedule("1f1b")
    assert zbv.pipeline_time(4, 512, 1, 1.0, 2.0)[1] < one_f_one_b.pipeline_time(4, 512, 1, 1.0, 2.0)[1]


def test_p2p_delay_lands_on_cross_rank_dependencies():
    # one micro-batch down and back up p ranks: 2(p-1) hand-overs on the critical path
    for pp in (2, 3, 4):
        for d in (0.0, 0.25):
            one_f_one_b = get_schedule("1f1b")
            events = simulate(one_f_one_b, one_f_one_b.actions(pp, 1, 1), {"F": 1.0, "B": 2.0, "W": 0.0}, p2p=d)
            assert makespan(events) == pytest.approx(3 * pp + 2 * (pp - 1) * d)
    # the zbv middle hand-over (stages p-1 and p on rank p-1) is local: no delay there
    pp, d = 2, 0.5
    zbv = get_schedule("zbv")
    events = simulate(zbv, zbv.actions(pp, 1, 1), {"F": 1.0, "B": 1.0, "W": 1.0}, p2p=d)
    f = {(e["stage"], e["chunk"]): e for e in events if e["kind"] == "F"}
    assert f[(1, 1)]["start"] == pytest.approx(f[(1, 0)]["end"])
    assert f[(1, 0)]["start"] == pytest.approx(f[(0, 0)]["end"] + d)


def test_interleaved_closed_forms_equal_the_order():
    """The planner's held activations and gradient moments of interleaved orders come from
    arithmetic (``interleaved_held``, ``interleaved_grad_moments``); the dry-run
    measures the built order (``held_counts``). Both must be the same definition."""
    from meshfold.schedules.held import grad_moments, held_counts

    interleaved = get_schedule("interleaved")
    for pp in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in sorted({pp, 2 * pp, 3 * pp, 5 * pp}):
                orders = interleaved._actions(pp, v, m)
                for rank, order in enumerate(orders):
                    assert interleaved.rank_held_counts(pp, v, m, rank) == held_counts(order), (pp, v, m, rank)
                    assert interleaved.rank_grad_moments(pp, v, m, rank) == \
                        grad_moments(interleaved, pp, rank, order), (pp, v, m, rank)

