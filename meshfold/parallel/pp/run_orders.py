"""The orders a pipeline run executes, pure (no torch): the schedule object's
``run_orders`` given what a schedule that plans per run may read (``RunFacts``, from the
config), so every pp rank, the planner's checks and the tests get the same orders."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.models.stage_balance import stage_costs
from meshfold.parallel.pp.p2p_plan import nccl_check
from meshfold.schedules import Orders, RunFacts, Schedule, get_schedule

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def run_facts(cfg: Config, schedule: Schedule, split: list[int], micro_batch: int, wire_bytes: int) -> RunFacts:
    """``RunFacts`` of this config: ``split`` blocks per stage, ``micro_batch`` sequences per
    micro-batch, ``wire_bytes`` per element sent between stages."""
    m = cfg.model
    return RunFacts(parallel=cfg.parallel, stage_flops=lambda: stage_costs(m, split),
                    tokens=micro_batch * m.seq_len, dim=m.dim, wire_bytes=wire_bytes, feasible=nccl_check(schedule))


def orders_of_run(cfg: Config, split: list[int], m: int, micro_batch: int, wire_bytes: int,
                  schedule: Schedule | None = None) -> Orders:
    """Every pp rank's order for ``m`` micro-batches of this config's schedule."""
    p = cfg.parallel
    schedule = schedule or get_schedule(p.pp_schedule)
    facts = run_facts(cfg, schedule, split, micro_batch, wire_bytes)
    return schedule.run_orders(p.pp, p.pp_virtual_stages, m, facts)
