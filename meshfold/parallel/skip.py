"""Compatibility: SkipPipe's inputs from the config, now the skippipe schedule object's
(``meshfold/schedules/skippipe/schedule.py``, through the generic ``RunFacts`` of
``parallel/pp/run_orders.py``). Kept until the planner and the tests call those."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.parallel.pp.p2p_plan import nccl_check
from meshfold.parallel.pp.run_orders import run_facts
from meshfold.schedules import Action, get_schedule
from meshfold.schedules.skippipe.paths import NAME
from meshfold.schedules.skippipe.schedule import link_rates, run_tables

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config

__all__ = ["link_rates", "nccl_safe", "skip_tables", "skippipe_orders", "skippipe_paths"]

_SKIPPIPE = get_schedule(NAME)
# Paths are kept only if their orders have a point-to-point plan under NCCL's rules (the
# same function object the executor hands the schedule, so their plans share one cache).
nccl_safe = nccl_check(_SKIPPIPE)


def skip_tables(cfg: Config, split: list[int], micro_batch: int, wire_bytes: int):
    """(stage_s, link_s) for ``skippipe.plan_orders`` (``run_tables``)."""
    return run_tables(run_facts(cfg, _SKIPPIPE, split, micro_batch, wire_bytes))


def skippipe_orders(cfg: Config, split: list[int], m: int, micro_batch: int, wire_bytes: int) -> list[list[Action]]:
    """Every pp rank's order for ``m`` micro-batches on the planned paths."""
    return _SKIPPIPE.run_paths_orders(m, run_facts(cfg, _SKIPPIPE, split, micro_batch, wire_bytes))[1]


def skippipe_paths(cfg: Config, split: list[int], m: int, micro_batch: int, wire_bytes: int):
    """The planned paths themselves (stage tuples per micro-batch), for references and reports."""
    return _SKIPPIPE.run_paths_orders(m, run_facts(cfg, _SKIPPIPE, split, micro_batch, wire_bytes))[0]
