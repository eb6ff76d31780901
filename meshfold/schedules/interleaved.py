"""Interleaved 1F1B (Narayanan et al. 2021, Megatron): v = ``pp_virtual_stages`` chunks
per rank, stage = chunk * pp + rank, so a micro-batch loops through the ranks v times.
Micro-batches go in groups of pp through chunk 0, then the same group through chunk 1,
...; backward visits chunks in reverse. The bubble shrinks by v: (p-1)/(v·m+p-1)."""

from __future__ import annotations

from functools import lru_cache

from meshfold.errors import ConfigError
from meshfold.schedules.base import Action, Orders, Schedule
from meshfold.schedules.held import held_counts, moments_table, undominated


def interleaved_warmup(pp: int, rank: int, v: int, m: int) -> int:
    """Forwards ``rank`` runs before its first backward in ``interleaved_order``."""
    return m * v if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)


def interleaved_chunk(kind: str, k: int, pp: int, v: int) -> int:
    """The chunk of the k-th forward (or backward) of an interleaved order: groups of pp
    micro-batches per chunk, backward through the chunks in reverse."""
    return (k // pp) % v if kind == "F" else v - 1 - (k // pp) % v


def interleaved_order(pp: int, rank: int, v: int, m: int) -> list[Action]:
    total = m * v

    def fwd(k: int) -> Action:
        return Action("F", interleaved_chunk("F", k, pp, v), (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        return Action("B", interleaved_chunk("B", k, pp, v), (k // (pp * v)) * pp + k % pp)

    warmup = interleaved_warmup(pp, rank, v, m)
    out = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        out += [fwd(warmup + i), bwd(i)]
    return out + [bwd(k) for k in range(total - warmup, total)]


def interleaved_held(pp: int, rank: int, v: int, m: int) -> tuple[tuple[int, ...], ...]:
    """``held_counts`` of ``interleaved_order`` for ``rank``, without building it (the
    planner asks for every rank of every (pp, v, m) it prices). Counts rise only at
    forwards: through the warm-up, then in the steady state, where forward k and backward
    k - warmup visit chunks in patterns that repeat every pp * v: one period of moments is
    all there are. tests/test_schedule.py checks it against ``held_counts`` of the order."""
    total, warmup = m * v, interleaved_warmup(pp, rank, v, m)
    held, moments = [0] * v, set()
    for k in range(warmup):
        held[interleaved_chunk("F", k, pp, v)] += 1
    moments.add(tuple(held))
    for i in range(min(total - warmup, pp * v)):
        held[interleaved_chunk("F", warmup + i, pp, v)] += 1
        moments.add(tuple(held))
        held[interleaved_chunk("B", i, pp, v)] -= 1
    return undominated(moments)


def interleaved_grad_moments(pp: int, v: int, m: int) -> tuple[tuple[int, ...], ...]:
    """``grad_moments`` of an interleaved order, without building it: every rank runs
    backward k on chunk v - 1 - (k // pp) % v in the order of k (no W actions), so each
    chunk's first and last backward follow from k alone, the same on every rank."""
    first, last = {}, {}
    for k in range(m * v):
        x = interleaved_chunk("B", k, pp, v)
        first.setdefault(x, k)
        last[x] = k
    return moments_table(first, last, v)


class Interleaved(Schedule):
    name = "interleaved"

    def chunks_per_rank(self, virtual: int) -> int:
        return virtual

    def virtual_of(self, virtual: int) -> int:
        return virtual

    def stage_of(self, pp: int, rank: int, chunk: int) -> int:
        return chunk * pp + rank

    def rank_chunk_of_stage(self, pp: int, stage: int) -> tuple[int, int]:
        return stage % pp, stage // pp

    def microbatch_problem(self, pp: int, m: int) -> str | None:
        # the closed-form order walks micro-batches in groups of pp
        if m >= 1 and m % pp:
            return f"interleaved needs a multiple of pp = {pp} micro-batches, got {m}"
        return super().microbatch_problem(pp, m)

    def search_virtuals(self, pp: int, n_micro: int, n_layers: int) -> tuple[int, ...]:
        """2 or 4 chunks per rank, where every chunk holds a block and the micro-batches
        come in groups of pp."""
        return tuple(v for v in (2, 4) if pp * v <= n_layers and n_micro % pp == 0)

    def check_model(self, p, m) -> None:
        if p.pp_virtual_stages < 2:
            raise ConfigError("parallel.pp_schedule = interleaved needs parallel.pp_virtual_stages >= 2 "
                              "(with 1 it is 1f1b)")

    @lru_cache(maxsize=256)
    def _actions(self, pp: int, virtual: int, m: int) -> Orders:
        return [interleaved_order(pp, r, virtual, m) for r in range(pp)]

    def pipeline_time(self, pp: int, m: int, v: int, t_f: float, t_b: float) -> tuple[float, float]:
        """(m + (p - 1)/v)(t_f + t_b) (Narayanan et al. 2021; equals ``simulate`` of the order)."""
        busy = m * (t_f + t_b)
        if pp == 1:
            return busy, 0.0
        bubble = (pp - 1) / v * (t_f + t_b)
        return busy + bubble, bubble

    def theoretical_bubble(self, pp: int, virtual: int, m: int) -> float:
        return (pp - 1) / (virtual * m + pp - 1)

    def inflight_microbatches(self, pp: int, m: int, v: int) -> float:
        """min(m, p(1 + (p-1)/(p v))) (Narayanan et al. 2021)."""
        return 1.0 if pp == 1 else min(float(m), pp * (1 + (pp - 1) / (pp * v)))

    def held_counts_of_rank(self, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
        if virtual > 1:
            return interleaved_held(pp, rank, virtual, m)
        return held_counts(self.actions(pp, virtual, m)[rank])

    def grad_moments_of_rank(self, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
        if virtual > 1:
            return interleaved_grad_moments(pp, virtual, m)
        return super().grad_moments_of_rank(pp, virtual, m, rank)
