"""The planner search's shortcuts against the straightforward pricing: the fast paths it
prices with (``step_time``, ``peak_memory``) give exactly ``estimate``'s numbers, and what
it prunes with (``lower_bound``, ``step_bound``, ``memory_floor``, ``bubble_lower_bound``,
``activations_if_known`` with the floor's states but gradients) never exceeds them (``states_floor`` under ``memory_floor`` too), on seeded samples of layouts; and the ranked list, ties included, is
brute force's. Its speed is tracked by benchmarks/planner_search.py, not here."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from meshfold.config import ModelConfig
from meshfold.errors import divisors
from meshfold.models.presets import preset
from meshfold.models.stage_balance import balanced_split, block_cost, embedding_cost, output_cost
from meshfold.planner.cluster import cluster_from_dict, load_cluster
from meshfold.planner.cost import CostModel, Layout, Workload
from meshfold.planner.search import RECOMPUTE, _with_recompute, schedules, search, structures, variants
from meshfold.schedules import get_schedule


def _cases():
    dense = ModelConfig(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, vocab_size=32000, seq_len=2048)
    moe = ModelConfig(dim=512, n_layers=4, n_heads=8, vocab_size=8192, seq_len=1024, moe_experts=8, moe_topk=2)
    tiny = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=64)
    return {
        "405b-16384": (Workload(preset("llama3-405b"), global_batch=2048), load_cluster("h100", devices=16384), 40),
        "dense-a100-16": (Workload(dense, 32), load_cluster("a100", devices=16), 60),
        "moe-h100-8": (Workload(moe, 16), load_cluster("h100", devices=8), 60),
        "cpu-shared": (Workload(tiny, 16, dtype="float32", flash=False),
                       cluster_from_dict({"preset": "cpu-gloo", "host_cores": 2}), 60),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_fast_pricing_and_bounds_against_estimate(case):
    w, cluster, n = _cases()[case]
    sts = list(structures(w, cluster.world_size))
    rng = random.Random(27)
    picked = rng.sample(sts, min(n, len(sts)))
    fast = CostModel(w, cluster)  # warm caches across layouts, as the search uses it
    # the reference: a fresh model per layout (nothing cached); at 405B one model for the
    # sample (its stage splits take a while), with only ``estimate`` called on it
    shared = CostModel(w, cluster) if case.startswith("405b") else None
    for st in picked:
        pp, dpr, dps, cp, tp, sp, mode, ep, b = st
        probe = Layout(dp_replicate=dpr, dp_shard=dps, tp=tp, sp=sp, pp=pp, cp=cp, cp_mode=mode, ep=ep, micro_batch=b)
        n_micro = w.global_batch // (dpr * dps) // b
        bound = fast.lower_bound(probe, tuple(schedules(w, pp, n_micro, False)))
        zeros = {L.zero for L in variants(w, st, gpipe=False)}
        states_floor = fast.states_floor(probe, zeros)
        if not shared:
            assert states_floor == CostModel(w, cluster).states_floor(probe, zeros)
        for L in variants(w, st, gpipe=False):
            step_bound, floor = fast.step_bound(L), fast.memory_floor(L)
            assert states_floor <= floor, L.short()
            if not shared:  # (the floor is cached across layouts that share their model states)
                assert floor == CostModel(w, cluster).memory_floor(L), L.short()
            for r in RECOMPUTE:
                Lr = _with_recompute(L, r)
                ref = (shared or CostModel(w, cluster)).estimate(Lr, detail=False)
                assert fast.step_time(Lr) == ref.step_time_s, Lr.short()
                known = fast.activations_if_known(Lr)  # (from a variant with another zero stage)
                assert fast.peak_memory(Lr) == ref.peak_mem_bytes, Lr.short()
                acts = fast.activations_if_known(Lr)
                assert known is None or known == acts, Lr.short()
                with_grads, grads = fast.memory_floor(Lr, with_grads=True)
                assert with_grads - grads + acts <= ref.peak_mem_bytes, Lr.short()
                assert fast.estimate(Lr).step_time_s == ref.step_time_s
                assert bound <= ref.step_time_s and step_bound <= ref.step_time_s, Lr.short()
                assert floor <= ref.peak_mem_bytes, Lr.short()


def test_zbv_bubble_lower_bound_never_above_the_replay():
    rng = random.Random(5)
    for pp in (2, 3, 4, 8):
        for m in (1, 2, 3, 4, 8, 16):
            if not get_schedule("zbv").priced(pp, m):
                continue
            for _ in range(4):
                t_f, t_b = rng.uniform(0.1, 3.0), rng.uniform(0.1, 6.0)
                exact = get_schedule("zbv").pipeline_time(pp, m, 1, t_f, t_b)[1]
                bound = get_schedule("zbv").bubble_lower_bound(pp, m, 1, t_f, t_b)
                assert bound <= exact * (1 + 1e-12)
                if m == 1:  # one micro-batch: its own path is the step (the bound is exact)
                    assert bound == pytest.approx(exact, rel=1e-12)
    for sched, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):  # closed forms: the same number
        obj = get_schedule(sched)
        assert obj.bubble_lower_bound(4, 8, v, 1.0, 2.0) == obj.pipeline_time(4, 8, v, 1.0, 2.0)[1]


def _ranked_by_brute_force(w, cluster, top):
    """Brute force's K best, ties in enumeration order (structure, variant): the search's rule."""
    cm = CostModel(w, cluster)
    rows = []
    for i, st in enumerate(structures(w, cluster.world_size)):
        for j, L in enumerate(variants(w, st, gpipe=False)):
            for r in RECOMPUTE:
                e = cm.estimate(_with_recompute(L, r), detail=False)
                if e.fits:
                    rows.append((e.step_time_s, i, j, e.layout))
                    break
    return [(t, L) for t, _, _, L in sorted(rows, key=lambda x: x[:3])[:top]]


@pytest.mark.parametrize("case", ["dense-a100-16", "moe-h100-8", "cpu-shared"])
def test_search_ranks_as_brute_force_ties_included(case):
    w, cluster, _ = _cases()[case]
    want = _ranked_by_brute_force(w, cluster, 8)
    res = search(w, cluster, top=8)
    assert [(e.step_time_s, e.layout) for e in res.ranked] == want


def test_balanced_split_is_the_exhaustive_minimum():
    """The pruned dynamic programme picks what trying every split picks: min of (most
    expensive stage, sum of squares, split), the sums folded as the programme folds them."""
    for cfg in (ModelConfig(dim=256, n_layers=8, n_heads=4, vocab_size=4096, seq_len=128),
                ModelConfig(dim=256, n_layers=9, n_heads=4, vocab_size=64, seq_len=128)):
        L, blocks = cfg.n_layers, [block_cost(cfg, i) for i in range(cfg.n_layers)]
        prefix = [0.0]
        for b in blocks:
            prefix.append(prefix[-1] + b)
        for n in range(1, L + 1):
            options = []
            for cuts in combinations(range(1, L), n - 1):
                edges = (0,) + cuts + (L,)
                costs = [prefix[edges[k + 1]] - prefix[edges[k]] + (embedding_cost(cfg) if k == 0 else 0.0)
                         + (output_cost(cfg) if k == n - 1 else 0.0) for k in range(n)]
                top, sq = costs[-1], costs[-1] * costs[-1]
                for c in reversed(costs[:-1]):
                    top, sq = max(c, top), c * c + sq
                options.append((top, sq, tuple(edges[k + 1] - edges[k] for k in range(n))))
            assert tuple(balanced_split(cfg, n)) == min(options)[2], (L, n)


def test_divisors_are_every_divisor_ascending():
    """``errors.divisors`` pairs up to sqrt(n) (the search enumerates with it)."""
    for n in list(range(1, 1200)) + [16384, 98304, 3 * 5 * 7 * 11 * 13]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
