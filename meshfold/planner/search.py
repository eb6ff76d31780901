"""``meshfold plan``: every valid layout for a model and batch, pruned by memory, ranked by
predicted step time, exact within the cost model.

Exactness with speed comes from branch and bound, not from heuristics:

1. enumerate the *structures* (pp, dp_replicate, dp_shard, cp, tp, sp, cp_mode, ep,
   micro-batch) that tile the devices and the batch;
2. give each a lower bound (``CostModel.lower_bound``: its compute and tensor/context
   communication, the least bubble of its schedules, the least optimizer and data-parallel
   time) and visit them in increasing bound order; structures sharing their layer terms
   wait in the queue under their shared compute (``CostModel.compute_floor``) until it comes
   up, so most never get a bound of their own;
3. expand a structure into its variants (zero stage, pipeline schedule and virtual
   stages, recompute) only while its bound is below the K-th best fitting step time
   found so far; once a bound reaches it, every later structure is worse and the search stops.

Recompute is a dominance choice: for otherwise equal layouts, none <= selective <= full in
time and the reverse in memory, so only the least recompute that fits can rank (the
table lists each layout once, with that recompute). ``brute_force`` evaluates everything
and is what the tests compare against.
"""

from __future__ import annotations

import heapq
import time as _time
from dataclasses import dataclass, field

from meshfold.config import Config, TrainConfig
from meshfold.errors import divisors as _divisors
from meshfold.parallel.facts.expert_tp import foldings
from meshfold.planner.attention import attention_terms
from meshfold.planner.cluster import GiB, Cluster
from meshfold.planner.bounds import EP_CHUNKS
from meshfold.planner.cost import CostModel, Estimate, Layout, Workload
from meshfold.planner.choices import open_choice, search_each
from meshfold.planner.workload import DEFAULT_SCHEDULE
from meshfold.schedules import all_schedules, get_schedule

RECOMPUTE = ("none", "selective", "full")


def structures(w: Workload, world: int, max_tp: int = 0):
    """(pp, dp_replicate, dp_shard, cp, tp, sp, cp_mode, ep, micro_batch) tuples that are
    valid for the model (config.validate's rules) and tile ``world`` devices and the batch."""
    m, s, G = w.model, w.s, w.global_batch
    kv = m.kv_heads
    for tp in _divisors(world):
        if m.n_heads % tp or (kv % tp and tp % kv) or (max_tp and tp > max_tp):
            continue
        rest_tp = world // tp
        for cp in _divisors(rest_tp):
            modes = []
            if cp == 1:
                modes = ["ring"]
            else:
                if s % (2 * cp) == 0:
                    modes.append("ring")
                if s % cp == 0 and m.n_heads % (cp * tp) == 0:
                    modes.append("ulysses")
            if cp > 1 and m.moe_capacity_factor > 0:  # capacity is per whole sequence
                modes = []
            if cp > 1 and tp > 1 and not attention_terms(m).tp_with_cp:  # (parallel/config.py)
                modes = []
            if not modes:
                continue
            rest_cp = rest_tp // cp
            for pp in _divisors(rest_cp):
                if pp > m.n_layers:
                    continue
                dp = rest_cp // pp
                if G % dp:
                    continue
                local = G // dp
                eps = [1]
                if m.moe_experts:
                    eps = [e for e in _divisors(m.moe_experts) if (dp * cp) % e == 0]
                sps = [False] + ([True] if tp > 1 and s % tp == 0 else [])
                for dpr in _divisors(dp):
                    dps = dp // dpr
                    # (as parallel/config.py validates: with tp, ep x tp divides the experts, or
                    # each expert is split over tp: parallel.expert_tp, ``foldings``)
                    eps_here = [e for e in eps if (dps * cp) % e == 0 and foldings(m, tp, e)]
                    for b in _divisors(local):
                        for sp in sps:
                            for mode in modes:
                                for ep in eps_here:
                                    yield (pp, dpr, dps, cp, tp, sp, mode, ep, b)


