"""Compatibility: SkipPipe's path planner moved to ``meshfold/schedules/skippipe/paths.py``
(the skippipe schedule's own modules); these names stay until the planner imports them
from there."""

from __future__ import annotations

from meshfold.schedules.skippipe.paths import (NAME, SIMULATED_MAX, candidates, limits, link_table, path_orders, plan,
                                               plan_orders, step_time, table_step_time)

__all__ = ["NAME", "SIMULATED_MAX", "candidates", "limits", "link_table", "path_orders", "plan", "plan_orders",
           "step_time", "table_step_time"]
