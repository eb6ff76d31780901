"""SkipPipe's inputs from the config: the stage times and link times its path scheduler
(``meshfold/skippipe.py``, pure) prices, so that every pp rank plans the same paths.

Stage time: the stage's forward FLOPs (``models/stage_balance.py``, the balancer's cost)
over ``parallel.pp_stage_tflops``, backward twice that. Link time: one activation
[micro-batch, seq, dim] in the wire dtype over the pair's rate (``parallel.pp_links``, else
``parallel.pp_link_mbit``; 0 = free). The planner prices the same paths from its cluster
description (``planner/cost.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.models.stage_balance import stage_costs
from meshfold.parallel.exchange import plan_exists
from meshfold.schedule import Action
from meshfold.skippipe import NAME, link_table, plan_orders

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def link_rates(p) -> dict[tuple[int, int], float]:
    """``parallel.pp_links`` as {(a, b): Mbit/s}."""
    return {(int(a), int(b)): float(rate) for a, b, rate in p.pp_links}


def skip_tables(cfg: Config, split: list[int], micro_batch: int, wire_bytes: int):
    """(stage_s, link_s) for ``skippipe.plan_orders``: seconds per micro-batch forward and
    backward of every stage, seconds per message between every pair of pp ranks."""
    p, m = cfg.parallel, cfg.model
    tokens = micro_batch * m.seq_len
    stage_s = tuple((c * tokens / (p.pp_stage_tflops * 1e12), 2 * c * tokens / (p.pp_stage_tflops * 1e12))
                    for c in stage_costs(m, split))
    bits = tokens * m.dim * wire_bytes * 8

    def secs(mbit: float) -> float:
        return bits / (mbit * 1e6) if mbit > 0 else 0.0

    slow = {pair: secs(rate) for pair, rate in link_rates(p).items()}
    return stage_s, link_table(p.pp, secs(p.pp_link_mbit), slow)


def skippipe_orders(cfg: Config, split: list[int], m: int, micro_batch: int, wire_bytes: int) -> list[list[Action]]:
    """Every pp rank's order for ``m`` micro-batches on the planned paths."""
    stage_s, link_s = skip_tables(cfg, split, micro_batch, wire_bytes)
    p = cfg.parallel
    return plan_orders(p.pp, m, float(p.pp_skip), bool(p.pp_reorder), stage_s, link_s, nccl_safe)[1]


def skippipe_paths(cfg: Config, split: list[int], m: int, micro_batch: int, wire_bytes: int):
    """The planned paths themselves (stage tuples per micro-batch), for references and reports."""
    stage_s, link_s = skip_tables(cfg, split, micro_batch, wire_bytes)
    p = cfg.parallel
    return plan_orders(p.pp, m, float(p.pp_skip), bool(p.pp_reorder), stage_s, link_s, nccl_safe)[0]


def nccl_safe(orders: list[list[Action]]) -> bool:
    """Paths are kept only if their orders have a point-to-point plan under NCCL's rules."""
    return plan_exists(NAME, orders)
