"""Zero-bubble V (Qi et al., "Pipeline Parallelism with Controllable Memory"): two chunks
per rank in a V, rank r holds stage r and stage 2pp-1-r; the loss stage is back on rank 0
and the two middle stages share rank pp-1 (their hand-over needs no communication). The
backward splits into B (input gradient, on the critical path) and W (weight gradients,
filling bubbles); the order comes from a greedy list scheduler (B first, then F within an
activation budget of 2·pp chunk-micro-batches, W to fill what is left)."""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from functools import lru_cache

from meshfold.schedules.base import Action, Orders, Schedule
from meshfold.schedules.held import schedule_inflight
from meshfold.schedules.simulate import orders_bubble

# The planner replays zbv's order for every (t_f, t_b) it prices; beyond this many
# micro-batches times ranks (pp * m) a replay costs more than a search can spend on one
# layout, so the search leaves zbv out there (``ZeroBubbleV.priced``); one estimate still replays it.
ZBV_MAX_PRICED = 1024


def _stage_of(pp: int, rank: int, chunk: int) -> int:
    return rank if chunk == 0 else 2 * pp - 1 - rank


def _rank_chunk_of_stage(pp: int, stage: int) -> tuple[int, int]:
    return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)


def _zbv_links(pp: int, rank: int, chunk: int) -> tuple[int, tuple | None, tuple | None]:
    """An F or B on (rank, chunk): its stage, and the (rank, chunk) of the stage before and
    after it that the dependency rules (``Schedule.deps``) link it to."""
    s = _stage_of(pp, rank, chunk)
    before = _rank_chunk_of_stage(pp, s - 1) if s > 0 else None
    after = _rank_chunk_of_stage(pp, s + 1) if s < 2 * pp - 1 else None
    return s, before, after


