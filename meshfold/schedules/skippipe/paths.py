"""SkipPipe (partial and reordered pipelining, Apostolov et al. 2025), pure: per-micro-batch
paths over the pipeline stages and the per-rank orders that run them.

A path starts at stage 0 (embedding) and ends at stage S-1 (output and loss); in between
it visits the middle stages, possibly not all of them (a skipped stage neither runs nor
accumulates gradient for that micro-batch) and, with ``reorder``, not in ascending order.
Caps (``parallel.pp_skip`` = f): a micro-batch skips at most floor(f·S) stages, and a
stage is skipped by at most floor(f·m) of the step's m micro-batches, so every stage
still trains on at least (1-f) of them. f = 0 without reorder is 1F1B, exactly.

``plan`` picks the paths that minimise the step's makespan for given stage times and
per-link message times (the cluster description: slow links carry less traffic), by
coordinate descent over each micro-batch's candidate paths, every candidate priced by
``schedules.simulate`` of the orders ``path_orders`` builds for it. The orders are a
1F1B-like list schedule (backward first, a forward only within 1F1B's activation budget
of pp - r micro-batches), so memory stays 1F1B's. Each ``Action`` carries its route (the
stages before and after it on its path), which the dependency rules, the point-to-point
plan (``parallel/pp/p2p_plan.py``) and the executor follow.

Standard library only: the planner prices the same paths without torch.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

from meshfold.schedules.base import Action
from meshfold.schedules.registry import get_schedule
from meshfold.schedules.simulate import makespan, simulate

NAME = "skippipe"
# Beyond this many stage-micro-batches (pp * m) a simulated step per candidate costs more
# than planning may (the list schedule is quadratic in them): ``plan`` then scores a
# candidate by its own path cost alone, one pass.
SIMULATED_MAX = 256


def limits(n_stages: int, m: int, skip: float) -> tuple[int, int]:
    """(stages one micro-batch may skip, micro-batches that may skip one stage)."""
    per_mb = min(max(0, n_stages - 2), int(skip * n_stages + 1e-9))
    return per_mb, int(skip * m + 1e-9)


def _path_cost(path: tuple[int, ...], cost, link) -> float:
    """One micro-batch alone on its path: its compute plus every hop there and back."""
    hops = sum(link(a, b) + link(b, a) for a, b in zip(path, path[1:]))
    return sum(cost("F", s) + cost("B", s) for s in path) + hops


def _best_order(middle: tuple[int, ...], last: int, reorder: bool, cost, link) -> tuple[int, ...]:
    """The cheapest visiting order of ``middle`` between stage 0 and ``last`` (ascending
    unless ``reorder``; exhaustive up to 6 middle stages, nearest neighbour beyond)."""
    if not reorder or len(middle) < 2:
        return (0, *middle, last)
    if len(middle) <= 6:
        return min(((0, *p, last) for p in itertools.permutations(middle)),
                   key=lambda p: (_path_cost(p, cost, link), p))
    out, left = [0], set(middle)
    while left:
        nxt = min(left, key=lambda s: (link(out[-1], s) + link(s, out[-1]), s))
        out.append(nxt)
        left.remove(nxt)
    return (*out, last)


def candidates(n_stages: int, per_mb: int, allowed: set[int], reorder: bool, cost, link) -> list[tuple[int, ...]]:
    """Candidate paths of one micro-batch: skip-sets of up to ``per_mb`` stages among
    ``allowed`` (all of them for up to 8 middle stages, else single skips and a greedy
    cheapest-first set), each in its best order."""
    middle = tuple(range(1, n_stages - 1))
    last = n_stages - 1
    drops: list[tuple[int, ...]] = [()]
    pool = sorted(allowed)
    if len(middle) <= 8:
        for k in range(1, per_mb + 1):
            drops += list(itertools.combinations(pool, k))
    else:
        drops += [(s,) for s in pool] if per_mb else []
        chosen: list[int] = []
        for _ in range(per_mb):
            rest = [s for s in pool if s not in chosen]
            if not rest:
                break
            keep = lambda d: tuple(s for s in middle if s not in d)  # noqa: E731
            chosen.append(min(rest, key=lambda s: (_path_cost((0, *keep(chosen + [s]), last), cost, link), s)))
            drops.append(tuple(chosen))
    out = []
    for d in drops:
        path = _best_order(tuple(s for s in middle if s not in d), last, reorder, cost, link)
        if path not in out:
            out.append(path)
    return out


def path_orders(pp: int, paths: tuple[tuple[int, ...], ...], cost, link) -> list[list[Action]]:
    """Per-rank orders that run ``paths`` (stage = rank): list scheduling with the given
    costs, a ready backward first (lowest micro-batch), else a ready forward within 1F1B's
    activation budget of pp - r micro-batches (relaxed only if every rank would wait
    forever). Full, ascending paths give 1F1B's orders themselves."""
    full = tuple(range(pp))
    if all(p == full for p in paths):
        return get_schedule("1f1b").actions(pp, 1, len(paths))  # (the same, shared lists)
    route: dict[tuple[int, int], tuple[int, int]] = {}
    for i, path in enumerate(paths):
        for k, s in enumerate(path):
            route[(s, i)] = (path[k - 1] if k else -1, path[k + 1] if k + 1 < len(path) else -1)
    end: dict[tuple[str, int, int], float] = {}
    todo_f = [sorted(i for (s, i) in route if s == r) for r in range(pp)]
    todo_b = [list(f) for f in todo_f]
    free, held = [0.0] * pp, [0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]

    def ready(kind: str, s: int, i: int) -> float | None:
        before, after = route[(s, i)]
        if kind == "F":
            if before < 0:
                return 0.0
            e = end.get(("F", before, i))
            return None if e is None else e + link(before, s)
        e = end.get(("F", s, i))
        if e is None or after < 0:
            return e
        eb = end.get(("B", after, i))
        return None if eb is None else max(e, eb + link(after, s))

    relax = False
    while any(todo_f) or any(todo_b):
        best = None  # (start, rank, kind, mb)
        for r in range(pp):
            opts = [(t, 0, i) for i in todo_b[r] if (t := ready("B", r, i)) is not None]
            if held[r] < pp - r or relax:
                opts += [(t, 1, i) for i in todo_f[r] if (t := ready("F", r, i)) is not None]
            if not opts:
                continue
            now = [o for o in opts if o[0] <= free[r]]
            t, k, i = min(now, key=lambda o: (o[1], o[2])) if now else min(opts)
            pick = (max(t, free[r]), r, "BF"[k], i)
            if best is None or pick[:2] < best[:2]:
                best = pick
        if best is None:
            if relax:
                raise RuntimeError(f"skippipe: paths {paths} cannot be scheduled")
            relax = True
            continue
        relax = False
        start, r, kind, i = best
        done = start + cost(kind, r)
        end[(kind, r, i)] = free[r] = done
        (todo_f if kind == "F" else todo_b)[r].remove(i)
        held[r] += 1 if kind == "F" else -1
        orders[r].append(Action(kind, 0, i, route[(r, i)]))
    return orders


