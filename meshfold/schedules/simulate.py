"""The one event simulator of pipeline orders, and what is read off its events.

``simulate`` replays per-rank orders with given action costs: it is the proof that an
order cannot deadlock (every receive's send comes earlier in simulated time) and it gives
the bubble, the makespan the planner prices and the activations in flight. Its events are
the timeline's format (``parallel/pp/timeline_plot.py``)."""

from __future__ import annotations

from meshfold.schedules.base import Action, Orders, Schedule


def default_costs(orders: Orders) -> dict[str, float]:
    """Unit costs: F=1, B=2, W=0; with W actions present B=W=1 (the backward split)."""
    split_w = any(a.kind == "W" for o in orders for a in o)
    return {"F": 1.0, "B": 1.0, "W": 1.0} if split_w else {"F": 1.0, "B": 2.0, "W": 0.0}


def simulate(schedule: Schedule, orders: Orders, cost=None, p2p=0.0) -> list[dict]:
    """Replay per-rank orders and return timeline events (times in cost units). ``cost``:
    seconds of one F, B and W on one chunk (default ``default_costs``), or a function
    (kind, stage) -> seconds; a backward with no W after it (stage 0 under a split
    backward) costs B + W. ``p2p``: the delay of a dependency that crosses ranks (or a
    function (src, dst) -> delay). An action starts once its rank is free and its
    dependencies have finished (plus ``p2p`` when they ran elsewhere). Raises if the
    orders deadlock."""
    pp = len(orders)
    split_w = any(a.kind == "W" for o in orders for a in o)
    cost = cost or default_costs(orders)
    cost_of = cost if callable(cost) else (lambda kind, _stage: cost[kind])
    delay = p2p if callable(p2p) else (lambda _src, _dst: p2p)
    n_stages = schedule.n_stages(orders)
    done: dict[tuple[int, Action], float] = {}
    pos, clock, events = [0] * pp, [0.0] * pp, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                ds = schedule.deps(pp, n_stages, a, r)
                if not all(d in done for d in ds):
                    break
                start = max([clock[r]] + [done[d] + (delay(d[0], r) if d[0] != r else 0.0) for d in ds])
                s = schedule.stage_of(pp, r, a.chunk)
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
            raise RuntimeError(f"{schedule.name} schedule deadlocks; waiting actions by rank: {stuck}")
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


def orders_bubble(schedule: Schedule, orders: Orders) -> float:
    """Mean idle share of the stages in the unit-cost simulation of ``orders``."""
    fr = bubble_fractions(simulate(schedule, orders))
    return sum(fr.values()) / len(fr)
