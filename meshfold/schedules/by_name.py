"""Three schedule answers by schedule name, for ``meshfold/dryrun.py`` only, until it holds
the schedule object itself (it is being rewritten as the trainer plus an observer, issue
#40; this module goes with that). New code looks the object up once (``get_schedule``)
and asks it."""

from __future__ import annotations

from meshfold.schedules.registry import get_schedule


def chunks_per_rank(schedule: str, virtual: int) -> int:
    return get_schedule(schedule).chunks_per_rank(virtual)


def stage_of(schedule: str, pp: int, rank: int, chunk: int) -> int:
    return get_schedule(schedule).stage_of(pp, rank, chunk)


def rank_grad_moments(schedule: str, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    return get_schedule(schedule).rank_grad_moments(pp, virtual, m, rank)