def schedules(w: Workload, pp: int, n_micro: int, gpipe: bool = True) -> list[tuple[str, int]]:
    """(schedule, virtual stages) choices: the default schedule first, then the registered
    ones in order, each with the virtual stages it is searched with
    (``Schedule.search_virtuals``). A dominated schedule (GPipe: 1F1B's time with more
    memory) the search (``gpipe=False``) never needs; brute force keeps it."""
    if pp == 1:
        return [(DEFAULT_SCHEDULE, 1)]
    first = get_schedule(DEFAULT_SCHEDULE)
    out = []
    for sched in (first, *(s for s in all_schedules() if s is not first)):
        if gpipe or not sched.dominated:
            out += [(sched.name, v) for v in sched.search_virtuals(pp, n_micro, w.model.n_layers)]
    return out


def variants(w: Workload, st: tuple, gpipe: bool = True):
    """Every (zero, schedule, virtual stages, expert exchange chunks) for one structure, as
    Layouts with recompute left to the caller."""
    for spec in variant_specs(w, st, gpipe):
        yield _layout(st, *spec)


def variant_specs(w: Workload, st: tuple, gpipe: bool = True):
    """``variants``' (zero, schedule, virtual stages, ep_overlap_chunks, expert_tp), in its
    order, without the Layouts. With ep > 1 the expert all-to-all whole or pipelined behind
    the experts in 2 or 4 chunks (``parallel.ep_overlap_chunks``); with tp > 1 and experts
    the two foldings that are valid (whole experts over ep x tp, or each split over tp)."""
    pp, dpr, dps, cp, tp, sp, mode, ep, b = st
    n_micro = w.global_batch // (dpr * dps) // b
    # (ep > 1: zero >= 2 shards the experts with FSDP over edp; zero 0/1 reduce them over edp,
    # ZeRO-1 shards their Adam state there: parallel/ep/plan.py)
    scheds = schedules(w, pp, n_micro, gpipe)
    chunks = EP_CHUNKS if ep > 1 else (1,)
    folds = foldings(w.model, tp, ep)
    for zero in zero_stages(st):
        for sched, v in scheds:
            for n in chunks:
                for etp in folds:
                    yield zero, sched, v, n, etp


def zero_stages(st: tuple) -> tuple[int, ...]:
    """The zero stages a structure's variants take: with nothing to shard over (dp_shard x
    cp = 1) only 0; with cp alone 0-3; with dp_shard 1-3 (ZeRO-0 is DDP with dp_replicate)."""
    dps, cp = st[2], st[3]
    return (1, 2, 3) if dps > 1 else ((0, 1, 2, 3) if cp > 1 else (0,))


def _layout(st: tuple, zero: int, sched: str, v: int, chunks: int = 1, expert_tp: int = 1) -> Layout:
    pp, dpr, dps, cp, tp, sp, mode, ep, b = st
    return Layout(dp_replicate=dpr, dp_shard=dps, zero=zero, tp=tp, sp=sp, pp=pp, pp_schedule=sched,
                  pp_virtual_stages=v, cp=cp, cp_mode=mode, ep=ep, micro_batch=b, ep_overlap_chunks=chunks,
                  expert_tp=expert_tp)


def runtime_config(w: Workload, L: Layout):
    """The ``Config`` that runs layout ``L`` (what ``plan --out`` writes)."""

    t = TrainConfig(global_batch=w.global_batch, micro_batch=L.micro_batch if L.pp == 1 else 0,
                    recompute=L.recompute)
    return Config(model=w.model, parallel=L.parallel_config(w.global_batch), train=t)


def recomputes(schedule: str) -> tuple[str, ...]:
    """The recompute choices a schedule runs with (``config.validate_train_layout``: a
    backward split into B and W passes, zbv's, would recompute every block again under full)."""
    return RECOMPUTE[:2] if get_schedule(schedule).splits_backward else RECOMPUTE


def _with_recompute(L: Layout, r: str) -> Layout:
    return Layout(**{**L.__dict__, "recompute": r})


@dataclass
class PlanResult:
    ranked: list[Estimate]  # best first; fitting layouts (or, if none fits, the fastest)
    evaluated: int
    structures: int
    visited: int
    seconds: float
    any_fits: bool
    notes: list[str] = field(default_factory=list)