@lru_cache(maxsize=64)
def greedy_zero_bubble(pp: int, m: int) -> tuple[list[list[Action]], tuple[tuple[str, int, int], ...]]:
    """Zero-bubble V order by list scheduling with unit costs: whenever a rank is free it
    runs a ready B (input grad, on the critical path), else a ready F (the deeper chunk
    first; a new micro-batch enters chunk 0 only while fewer than 2·pp chunk-micro-batches
    hold activations), else a pending W (weight grads fill the bubbles).
    Stage 0's backward is whole (no input to differentiate), so it has no W and takes two
    units.

    Event driven: an action's ready time is known once all its dependencies (``Schedule.deps``)
    are scheduled; each rank keeps the actions that are ready (heaps in pick order) and
    those that will be (a heap by ready time), so a decision costs O(log n). Inside, an
    action is the integer ((rank * 2 + chunk) * 3 + kind) * m + mb, kind 0 F, 1 B, 2 W: the
    planner builds these orders for every (pp, m) it prices, so the loop stays on ints and
    lists; the returned Actions are shared between ranks (they are immutable).

    Returns the per-rank orders and their dependency graph (``_zbv_graph``'s form), in the
    order the actions were scheduled: each one's dependencies were scheduled before it."""
    links = [[_zbv_links(pp, r, c) for c in (0, 1)] for r in range(pp)]
    per_chunk = 3 * m  # ids of one (rank, chunk): its F, B and W of every micro-batch

    n = pp * 2 * per_chunk
    # each action's kind, chunk and micro-batch, looked up rather than divided out
    kind_of = ([0] * m + [1] * m + [2] * m) * (2 * pp)
    chunk_of = ([0] * per_chunk + [1] * per_chunk) * pp
    mb_of = list(range(m)) * (6 * pp)
    left = [0] * n  # dependencies not yet scheduled
    ready_at = [0] * n
    future: list[list[tuple]] = [[] for _ in range(pp)]  # (ready time, seq, action)
    for r in range(pp):
        for c in (0, 1):
            _, before, after = links[r][c]
            base = (r * 2 + c) * per_chunk
            left[base:base + m] = [0 if before is None else 1] * m
            left[base + m:base + 2 * m] = [1 if after is None else 2] * m
            if before is None:  # (in order: already a heap)
                future[r].extend((0, i, base + i) for i in range(m))
    seq = n  # ties in ready time: first unlocked first
    orders: list[list[int]] = [[] for _ in range(pp)]
    free_at = [0] * pp
    pending_w: list[deque] = [deque() for _ in range(pp)]
    inflight = [0] * pp
    ready_b: list[list] = [[] for _ in range(pp)]  # (mb, -stage, action)
    ready_f: list[list] = [[] for _ in range(pp)]  # (-chunk, mb, action)
    budget = 2 * pp
    left_actions = 4 * m * pp + (2 * pp - 1) * m  # F and B on both chunks; a W for every stage but 0
    ends: list[int] = []  # every scheduled end time, sorted
    blocked: list[int] = []  # ranks waiting for an action nobody has scheduled yet
    # Event order: the rank that is free earliest decides next (ties: lowest rank); all
    # completions up to its clock are known, so its choice sees the true ready set. A
    # heap of (free time, rank) over the ranks not blocked: one entry each.
    clocks = [(0, r) for r in range(pp)]
    graph: list[tuple[str, int, int]] = []
    index = [0] * n  # action -> its position in graph
    last_on = [-1] * pp  # each rank's latest action in graph
    while left_actions:
        if not clocks:
            raise RuntimeError("zbv scheduler made no progress")
        now, r = heapq.heappop(clocks)
        fut = future[r]
        while fut and fut[0][0] <= now:
            a = heapq.heappop(fut)[2]
            if kind_of[a] == 1:
                heapq.heappush(ready_b[r], (mb_of[a], -links[r][chunk_of[a]][0], a))
            else:
                heapq.heappush(ready_f[r], (-chunk_of[a], mb_of[a], a))
        pick = -1
        if ready_b[r]:
            pick = heapq.heappop(ready_b[r])[2]
        elif ready_f[r]:
            # Deeper chunk first (it drains toward the loss); a new micro-batch enters
            # chunk 0 only within the activation budget.
            if ready_f[r][0][0] == -1 or inflight[r] < budget:
                pick = heapq.heappop(ready_f[r])[2]
        if pick < 0 and pending_w[r]:
            pick = pending_w[r].popleft()
        if pick < 0:  # idle until the next completion, or until another rank schedules one
            k = bisect.bisect_right(ends, now)
            if k < len(ends):
                free_at[r] = ends[k]
                heapq.heappush(clocks, (ends[k], r))
            else:
                blocked.append(r)
            continue
        for q in blocked:
            heapq.heappush(clocks, (free_at[q], q))
        blocked.clear()
        kind, i = kind_of[pick], mb_of[pick]
        s, before, after = links[r][chunk_of[pick]]
        whole = kind == 1 and s == 0
        end = now + (2 if whole else 1)
        free_at[r] = end
        heapq.heappush(clocks, (end, r))
        bisect.insort(ends, end)
        orders[r].append(pick)
        left_actions -= 1
        # its dependency on another rank (``deps``; one at most): F on the stage before, B on
        # the stage after; its own rank's are covered by that rank's previous action
        cross = -1
        if kind == 0 and before and before[0] != r:
            cross = index[(before[0] * 2 + before[1]) * per_chunk + i]
        elif kind == 1 and after and after[0] != r:
            cross = index[((after[0] * 2 + after[1]) * 3 + 1) * m + i]
        index[pick] = len(graph)
        graph.append(("b" if whole else "FBW"[kind], last_on[r], cross))
        last_on[r] = index[pick]
        if kind == 2:
            continue
        if kind == 0:
            inflight[r] += 1
            unlocked = [pick + m] + ([((after[0] * 2 + after[1]) * 3) * m + i] if after else [])
        else:
            inflight[r] -= 1
            if not whole:
                pending_w[r].append(pick + m)
            unlocked = [((before[0] * 2 + before[1]) * 3 + 1) * m + i] if before else []
        for d in unlocked:
            if ready_at[d] < end:
                ready_at[d] = end
            left[d] -= 1
            if left[d] == 0:
                heapq.heappush(future[d // (2 * per_chunk)], (ready_at[d], seq, d))
                seq += 1
    table = [Action(kind, c, i) for kind in "FBW" for c in (0, 1) for i in range(m)]
    return [[table[(kind_of[a] * 2 + chunk_of[a]) * m + mb_of[a]] for a in order] for order in orders], tuple(graph)


def zbv_graph(pp: int, m: int) -> tuple[tuple[str, int, int], ...]:
    """zbv's actions in an order ``simulate`` could run them, each as (cost kind, index
    of the rank's previous action, index of the other dependency); -1 for none. Cost
    kind "b" is a whole backward (stage 0: B + W). Built with the order
    (``greedy_zero_bubble``)."""
    return greedy_zero_bubble(pp, m)[1]


@lru_cache(maxsize=64)
def _zbv_lists(pp: int, m: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``zbv_graph`` as flat lists for ``_zbv_makespan``'s loop: cost index (F, B, W, b)
    and the two dependencies, -1 (none) mapped to the slot past the last action."""
    graph = zbv_graph(pp, m)
    n = len(graph)
    index = {"F": 0, "B": 1, "W": 2, "b": 3}
    return (tuple(index[k] for k, _, _ in graph), tuple(a if a >= 0 else n for _, a, _ in graph),
            tuple(b if b >= 0 else n for _, _, b in graph))


class ZeroBubbleV(Schedule):
    name = "zbv"
    splits_backward = True
    w_share = 0.5  # of a block's backward, the weight gradients are half the matmul FLOPs

    def chunks_per_rank(self, virtual: int) -> int:
        return 2

    def stage_of(self, pp: int, rank: int, chunk: int) -> int:
        return _stage_of(pp, rank, chunk)

    def rank_chunk_of_stage(self, pp: int, stage: int) -> tuple[int, int]:
        return _rank_chunk_of_stage(pp, stage)

    def n_stages(self, orders: Orders) -> int:
        return 2 * len(orders)

    def _actions(self, pp: int, virtual: int, m: int) -> Orders:
        return greedy_zero_bubble(pp, m)[0]

    def pipeline_time(self, pp: int, m: int, v: int, t_f: float, t_b: float) -> tuple[float, float]:
        """``simulate`` of the V order the executor runs, with ``chunk_costs``."""
        busy = m * (t_f + t_b)
        if pp == 1:
            return busy, 0.0
        span = self._makespan(pp, m, t_f, t_b)
        return span, span - busy

    @lru_cache(maxsize=8192)
    def _makespan(self, pp: int, m: int, t_f: float, t_b: float) -> float:
        """``makespan(simulate(...))`` of the zbv order, on its precomputed dependency lists."""
        c = self.chunk_costs(1, t_f, t_b)
        cost = (c["F"], c["B"], c["W"], c["B"] + c["W"])
        kinds, firsts, seconds = _zbv_lists(pp, m)
        end = [0.0] * (len(kinds) + 1)  # the last slot stays 0.0: "no dependency"
        for i, (k, a, b) in enumerate(zip(kinds, firsts, seconds)):
            end[i] = max(end[a], end[b]) + cost[k]
        return max(end)

    def bubble_lower_bound(self, pp: int, m: int, v: int, t_f: float, t_b: float) -> float:
        """The larger of two paths every V order has, with chunk costs F, B, W and the busy
        time of a rank m (t_f + t_b) = 2m (F + B + W):
        - rank pp - 1 starts once micro-batch 0 went forward through the pp - 1 stages
          before it, then runs all its work one action after another: (pp - 1) F;
        - the micro-batch that enters stage 0 last does so after the other m - 1 (rank 0
          runs them one by one), then goes forward through all 2 pp stages, backward through
          the 2 pp - 1 above stage 0 and through stage 0 whole (B + W):
          (m - 1 + 2 pp) F + 2 pp B + W, which bounds few micro-batches (m < pp) better."""
        if pp == 1:
            return self.pipeline_time(pp, m, v, t_f, t_b)[1]
        c = self.chunk_costs(1, t_f, t_b)
        f, b, w = c["F"], c["B"], c["W"]
        one_microbatch = (m - 1 + 2 * pp) * f + 2 * pp * b + w - 2 * m * (f + b + w)
        return max((pp - 1) * f, one_microbatch)

    def theoretical_bubble(self, pp: int, virtual: int, m: int) -> float:
        """The unit-cost simulation of the order (zero once m is large enough)."""
        return orders_bubble(self, self.actions(pp, virtual, m))

    def priced(self, pp: int, m: int) -> bool:
        """Whether a search prices zbv at this size (see ``ZBV_MAX_PRICED``)."""
        return pp * m <= ZBV_MAX_PRICED

    def search_virtuals(self, pp: int, n_micro: int, n_layers: int) -> tuple[int, ...]:
        """Priced by replaying its order: only where every chunk holds a block and the
        replay is affordable (``priced``)."""
        return (1,) if 2 * pp <= n_layers and self.priced(pp, n_micro) else ()

    def inflight_microbatches(self, pp: int, m: int, v: int) -> float:
        """Counted on the order the executor runs."""
        return 1.0 if pp == 1 else self._inflight(pp, m)

    @lru_cache(maxsize=1024)
    def _inflight(self, pp: int, m: int) -> float:
        return schedule_inflight(self.actions(pp, 1, m))
