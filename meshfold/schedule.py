"""Pipeline schedules, pure: the one model of what a pipeline step runs, shared by the
executor (``parallel/pipeline.py``) and the planner (``planner/cost.py``,
``planner/simulate.py``), so the planner predicts the schedule that runs.

Standard library only (no torch, no config): it sits in the core layer, where the
planner can use it without importing torch (``meshfold.parallel``'s package init does).

Layout. The model is cut into S contiguous stages; each pp rank holds ``chunks_per_rank``
of them:

* ``gpipe``, ``1f1b``: one stage per rank, stage = rank.
* ``interleaved``: v = ``pp_virtual_stages`` chunks, stage = chunk * pp + rank (Narayanan
  et al. 2021), so a micro-batch loops through the ranks v times.
* ``zbv``: two chunks in a V: rank r holds stage r and stage 2pp-1-r (Qi et al., "Pipeline
  Parallelism with Controllable Memory"); the loss stage is back on rank 0 and the two
  middle stages share rank pp-1 (their hand-over needs no communication).

Schedules are per-rank ordered lists of actions F (forward), B (backward; input gradient
only when a W follows) and W (weight gradient) on (chunk, micro-batch). GPipe, 1F1B and
interleaved orders are the published closed forms; zbv comes from a greedy list
scheduler (B first, then F within an activation budget of 2·pp chunk-micro-batches, W to
fill what is left). ``simulate`` replays any schedule with given action costs; it is the
proof that an order cannot deadlock (every receive's send comes earlier in simulated time)
and it gives the bubble, the makespan the planner prices and the activations in flight.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from operator import ge

# skippipe: 1F1B's layout with per-micro-batch paths (``meshfold/skippipe.py`` plans them)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "skippipe")


# --------------------------------------------------------------------------- layout


def chunks_per_rank(schedule: str, virtual: int) -> int:
    """Model chunks (stages) one pipeline rank holds."""
    return {"interleaved": virtual, "zbv": 2}.get(schedule, 1)


def stage_of(schedule: str, pp: int, rank: int, chunk: int) -> int:
    if schedule == "interleaved":
        return chunk * pp + rank
    if schedule == "zbv":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return rank


def rank_chunk_of_stage(schedule: str, pp: int, stage: int) -> tuple[int, int]:
    if schedule == "interleaved":
        return stage % pp, stage // pp
    if schedule == "zbv":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage, 0


def n_stages_of(schedule: str, orders: list[list[Action]]) -> int:
    """Stages of the model the per-rank ``orders`` run."""
    pp = len(orders)
    return 2 * pp if schedule == "zbv" else pp * (max(a.chunk for o in orders for a in o) + 1)


def microbatch_problem(schedule: str, pp: int, m: int) -> str | None:
    """Why ``m`` micro-batches cannot run on ``schedule`` with ``pp`` ranks, or None."""
    if m < 1:
        return f"{m} micro-batches"
    # gpipe, 1f1b and zbv run any count (below pp they degenerate towards GPipe's bubble;
    # torch's Schedule1F1B/ZBV refuse that, our executor does not need to). Interleaved's
    # closed-form order walks micro-batches in groups of pp.
    if schedule == "interleaved" and m % pp:
        return f"interleaved needs a multiple of pp = {pp} micro-batches, got {m}"
    return None


# --------------------------------------------------------------------------- schedules


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


def schedule_actions(schedule: str, pp: int, virtual: int, m: int) -> list[list[Action]]:
    """Per pp rank, the ordered actions of one optimizer step over ``m`` micro-batches.
    The lists are cached and shared: treat them as read-only."""
    problem = microbatch_problem(schedule, pp, m)
    if problem:
        raise ValueError(f"parallel.pp_microbatches: {problem}")
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule = {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    return _actions(schedule, pp, virtual if schedule == "interleaved" else 1, m)


@lru_cache(maxsize=256)
def _actions(schedule: str, pp: int, virtual: int, m: int) -> list[list[Action]]:
    if schedule == "gpipe":
        return [[Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)] for _ in range(pp)]
    if schedule in ("1f1b", "skippipe"):  # skippipe without a path plan: every stage, in order
        return [_one_f_one_b(pp, r, m) for r in range(pp)]
    if schedule == "interleaved":
        return [_interleaved(pp, r, virtual, m) for r in range(pp)]
    return _greedy_zero_bubble(pp, m)[0]


def _one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    out = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return out + [Action("B", 0, i) for i in range(m - warmup, m)]


def _interleaved_warmup(pp: int, rank: int, v: int, m: int) -> int:
    """Forwards ``rank`` runs before its first backward in ``_interleaved``."""
    return m * v if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)


def _interleaved_chunk(kind: str, k: int, pp: int, v: int) -> int:
    """The chunk of the k-th forward (or backward) of an interleaved order: groups of pp
    micro-batches per chunk, backward through the chunks in reverse."""
    return (k // pp) % v if kind == "F" else v - 1 - (k // pp) % v


def _interleaved(pp: int, rank: int, v: int, m: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches go in groups of pp through chunk 0, then
    the same group through chunk 1, ...; backward visits chunks in reverse."""
    total = m * v

    def fwd(k: int) -> Action:
        return Action("F", _interleaved_chunk("F", k, pp, v), (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        return Action("B", _interleaved_chunk("B", k, pp, v), (k // (pp * v)) * pp + k % pp)

    warmup = _interleaved_warmup(pp, rank, v, m)
    out = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        out += [fwd(warmup + i), bwd(i)]
    return out + [bwd(k) for k in range(total - warmup, total)]


def neighbours(a: Action, stage: int, n_stages: int) -> tuple[int | None, int | None]:
    """The stages before and after ``stage`` on ``a``'s micro-batch path (None: none)."""
    before, after = (stage - 1, stage + 1) if a.route is None else a.route
    return (before if before >= 0 else None), (after if 0 <= after < n_stages else None)


def deps(schedule: str, pp: int, n_stages: int, a: Action, rank: int) -> list[tuple[int, Action]]:
    """(rank, action) pairs that must finish before ``a`` on ``rank`` can start."""
    s = stage_of(schedule, pp, rank, a.chunk)
    before, after = neighbours(a, s, n_stages)
    if a.kind == "F":
        if before is None:
            return []
        r, c = rank_chunk_of_stage(schedule, pp, before)
        return [(r, Action("F", c, a.mb))]
    if a.kind == "B":
        out = [(rank, Action("F", a.chunk, a.mb))]
        if after is not None:
            r, c = rank_chunk_of_stage(schedule, pp, after)
            out.append((r, Action("B", c, a.mb)))
        return out
    return [(rank, Action("B", a.chunk, a.mb))]


def _zbv_links(pp: int, rank: int, kind: str, chunk: int) -> tuple[int, tuple | None, tuple | None]:
    """zbv, an F or B on (rank, chunk): its stage, and the (rank, kind, chunk) of the
    stage before and after it that the dependency rules (``deps``) link it to."""
    s = stage_of("zbv", pp, rank, chunk)
    before = rank_chunk_of_stage("zbv", pp, s - 1) if s > 0 else None
    after = rank_chunk_of_stage("zbv", pp, s + 1) if s < 2 * pp - 1 else None
    return s, before, after


@lru_cache(maxsize=64)
def _greedy_zero_bubble(pp: int, m: int) -> tuple[list[list[Action]], tuple[tuple[str, int, int], ...]]:
    """Zero-bubble V order by list scheduling with unit costs: whenever a rank is free it
    runs a ready B (input grad, on the critical path), else a ready F (the deeper chunk
    first; a new micro-batch enters chunk 0 only while fewer than 2·pp chunk-micro-batches
    hold activations), else a pending W (weight grads fill the bubbles).
    Stage 0's backward is whole (no input to differentiate), so it has no W and takes two
    units.

    Event driven: an action's ready time is known once all its dependencies (``deps``)
    are scheduled; each rank keeps the actions that are ready (heaps in pick order) and
    those that will be (a heap by ready time), so a decision costs O(log n). Inside, an
    action is the integer ((rank * 2 + chunk) * 3 + kind) * m + mb, kind 0 F, 1 B, 2 W: the
    planner builds these orders for every (pp, m) it prices, so the loop stays on ints and
    lists; the returned Actions are shared between ranks (they are immutable).

    Returns the per-rank orders and their dependency graph (``_zbv_graph``'s form), in the
    order the actions were scheduled: each one's dependencies were scheduled before it."""
    links = [[_zbv_links(pp, r, "F", c) for c in (0, 1)] for r in range(pp)]
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


# --------------------------------------------------------------------------- simulation


def default_costs(orders: list[list[Action]]) -> dict[str, float]:
    """Unit costs: F=1, B=2, W=0; with W actions present B=W=1 (the backward split)."""
    split_w = any(a.kind == "W" for o in orders for a in o)
    return {"F": 1.0, "B": 1.0, "W": 1.0} if split_w else {"F": 1.0, "B": 2.0, "W": 0.0}


def simulate(schedule: str, orders: list[list[Action]], cost=None, p2p=0.0) -> list[dict]:
    """Replay per-rank orders and return timeline events (``parallel/timeline.py``'s
    format, times in cost units). ``cost``: seconds of one F, B and W on one chunk
    (default ``default_costs``); a backward with no W after it (stage 0 under a split
    backward) costs B + W. ``p2p``: the delay of a dependency that crosses ranks.
    An action starts once its rank is free and its dependencies have finished (plus
    ``p2p`` when they ran elsewhere). Raises if the orders deadlock."""
    pp = len(orders)
    split_w = any(a.kind == "W" for o in orders for a in o)
    cost = cost or default_costs(orders)
    cost_of = cost if callable(cost) else (lambda kind, _stage: cost[kind])
    delay = p2p if callable(p2p) else (lambda _src, _dst: p2p)
    n_stages = n_stages_of(schedule, orders)
    done: dict[tuple[int, Action], float] = {}
    pos, clock, events = [0] * pp, [0.0] * pp, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                ds = deps(schedule, pp, n_stages, a, r)
                if not all(d in done for d in ds):
                    break
                start = max([clock[r]] + [done[d] + (delay(d[0], r) if d[0] != r else 0.0) for d in ds])
                s = stage_of(schedule, pp, r, a.chunk)
                c = cost_of(a.kind, s)
                if a.kind == "B" and split_w and s == 0:
                    c += cost_of("W", s)  # stage 0 runs its whole backward at once
                done[(r, a)] = clock[r] = start + c
                events.append({"stage": r, "chunk": a.chunk, "mb": a.mb, "kind": a.kind, "start": start,
                               "end": start + c})
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise RuntimeError(f"{schedule} schedule deadlocks; waiting actions by rank: {stuck}")
    return events


def makespan(events: list[dict]) -> float:
    return max(e["end"] for e in events) - min(e["start"] for e in events) if events else 0.0


def bubble_fractions(events: list[dict]) -> dict[int, float]:
    """Idle share of the makespan per stage (row): 1 - busy / (last end - first start)."""
    if not events:
        return {}
    t0 = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - t0
    busy: dict[int, float] = {}
    for e in events:
        busy[e["stage"]] = busy.get(e["stage"], 0.0) + (e["end"] - e["start"])
    return {s: (1.0 - b / span if span > 0 else 0.0) for s, b in sorted(busy.items())}


def theoretical_bubble(schedule: str, pp: int, virtual: int, m: int) -> float:
    """Closed forms (share of the step each stage idles): (p-1)/(m+p-1) for GPipe and 1F1B,
    (p-1)/(v·m+p-1) for interleaved (the bubble shrinks by v); zbv: the unit-cost
    simulation of its order (zero once m is large enough)."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved":
        return (pp - 1) / (virtual * m + pp - 1)
    return orders_bubble(schedule, schedule_actions(schedule, pp, virtual, m))


def orders_bubble(schedule: str, orders: list[list[Action]]) -> float:
    """Mean idle share of the stages in the unit-cost simulation of ``orders``."""
    fr = bubble_fractions(simulate(schedule, orders))
    return sum(fr.values()) / len(fr)


# Share of a backward that is the weight-gradient pass (W) where the schedule splits it:
# of a block's backward, the weight gradients are half the matmul FLOPs (Qi et al. 2024).
W_SHARE = 0.5


def chunk_costs(schedule: str, virtual: int, t_f: float, t_b: float) -> dict[str, float]:
    """Per-action costs from one rank's per-micro-batch forward and backward times (all
    its chunks): split evenly over the chunks; zbv splits a backward into B and W."""
    c = chunks_per_rank(schedule, virtual)
    w = W_SHARE if schedule == "zbv" else 0.0
    return {"F": t_f / c, "B": t_b * (1 - w) / c, "W": t_b * w / c}


def pipeline_time(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float) -> tuple[float, float]:
    """(makespan, bubble) of one step with per-micro-batch rank times t_f, t_b (all of a
    rank's chunks). GPipe/1F1B: (m + p - 1)(t_f + t_b) (Huang et al.; Narayanan et al.
    2021); interleaved: (m + (p - 1)/v)(t_f + t_b) (both equal ``simulate`` of their
    orders; tests check it); zbv: ``simulate`` of the V order the executor runs, with
    ``chunk_costs``."""
    busy = m * (t_f + t_b)
    if pp == 1:
        return busy, 0.0
    if schedule == "zbv":
        span = _zbv_makespan(pp, m, t_f, t_b)
        return span, span - busy
    if schedule == "interleaved":
        bubble = (pp - 1) / v * (t_f + t_b)
    else:
        bubble = (pp - 1) * (t_f + t_b)
    return busy + bubble, bubble


def bubble_lower_bound(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float) -> float:
    """A bubble ``pipeline_time`` never goes below, without replaying any order (the
    planner's search bounds layouts with it). The closed forms are exact; zbv's is the
    larger of two paths every V order has, with chunk costs F, B, W and the busy time of
    a rank m (t_f + t_b) = 2m (F + B + W):
    - rank pp - 1 starts once micro-batch 0 went forward through the pp - 1 stages
      before it, then runs all its work one action after another: (pp - 1) F;
    - the micro-batch that enters stage 0 last does so after the other m - 1 (rank 0
      runs them one by one), then goes forward through all 2 pp stages, backward through
      the 2 pp - 1 above stage 0 and through stage 0 whole (B + W):
      (m - 1 + 2 pp) F + 2 pp B + W, which bounds few micro-batches (m < pp) better."""
    if schedule == "zbv" and pp > 1:
        c = chunk_costs("zbv", 1, t_f, t_b)
        f, b, w = c["F"], c["B"], c["W"]
        one_microbatch = (m - 1 + 2 * pp) * f + 2 * pp * b + w - 2 * m * (f + b + w)
        return max((pp - 1) * f, one_microbatch)
    return pipeline_time(schedule, pp, m, v, t_f, t_b)[1]


# The planner replays zbv's order for every (t_f, t_b) it prices; beyond this many
# micro-batches times ranks (pp * m) a replay costs more than a search can spend on one
# layout, so the search leaves zbv out there (``zbv_priced``); one estimate still replays it.
ZBV_MAX_PRICED = 1024


def zbv_priced(pp: int, m: int) -> bool:
    """Whether a search prices zbv at this size (see ``ZBV_MAX_PRICED``)."""
    return pp * m <= ZBV_MAX_PRICED


@lru_cache(maxsize=8192)
def _zbv_makespan(pp: int, m: int, t_f: float, t_b: float) -> float:
    """``makespan(simulate(...))`` of the zbv order, on its precomputed dependency lists."""
    c = chunk_costs("zbv", 1, t_f, t_b)
    cost = (c["F"], c["B"], c["W"], c["B"] + c["W"])
    kinds, firsts, seconds = _zbv_lists(pp, m)
    end = [0.0] * (len(kinds) + 1)  # the last slot stays 0.0: "no dependency"
    for i, (k, a, b) in enumerate(zip(kinds, firsts, seconds)):
        end[i] = max(end[a], end[b]) + cost[k]
    return max(end)


@lru_cache(maxsize=64)
def _zbv_lists(pp: int, m: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``_zbv_graph`` as flat lists for ``_zbv_makespan``'s loop: cost index (F, B, W, b)
    and the two dependencies, -1 (none) mapped to the slot past the last action."""
    graph = _zbv_graph(pp, m)
    n = len(graph)
    index = {"F": 0, "B": 1, "W": 2, "b": 3}
    return (tuple(index[k] for k, _, _ in graph), tuple(a if a >= 0 else n for _, a, _ in graph),
            tuple(b if b >= 0 else n for _, _, b in graph))


def _zbv_graph(pp: int, m: int) -> tuple[tuple[str, int, int], ...]:
    """zbv's actions in an order ``simulate`` could run them, each as (cost kind, index
    of the rank's previous action, index of the other dependency); -1 for none. Cost
    kind "b" is a whole backward (stage 0: B + W). Built with the order
    (``_greedy_zero_bubble``)."""
    return _greedy_zero_bubble(pp, m)[1]


def inflight_microbatches(schedule: str, pp: int, m: int, v: int) -> float:
    """Micro-batches whose activations the fullest pipeline rank holds at once, in units
    of one micro-batch through all that rank's chunks. GPipe: m; 1F1B: min(m, p);
    interleaved: min(m, p(1 + (p-1)/(p v))) (Narayanan et al. 2021); zbv: counted on the
    order the executor runs (``schedule_inflight``)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(float(m), pp * (1 + (pp - 1) / (pp * v)))
    if schedule == "zbv":
        return _zbv_inflight(pp, m)
    return float(min(m, pp))


@lru_cache(maxsize=1024)
def _zbv_inflight(pp: int, m: int) -> float:
    return schedule_inflight("zbv", schedule_actions("zbv", pp, 1, m))


def schedule_inflight(schedule: str, orders: list[list[Action]]) -> float:
    """Most chunk-micro-batches any rank holds activations for (``held_counts``' moments:
    from its F until its last backward action), over the chunks per rank."""
    chunks = max(a.chunk for o in orders for a in o) + 1
    return max(sum(moment) for order in orders for moment in held_counts(order)) / chunks


def held_counts(order: list[Action]) -> tuple[tuple[int, ...], ...]:
    """Per chunk, how many micro-batches' activations a rank running ``order`` holds (each
    from its F until its last backward action: W where the backward is split, else B), at
    each moment the count rises, leaving out moments another matches or exceeds in every
    chunk. The most the rank holds, given each chunk's bytes per micro-batch b, is
    ``max(sum(n_c * b_c))`` over these (``held_peak``): the one definition the dry-run's
    measurement and the planner's prediction share."""
    chunks = max((a.chunk for a in order), default=0) + 1
    split = {(a.chunk, a.mb) for a in order if a.kind == "W"}
    held, moments = [0] * chunks, set()
    for a in order:
        if a.kind == "F":
            held[a.chunk] += 1
            moments.add(tuple(held))
        elif a.kind == "W" or (a.kind == "B" and (a.chunk, a.mb) not in split):
            held[a.chunk] -= 1
    return _undominated(moments)


def _undominated(moments) -> tuple[tuple[int, ...], ...]:
    """The moments no other matches or exceeds in every chunk, fullest first."""
    kept: list[tuple[int, ...]] = []  # (a moment's dominators have larger sums: they come first)
    for x in sorted(moments, key=lambda x: (sum(x), x), reverse=True):
        if not any(all(map(ge, y, x)) for y in kept):
            kept.append(x)
    return tuple(kept)


def _interleaved_held(pp: int, rank: int, v: int, m: int) -> tuple[tuple[int, ...], ...]:
    """``held_counts`` of ``_interleaved``'s order for ``rank``, without building it (the
    planner asks for every rank of every (pp, v, m) it prices). Counts rise only at
    forwards: through the warm-up, then in the steady state, where forward k and backward
    k - warmup visit chunks in patterns that repeat every pp * v: one period of moments is
    all there are. tests/test_schedule.py checks it against ``held_counts`` of the order."""
    total, warmup = m * v, _interleaved_warmup(pp, rank, v, m)
    held, moments = [0] * v, set()
    for k in range(warmup):
        held[_interleaved_chunk("F", k, pp, v)] += 1
    moments.add(tuple(held))
    for i in range(min(total - warmup, pp * v)):
        held[_interleaved_chunk("F", warmup + i, pp, v)] += 1
        moments.add(tuple(held))
        held[_interleaved_chunk("B", i, pp, v)] -= 1
    return _undominated(moments)


@lru_cache(maxsize=4096)
def rank_held_counts(schedule: str, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """``held_counts`` of pp rank ``rank``'s order in ``schedule`` (cached: the planner asks often)."""
    if schedule == "gpipe":  # (the closed forms of the one-chunk and interleaved orders)
        return ((m,),)
    if schedule in ("1f1b", "skippipe"):
        return ((min(m, pp - rank),),)
    if schedule == "interleaved" and virtual > 1:
        return _interleaved_held(pp, rank, virtual, m)
    return held_counts(schedule_actions(schedule, pp, virtual, m)[rank])


def held_peak(counts: tuple[tuple[int, ...], ...], chunk_bytes) -> float:
    """The most bytes held at once: ``counts`` from ``held_counts``, ``chunk_bytes`` each
    chunk's bytes per micro-batch."""
    return max((sum(n * b for n, b in zip(c, chunk_bytes)) for c in counts), default=0.0)


def _interleaved_grad_moments(pp: int, v: int, m: int) -> tuple[tuple[int, ...], ...]:
    """``rank_grad_moments`` of an interleaved order, without building it: every rank runs
    backward k on chunk v - 1 - (k // pp) % v in the order of k (no W actions), so each
    chunk's first and last backward follow from k alone, the same on every rank."""
    first, last = {}, {}
    for k in range(m * v):
        x = _interleaved_chunk("B", k, pp, v)
        first.setdefault(x, k)
        last[x] = k
    return tuple(tuple(2 if x in last and last[x] < i else 1 if first.get(x, i) < i else 0 for x in range(v))
                 for i in sorted(last.values()))


@lru_cache(maxsize=4096)
def rank_grad_moments(schedule: str, pp: int, virtual: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """Per chunk of pp rank ``rank``, the state of its weight gradients just before each
    chunk's last backward action (its last W where the order has W actions, else its last
    B: where a layout that shards gradients reduces that chunk's): 0 none yet, 1
    accumulating unsharded over the micro-batches, 2 reduced (sharded). Weight gradients
    start at a chunk's first W where its backward is split (every stage but the first),
    else at its first B. The dry-run measures held gradients at these moments; the
    planner prices the fullest of them."""
    if schedule == "interleaved" and virtual > 1:
        return _interleaved_grad_moments(pp, virtual, m)
    return grad_moments(schedule, pp, rank, schedule_actions(schedule, pp, virtual, m)[rank])


def grad_moments(schedule: str, pp: int, rank: int, order: list[Action]) -> tuple[tuple[int, ...], ...]:
    """``rank_grad_moments`` of a given order of pp rank ``rank``."""
    has_w = {a.chunk for a in order if a.kind == "W"}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, a in enumerate(order):
        split = a.chunk in has_w and stage_of(schedule, pp, rank, a.chunk) > 0
        if a.kind == ("W" if split else "B"):
            first.setdefault(a.chunk, i)
        if a.kind == ("W" if a.chunk in has_w else "B"):
            last[a.chunk] = i
    chunks = max((a.chunk for a in order), default=0) + 1
    return tuple(tuple(2 if x in last and last[x] < i else 1 if first.get(x, i) < i else 0 for x in range(chunks))
                 for i in sorted(last.values()))