def search(w: Workload, cluster: Cluster, top: int = 10, max_tp: int = 0) -> PlanResult:
    if open_choice(w):  # a key set to "auto": every value searched, one ranking (planner/choices.py)
        return search_each(search, w, cluster, top=top, max_tp=max_tp)
    start = _time.perf_counter()
    cm = CostModel(w, cluster)
    world = cluster.world_size
    free = cm.bubble_free(world)  # (shared host cores: no bubble to bound)
    sts = list(structures(w, world, max_tp))
    scheds: dict[tuple[int, int], tuple] = {}

    def terms(st: tuple) -> tuple:
        """(micro-batches, t_f, t_b, rest, schedules) of ``CostModel.lower_bound``."""
        pp, dpr, dps, cp, tp, sp, mode, ep, b = st
        n_micro, t_f, t_b, rest = cm.bound_terms(pp, dps, dpr * dps, cp, tp, sp, mode, ep, b)
        sc = scheds.get((pp, n_micro))
        if sc is None:
            sc = scheds[(pp, n_micro)] = tuple(schedules(w, pp, n_micro, False))
        return n_micro, t_f, t_b, rest, sc

    def bubble(sched: str, v: int, pp: int, n_micro: int, t_f: float, t_b: float) -> float:
        return 0.0 if pp == 1 or free else get_schedule(sched).bubble_lower_bound(pp, n_micro, v, t_f, t_b)

    # Structures sharing layer terms (tp, sp, cp, cp_mode, ep, micro-batch) share their
    # compute whatever their pp and dp split (``CostModel.compute_floor``): a group's floor
    # enters the queue first and its structures' own bounds are computed only once it is
    # reached (most groups never are). Queue entries (bound, 0, group) and (bound, 1,
    # structure): structures leave in (bound, enumeration) order, as a sort of all of them.
    groups: dict[tuple, list[int]] = {}
    for i, st in enumerate(sts):
        groups.setdefault(st[4:6] + (st[3], st[6], st[7], st[8]), []).append(i)
    members = list(groups.values())
    queue = [(cm.compute_floor(*key, world), 0, g) for g, key in enumerate(groups)]
    heapq.heapify(queue)
    st_terms: dict[int, tuple] = {}
    smallest: dict = {}  # (pp, n_micro, t_f, t_b) -> smallest bubble: dp splits share it

    def bound(i: int) -> float:
        """``lower_bound`` of structure ``i``, without building its Layouts."""
        tt = st_terms[i] = terms(sts[i])
        n_micro, t_f, t_b, rest, sc = tt
        pp = sts[i][0]
        bub = smallest.get((pp, n_micro, t_f, t_b))
        if bub is None:
            bub = smallest[(pp, n_micro, t_f, t_b)] = min(bubble(s, v, pp, n_micro, t_f, t_b) for s, v in sc)
        return cm.bound_of(n_micro, t_f, t_b, bub, rest)

    capacity = cluster.device.memory_gib * GiB
    # Heaps of the K best as (-time, -structure, -variant, -recompute, layout): the root is
    # the worst kept. Ties in time go to the layout enumerated first, so the result does
    # not depend on the order structures are visited in (nor on how tight the bounds are).
    best: list[tuple] = []  # fitting layouts
    fallback: list[tuple] = []  # fastest overall, when nothing fits
    evaluated = visited = 0

    def keep(heap: list, item: tuple) -> None:
        if len(heap) < top:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)

    while queue:
        lowest, is_structure, i = heapq.heappop(queue)
        if len(best) >= top and lowest >= -best[0][0]:
            break
        if not is_structure:
            for j in members[i]:
                heapq.heappush(queue, (bound(j), 1, j))
            continue
        st = sts[i]
        pp = st[0]
        n_micro, t_f, t_b, rest, _ = st_terms[i]
        specs = list(variant_specs(w, st, gpipe=False))
        visited += 1
        if best and cm.states_floor(_layout(st, 0, DEFAULT_SCHEDULE, 1), zero_stages(st)) > capacity:
            continue  # no zero stage fits its model states: no variant fits
        sched_bound: dict = {}  # this schedule's own bubble: a bound for its variants
        for j, (zero, sched, v, chunks, etp) in enumerate(specs):
            if len(best) >= top:
                vb = sched_bound.get((sched, v))
                if vb is None:
                    vb = sched_bound[(sched, v)] = cm.bound_of(n_micro, t_f, t_b,
                                                               bubble(sched, v, pp, n_micro, t_f, t_b), rest)
                if vb >= -best[0][0]:
                    continue
            L = _layout(st, zero, sched, v, chunks, etp)
            floor, grads = cm.memory_floor(L, with_grads=True) if best else (0.0, 0.0)
            if floor > capacity:
                continue  # its model states alone do not fit, whatever the recompute
            # without recompute it may be known not to fit (a sibling's activations); else its
            # exact stages, zero stage and traffic bound every recompute (cheaper than a memory
            # check); a recompute that may fit is bounded on its own below
            acts_none = cm.activations_if_known(L) if best else None
            none_fails = acts_none is not None and floor - grads + acts_none > capacity
            if not none_fails and len(best) >= top and cm.step_bound(L) >= -best[0][0]:
                continue
            for k, r in enumerate(recomputes(sched)):
                Lr = L if k == 0 else _with_recompute(L, r)
                if best:
                    acts = acts_none if k == 0 else cm.activations_if_known(Lr)  # (a floor, without gradients)
                    if acts is not None and floor - grads + acts > capacity:
                        continue  # does not fit (known without pricing it)
                    if k > 0 and len(best) >= top and cm.step_bound(Lr) >= -best[0][0]:
                        break  # neither this recompute nor a larger one can rank (k = 0: bounded above)
                    if cm.peak_memory(Lr) > capacity:
                        continue  # does not fit: priced only if nothing fits (the fallback's)
                    t, fits = cm.step_time(Lr), True
                else:
                    e = cm.estimate(Lr, detail=False)
                    t, fits = e.step_time_s, e.fits
                evaluated += 1
                item = (-t, -i, -j, -k, Lr)
                if fits:
                    keep(best, item)
                    break  # more recompute: slower and never needed (dominated)
                if not best:
                    keep(fallback, item)
    chosen = best or fallback
    # the few ranked layouts again, in full and with their per-dimension collectives
    ranked = [cm.estimate(x[-1]) for x in sorted(chosen, reverse=True)]
    notes = [] if best else ["no layout fits in device memory; showing the fastest that do not"]
    return PlanResult(ranked, evaluated, len(sts), visited, _time.perf_counter() - start, bool(best), notes)


