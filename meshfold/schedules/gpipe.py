"""GPipe (Huang et al. 2019): every rank runs all m forwards, then all m backwards; one
stage per rank. Bubble (p-1)/(m+p-1); a rank holds all m micro-batches' activations."""

from __future__ import annotations

from functools import lru_cache

from meshfold.schedules.base import Action, Orders, Schedule


class GPipe(Schedule):
    name = "gpipe"
    dominated = True  # 1F1B's time, with all m micro-batches' activations held

    @lru_cache(maxsize=256)
    def _actions(self, pp: int, virtual: int, m: int) -> Orders:
        return [[Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)] for _ in range(pp)]

    def inflight_microbatches(self, pp: int, m: int, v: int) -> float:
        return 1.0 if pp == 1 else float(m)

    def held_counts_of_rank(self, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
        return ((m,),)