def step_time(pp: int, paths, cost, link) -> float:
    """Simulated makespan of one step running ``paths`` (``schedules.simulate``)."""
    return makespan(simulate(get_schedule(NAME), path_orders(pp, paths, cost, link), cost, link))


def plan(pp: int, m: int, skip: float, reorder: bool, cost, link, passes: int = 3,
         feasible=None) -> tuple[tuple[int, ...], ...]:
    """Paths of the step's ``m`` micro-batches minimising the simulated makespan under the
    caps (``limits``); ties go to the cheaper paths (``_path_cost``), then to the earlier
    candidate (fewer skips). ``cost(kind, stage)``: seconds of a forward/backward of one
    micro-batch on a stage; ``link(a, b)``: seconds of one message from rank a to rank b.
    ``feasible(orders)``: whether the point-to-point plan of an order exists under NCCL's
    rules (``parallel/pp/p2p_plan.py``'s replay); a better candidate is taken only if so (the
    full paths, 1F1B, always are)."""
    full = tuple(range(pp))
    per_mb, per_stage = limits(pp, m, skip)
    paths = [full] * m
    if (per_mb == 0 or per_stage == 0) and not reorder:
        return tuple(paths)
    if per_stage == 0:
        per_mb = 0
    skipped = {s: 0 for s in range(1, pp - 1)}

    simulated = pp * m <= SIMULATED_MAX

    def score(ps):
        paths_cost = sum(_path_cost(p, cost, link) for p in ps)
        return (step_time(pp, tuple(ps), cost, link) if simulated else 0.0), paths_cost

    cache: dict[frozenset, list] = {}
    current = score(paths)
    for _ in range(passes if simulated else 1):
        changed = False
        for i in range(m):
            mine = set(full) - set(paths[i])
            for s in mine:
                skipped[s] -= 1
            allowed = frozenset(s for s, n in skipped.items() if n < per_stage) | frozenset(mine)
            if allowed not in cache:
                cache[allowed] = candidates(pp, per_mb, set(allowed), reorder, cost, link)
            better = []
            for k, cand in enumerate(cache[allowed]):
                if cand == paths[i]:
                    continue
                sc = score(paths[:i] + [cand] + paths[i + 1:])
                if sc < current:
                    better.append((sc, k, cand))
            for sc, _, cand in sorted(better):
                trial = paths[:i] + [cand] + paths[i + 1:]
                if feasible is None or feasible(path_orders(pp, tuple(trial), cost, link)):
                    paths[i], current, changed = cand, sc, True
                    break
            for s in set(full) - set(paths[i]):
                skipped[s] += 1
        if not changed:
            break
    return tuple(paths)


@lru_cache(maxsize=64)
def plan_orders(pp: int, m: int, skip: float, reorder: bool, stage_s: tuple[tuple[float, float], ...],
                link_s: tuple[tuple[float, ...], ...],
                feasible=None) -> tuple[tuple[tuple[int, ...], ...], list[list[Action]]]:
    """``plan`` and its orders from plain tables: ``stage_s[s]`` = (forward, backward)
    seconds of one micro-batch on stage s, ``link_s[a][b]`` = seconds of one message from
    rank a to rank b. Cached: every rank (and the planner) asks with the same tables."""
    cost = _table_cost(stage_s)
    link = _table_link(link_s)
    paths = plan(pp, m, skip, reorder, cost, link, feasible=feasible)
    return paths, path_orders(pp, paths, cost, link)


def _table_cost(stage_s):
    return lambda kind, s: stage_s[s][0 if kind == "F" else 1] if kind != "W" else 0.0


def _table_link(link_s):
    return lambda a, b: link_s[a][b]


def link_table(pp: int, default_s: float, slow: dict[tuple[int, int], float]) -> tuple[tuple[float, ...], ...]:
    """Seconds per message between pp ranks: ``default_s`` everywhere, ``slow[(a, b)]``
    (either direction) where given."""
    return tuple(tuple(0.0 if a == b else slow.get((a, b), slow.get((b, a), default_s)) for b in range(pp))
                 for a in range(pp))


def table_step_time(pp: int, paths, stage_s, link_s) -> float:
    """``step_time`` from the tables of ``plan_orders``."""
    return step_time(pp, paths, _table_cost(stage_s), _table_link(link_s))
