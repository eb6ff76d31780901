"""Pipeline schedules as registered objects (core layer, standard library only): each
schedule is one module with its layout, orders, dependency rules, makespan and bubble,
memory moments and config checks (``base.Schedule``), registered here by one line and
looked up by name once (``get_schedule``). The executor (``parallel/pp/executor.py``)
runs what the object says and the planner prices the same object.

A new schedule: a module subclassing ``Schedule`` (override what differs from one stage
per rank with the whole backward in B) and one ``register(...)`` line below
(docs/pipeline.md)."""

from __future__ import annotations

from meshfold.schedules.base import Action, Orders, RunFacts, Schedule, neighbours
from meshfold.schedules.gpipe import GPipe
from meshfold.schedules.interleaved import Interleaved
from meshfold.schedules.one_f_one_b import OneFOneB
from meshfold.schedules.registry import all_schedules, get_schedule, register, schedule_names
from meshfold.schedules.skippipe.schedule import SkipPipe
from meshfold.schedules.zbv import ZeroBubbleV

register(GPipe())
register(OneFOneB())
register(Interleaved())
register(ZeroBubbleV())
register(SkipPipe())

__all__ = ["Action", "Orders", "RunFacts", "Schedule", "neighbours", "all_schedules", "get_schedule", "register",
           "schedule_names"]
