"""What a pipeline schedule is: the ``Action`` its per-rank orders are made of, and the
``Schedule`` base every schedule module subclasses (``gpipe.py``, ``one_f_one_b.py``,
``interleaved.py``, ``zbv.py``, ``skippipe/``). The executor (``parallel/pp/executor.py``)
and the planner ask the same object, so the planner predicts the schedule that runs.

A schedule answers: its layout (chunks per rank, which stage a (rank, chunk) holds), its
per-rank orders, the dependency rules between actions, its makespan and bubble (closed
forms where they exist, else the simulator's replay), the activations and gradients a
rank holds at each moment, and its own config checks. The defaults here are the
one-stage-per-rank layout with the whole backward in B (GPipe, 1F1B).

Standard library only (core layer): the planner uses it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

from meshfold.schedules.held import grad_moments, held_counts


@dataclass(frozen=True)
class Action:
    kind: str  # F | B | W
    chunk: int
    mb: int
    # (stage before, stage after) on this micro-batch's path, -1 for none; None = the
    # neighbouring stages s-1, s+1 (every schedule but skippipe). Not part of equality.
    route: tuple[int, int] | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


Orders = list[list[Action]]


@dataclass(frozen=True)
class RunFacts:
    """What a schedule that plans its orders for one run (skippipe's paths) may read, built
    by the executor from the config (``parallel/pp/run_orders.py``): the ``[parallel]``
    section, each stage's forward FLOPs per token (computed only when asked), tokens per
    micro-batch, the model width, the bytes of one wire element, and whether an order has a
    point-to-point plan under NCCL's rules."""

    parallel: Any
    stage_flops: Callable[[], Sequence[float]]
    tokens: int
    dim: int
    wire_bytes: int
    feasible: Callable[[Orders], bool]


def neighbours(a: Action, stage: int, n_stages: int) -> tuple[int | None, int | None]:
    """The stages before and after ``stage`` on ``a``'s micro-batch path (None: none)."""
    before, after = (stage - 1, stage + 1) if a.route is None else a.route
    return (before if before >= 0 else None), (after if 0 <= after < n_stages else None)


class Schedule:
    """One pipeline schedule. Subclasses set ``name`` and override what differs."""

    name = ""
    # whether a backward splits into B (input gradient) and W (weight gradient) actions
    splits_backward = False
    # share of a backward that is W where it splits (Qi et al. 2024: half the matmul FLOPs)
    w_share = 0.0
    # whether the model's last stage may hold a copy of a first-stage weight (a tied
    # embedding copy whose gradient the executor sums with the first stage's)
    runs_stage_weight_copies = True
    # whether a layout search may leave it out: another schedule always does at least as
    # well (gpipe: 1F1B's time with more memory); a brute-force search still prices it
    dominated = False

    def __repr__(self) -> str:
        return f"<schedule {self.name}>"

    # ------------------------------------------------------------------ layout

    def chunks_per_rank(self, virtual: int) -> int:
        """Model chunks (stages) one pipeline rank holds."""
        return 1

    def stage_of(self, pp: int, rank: int, chunk: int) -> int:
        return rank

    def rank_chunk_of_stage(self, pp: int, stage: int) -> tuple[int, int]:
        return stage, 0

    def n_stages(self, orders: Orders) -> int:
        """Stages of the model the per-rank ``orders`` run."""
        return len(orders) * (max(a.chunk for o in orders for a in o) + 1)

    def virtual_of(self, virtual: int) -> int:
        """``pp_virtual_stages`` as this schedule reads it (1 where it has no virtual stages)."""
        return 1

    # ------------------------------------------------------------------ checks

    def microbatch_problem(self, pp: int, m: int) -> str | None:
        """Why ``m`` micro-batches cannot run with ``pp`` ranks, or None."""
        return f"{m} micro-batches" if m < 1 else None

    def check_parallel(self, p, chosen: bool) -> None:
        """``[parallel]`` alone (``layout.validate``); every registered schedule is asked,
        ``chosen`` says whether it is ``p.pp_schedule``: a schedule checks its own keys."""

    def check_model(self, p, m) -> None:
        """The layout against the model (``parallel/config.py``), when this schedule runs pp > 1."""

    # ------------------------------------------------------------------ orders

    def actions(self, pp: int, virtual: int, m: int) -> Orders:
        """Per pp rank, the ordered actions of one optimizer step over ``m`` micro-batches.
        Cached and shared: treat them as read-only."""
        problem = self.microbatch_problem(pp, m)
        if problem:
            raise ValueError(f"parallel.pp_microbatches: {problem}")
        return self._actions(pp, self.virtual_of(virtual), m)

    def _actions(self, pp: int, virtual: int, m: int) -> Orders:
        raise NotImplementedError

    def run_orders(self, pp: int, virtual: int, m: int, facts: RunFacts) -> Orders:
        """The orders a run executes (default: ``actions``; a schedule that plans per run
        reads ``facts``)."""
        return self.actions(pp, virtual, m)

    def deps(self, pp: int, n_stages: int, a: Action, rank: int) -> list[tuple[int, Action]]:
        """(rank, action) pairs that must finish before ``a`` on ``rank`` can start."""
        s = self.stage_of(pp, rank, a.chunk)
        before, after = neighbours(a, s, n_stages)
        if a.kind == "F":
            if before is None:
                return []
            r, c = self.rank_chunk_of_stage(pp, before)
            return [(r, Action("F", c, a.mb))]
        if a.kind == "B":
            out = [(rank, Action("F", a.chunk, a.mb))]
            if after is not None:
                r, c = self.rank_chunk_of_stage(pp, after)
                out.append((r, Action("B", c, a.mb)))
            return out
        return [(rank, Action("B", a.chunk, a.mb))]

    # ------------------------------------------------------------------ time

    def chunk_costs(self, virtual: int, t_f: float, t_b: float) -> dict[str, float]:
        """Per-action costs from one rank's per-micro-batch forward and backward times (all
        its chunks): split evenly over the chunks; a split backward into B and W."""
        c = self.chunks_per_rank(virtual)
        w = self.w_share
        return {"F": t_f / c, "B": t_b * (1 - w) / c, "W": t_b * w / c}

    def pipeline_time(self, pp: int, m: int, v: int, t_f: float, t_b: float) -> tuple[float, float]:
        """(makespan, bubble) of one step with per-micro-batch rank times t_f, t_b (all of a
        rank's chunks). Default: GPipe's and 1F1B's (m + p - 1)(t_f + t_b) (Huang et al.;
        Narayanan et al. 2021), equal to ``simulate`` of their orders (tests check it)."""
        busy = m * (t_f + t_b)
        if pp == 1:
            return busy, 0.0
        bubble = (pp - 1) * (t_f + t_b)
        return busy + bubble, bubble

    def bubble_lower_bound(self, pp: int, m: int, v: int, t_f: float, t_b: float) -> float:
        """A bubble ``pipeline_time`` never goes below, without replaying any order (the
        planner's search bounds layouts with it); exact for the closed forms."""
        return self.pipeline_time(pp, m, v, t_f, t_b)[1]

    def theoretical_bubble(self, pp: int, virtual: int, m: int) -> float:
        """Share of the step each stage idles: (p-1)/(m+p-1) by default."""
        return (pp - 1) / (m + pp - 1)

    def orders_theoretical_bubble(self, pp: int, virtual: int, m: int, orders: Orders) -> float:
        """The bubble a run of ``orders`` (``run_orders``) should show: ``theoretical_bubble``
        unless the orders are planned per run."""
        return self.theoretical_bubble(pp, virtual, m)

    def priced(self, pp: int, m: int) -> bool:
        """Whether a planner search prices this schedule at this size (all but zbv: always)."""
        return True

    def search_virtuals(self, pp: int, n_micro: int, n_layers: int) -> tuple[int, ...]:
        """The ``pp_virtual_stages`` a planner search tries this schedule with, for ``pp``
        ranks, ``n_micro`` micro-batches and ``n_layers`` blocks (empty: not searched)."""
        return (1,)

    # ------------------------------------------------------------------ paths

    def priced_as_paths(self, own_links: bool) -> bool:
        """Whether the planner prices a step as per-micro-batch paths over the pp links
        (``skippipe/paths.py``, each link at its own rate) instead of ``pipeline_time``;
        ``own_links``: the layout gives some links a rate of their own (``parallel.pp_links``)."""
        return False

    def path_options(self, p) -> tuple[float, bool]:
        """(share of stages a micro-batch may skip, whether it may visit them out of order)
        for the path planner, from ``p`` (``[parallel]`` or a planner layout): every stage, in order."""
        return 0.0, False

    # ------------------------------------------------------------------ traffic

    def sends_per_microbatch(self, pp: int, virtual: int, rank: int) -> int:
        """Point-to-point sends of pp rank ``rank`` per micro-batch: each of its chunks sends
        its activations to the next stage and its input gradient to the one before, where
        that stage sits on another rank."""
        chunks = self.chunks_per_rank(virtual)
        n_stages = pp * chunks
        sends = 0
        for c in range(chunks):
            s = self.stage_of(pp, rank, c)
            for other in (s + 1, s - 1):
                if 0 <= other < n_stages and self.rank_chunk_of_stage(pp, other)[0] != rank:
                    sends += 1
        return sends

    # ------------------------------------------------------------------ memory

    def inflight_microbatches(self, pp: int, m: int, v: int) -> float:
        """Micro-batches whose activations the fullest pipeline rank holds at once, in units
        of one micro-batch through all that rank's chunks. Default 1F1B's min(m, p)."""
        return 1.0 if pp == 1 else float(min(m, pp))

    @lru_cache(maxsize=4096)
    def rank_held_counts(self, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
        """``held.held_counts`` of pp rank ``rank``'s order (cached: the planner asks often)."""
        return self.held_counts_of_rank(pp, virtual, m, rank)

    def held_counts_of_rank(self, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
        return held_counts(self.actions(pp, virtual, m)[rank])

    @lru_cache(maxsize=4096)
    def rank_grad_moments(self, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
        """``held.grad_moments`` of pp rank ``rank``'s order (cached)."""
        return self.grad_moments_of_rank(pp, virtual, m, rank)

    def grad_moments_of_rank(self, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
        return grad_moments(self, pp, rank, self.actions(pp, virtual, m)[rank])
