"""Compatibility: the schedule functions by name, each a thin delegate to the registered
schedule object (``meshfold/schedules/``), kept so the planner and the dry-run work
unchanged until they hold the object themselves (``get_schedule(name)`` once, then its
methods). New code uses ``meshfold.schedules``.

An unknown name answers as the one-stage-per-rank layout, as these functions always did
(the planner passes "" for pp = 1); ``schedule_actions`` refuses it."""

from __future__ import annotations

from meshfold.schedules import Action, Schedule, get_schedule, neighbours, schedule_names
from meshfold.schedules.held import grad_moments as _grad_moments
from meshfold.schedules.held import held_counts, held_peak, schedule_inflight as _schedule_inflight
from meshfold.schedules.registry import find_schedule
from meshfold.schedules.simulate import bubble_fractions, default_costs, makespan
from meshfold.schedules.simulate import orders_bubble as _orders_bubble
from meshfold.schedules.simulate import simulate as _simulate
from meshfold.schedules.zbv import ZBV_MAX_PRICED

__all__ = ["Action", "SCHEDULES", "W_SHARE", "ZBV_MAX_PRICED", "bubble_fractions", "bubble_lower_bound",
           "chunk_costs", "chunks_per_rank", "default_costs", "deps", "grad_moments", "held_counts", "held_peak",
           "inflight_microbatches", "makespan", "microbatch_problem", "n_stages_of", "neighbours",
           "orders_bubble", "pipeline_time", "rank_chunk_of_stage", "rank_grad_moments", "rank_held_counts",
           "schedule_actions", "schedule_inflight", "simulate", "stage_of", "theoretical_bubble", "zbv_priced"]

SCHEDULES = schedule_names()
W_SHARE = get_schedule("zbv").w_share
_STAGE_PER_RANK = Schedule()


def _of(schedule: str) -> Schedule:
    return find_schedule(schedule) or _STAGE_PER_RANK


def chunks_per_rank(schedule: str, virtual: int) -> int:
    return _of(schedule).chunks_per_rank(virtual)


def stage_of(schedule: str, pp: int, rank: int, chunk: int) -> int:
    return _of(schedule).stage_of(pp, rank, chunk)


def rank_chunk_of_stage(schedule: str, pp: int, stage: int) -> tuple[int, int]:
    return _of(schedule).rank_chunk_of_stage(pp, stage)


def n_stages_of(schedule: str, orders: list[list[Action]]) -> int:
    return _of(schedule).n_stages(orders)


def microbatch_problem(schedule: str, pp: int, m: int) -> str | None:
    return _of(schedule).microbatch_problem(pp, m)


def schedule_actions(schedule: str, pp: int, virtual: int, m: int) -> list[list[Action]]:
    problem = microbatch_problem(schedule, pp, m)
    if problem:
        raise ValueError(f"parallel.pp_microbatches: {problem}")
    return get_schedule(schedule).actions(pp, virtual, m)


def deps(schedule: str, pp: int, n_stages: int, a: Action, rank: int) -> list[tuple[int, Action]]:
    return _of(schedule).deps(pp, n_stages, a, rank)


def simulate(schedule: str, orders: list[list[Action]], cost=None, p2p=0.0) -> list[dict]:
    return _simulate(_of(schedule), orders, cost, p2p)


def orders_bubble(schedule: str, orders: list[list[Action]]) -> float:
    return _orders_bubble(_of(schedule), orders)


def theoretical_bubble(schedule: str, pp: int, virtual: int, m: int) -> float:
    return get_schedule(schedule).theoretical_bubble(pp, virtual, m)


def chunk_costs(schedule: str, virtual: int, t_f: float, t_b: float) -> dict[str, float]:
    return _of(schedule).chunk_costs(virtual, t_f, t_b)


def pipeline_time(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float) -> tuple[float, float]:
    return _of(schedule).pipeline_time(pp, m, v, t_f, t_b)


def bubble_lower_bound(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float) -> float:
    return _of(schedule).bubble_lower_bound(pp, m, v, t_f, t_b)


def zbv_priced(pp: int, m: int) -> bool:
    return get_schedule("zbv").priced(pp, m)


def inflight_microbatches(schedule: str, pp: int, m: int, v: int) -> float:
    return _of(schedule).inflight_microbatches(pp, m, v)


def schedule_inflight(schedule: str, orders: list[list[Action]]) -> float:
    return _schedule_inflight(orders)


def rank_held_counts(schedule: str, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    return get_schedule(schedule).rank_held_counts(pp, virtual, m, rank)


def rank_grad_moments(schedule: str, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    return get_schedule(schedule).rank_grad_moments(pp, virtual, m, rank)


def grad_moments(schedule: str, pp: int, rank: int, order: list[Action]) -> tuple[tuple[int, ...], ...]:
    return _grad_moments(_of(schedule), pp, rank, order)
