"""The ``skippipe`` schedule object: 1F1B's layout and memory, with orders planned per run
over per-micro-batch paths (``paths.py``) from the stage and link times of the config
(``parallel.pp_stage_tflops``, ``pp_link_mbit``, ``pp_links``), and its own config keys
(``parallel.pp_skip``, ``pp_reorder``) checked here. Without a plan (the planner's
closed forms, ``actions``) its orders are 1F1B's: every stage, in order."""

from __future__ import annotations

from meshfold.errors import ConfigError
from meshfold.schedules.base import Orders, RunFacts
from meshfold.schedules.one_f_one_b import OneFOneB
from meshfold.schedules.simulate import orders_bubble
from meshfold.schedules.skippipe.paths import NAME, link_table, plan_orders


def link_rates(p) -> dict[tuple[int, int], float]:
    """``parallel.pp_links`` as {(a, b): Mbit/s}."""
    return {(int(a), int(b)): float(rate) for a, b, rate in p.pp_links}


def run_tables(facts: RunFacts):
    """(stage_s, link_s) for ``paths.plan_orders``: seconds per micro-batch forward and
    backward of every stage (its forward FLOPs over ``parallel.pp_stage_tflops``, backward
    twice that), seconds per message between every pair of pp ranks (one activation
    [micro-batch, seq, dim] in the wire dtype over the pair's rate: ``parallel.pp_links``,
    else ``parallel.pp_link_mbit``; 0 = free)."""
    p, tokens = facts.parallel, facts.tokens
    stage_s = tuple((c * tokens / (p.pp_stage_tflops * 1e12), 2 * c * tokens / (p.pp_stage_tflops * 1e12))
                    for c in facts.stage_flops())
    bits = tokens * facts.dim * facts.wire_bytes * 8

    def secs(mbit: float) -> float:
        return bits / (mbit * 1e6) if mbit > 0 else 0.0

    slow = {pair: secs(rate) for pair, rate in link_rates(p).items()}
    return stage_s, link_table(p.pp, secs(p.pp_link_mbit), slow)


class SkipPipe(OneFOneB):
    name = NAME
    # (its planned paths were never checked with a last stage holding a first-stage copy)
    runs_stage_weight_copies = False

    def check_parallel(self, p, chosen: bool) -> None:
        if not 0.0 <= p.pp_skip < 1.0:
            raise ConfigError(f"parallel.pp_skip = {p.pp_skip}: the share of stages a micro-batch may skip is in [0, 1)")
        if (p.pp_skip or p.pp_reorder) and not chosen:
            raise ConfigError(f'parallel.pp_skip / pp_reorder need parallel.pp_schedule = "{NAME}"')

    def search_virtuals(self, pp: int, n_micro: int, n_layers: int) -> tuple[int, ...]:
        """Not searched: its paths follow per-run stage and link rates the search does not vary."""
        return ()

    def priced_as_paths(self, own_links: bool) -> bool:
        return True

    def path_options(self, p) -> tuple[float, bool]:
        return float(p.pp_skip), bool(p.pp_reorder)

    def run_orders(self, pp: int, virtual: int, m: int, facts: RunFacts) -> Orders:
        return self.run_paths_orders(m, facts)[1]

    def run_paths_orders(self, m: int, facts: RunFacts):
        """(paths, orders) of ``m`` micro-batches on the planned paths."""
        stage_s, link_s = run_tables(facts)
        p = facts.parallel
        return plan_orders(p.pp, m, *self.path_options(p), stage_s, link_s, facts.feasible)

    def theoretical_bubble(self, pp: int, virtual: int, m: int) -> float:
        """The unit-cost simulation of the unplanned (1F1B) orders."""
        return orders_bubble(self, self.actions(pp, virtual, m))

    def orders_theoretical_bubble(self, pp: int, virtual: int, m: int, orders: Orders) -> float:
        """The unit-cost simulation of the planned orders themselves."""
        return orders_bubble(self, orders)
