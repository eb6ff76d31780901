"""1F1B (Narayanan et al. 2019, PipeDream-Flush): rank r runs pp - r - 1 warm-up forwards,
then alternates one forward and one backward; one stage per rank. Bubble GPipe's
(p-1)/(m+p-1), activations of at most pp - r micro-batches."""

from __future__ import annotations

from functools import lru_cache

from meshfold.schedules.base import Action, Orders, Schedule


def one_f_one_b_order(pp: int, rank: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    out = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return out + [Action("B", 0, i) for i in range(m - warmup, m)]


class OneFOneB(Schedule):
    name = "1f1b"

    @lru_cache(maxsize=256)
    def _actions(self, pp: int, virtual: int, m: int) -> Orders:
        return [one_f_one_b_order(pp, r, m) for r in range(pp)]

    def held_counts_of_rank(self, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
        return ((min(m, pp - rank),),)

    def priced_as_paths(self, own_links: bool) -> bool:
        """With links of their own: 1F1B's orders are the path planner's with every stage in
        order, so it prices each link on its own."""
        return own_links