def brute_force(w: Workload, cluster: Cluster) -> list[Estimate]:
    """Every layout with every recompute choice, unpruned (for tests on small cases)."""
    cm = CostModel(w, cluster)
    out = []
    for st in structures(w, cluster.world_size):
        for L in variants(w, st):
            for r in recomputes(L.pp_schedule):  # (pp = 1: the default schedule, ``schedules``)
                out.append(cm.estimate(_with_recompute(L, r)))
    return out


def explain(winner: Estimate, runner: Estimate | None) -> list[str]:
    """Why the winner wins: the components where it differs most from the runner-up."""
    if runner is None:
        return [f"only one layout fits: {winner.layout.short()}"]
    lines = [f"winner {winner.layout.short()} {winner.step_time_s:.4g}s vs runner-up "
             f"{runner.layout.short()} {runner.step_time_s:.4g}s "
             f"({100 * (runner.step_time_s / winner.step_time_s - 1):.1f}% slower)"]
    diffs = sorted(((runner.time[k] - winner.time.get(k, 0.0), k) for k in runner.time
                    if not k.startswith("stage_")), reverse=True)
    for d, k in diffs:
        if abs(d) > 1e-9 * max(1.0, winner.step_time_s):
            lines.append(f"  {k:18s} winner {winner.time.get(k, 0):.4g}s  runner-up {runner.time[k]:.4g}s  "
                         f"({'+' if d > 0 else ''}{d:.3g}s)")
    lines.append(f"  {'peak memory':18s} winner {winner.peak_mem_bytes / 2**30:.2f} GiB  runner-up "
                 f"{runner.peak_mem_bytes / 2**30:.2f} GiB")
    return lines
