"""Cost-aware balancing: imbalance targets, exact solver vs greedy vs brute force, token
limits, per-sequence context-parallel plans, every document once per epoch, exact resume,
and balanced multi-process training against a one-process reference (float64)."""

import json

import numpy as np
import pytest

from meshfold.config import ConfigError, from_dict, validate
from meshfold.data.balance import (
    BalanceError, DocumentCost, brute_force, greedy_lpt, imbalance, loads_of, naive_split, plan_context_parallel,
    plan_step, rank_token_cap, solve_exact,
)
from meshfold.parallel.balanced_loader import BalancedBatches, PieceBatchSampler
from meshfold.data.packing import DocumentPieces
from meshfold.testing import run_on, tiny_config, train_collect

COST = DocumentCost(a=1 / 1024, b=1.0)  # attention overtakes the rest at 1024 tokens


def long_tailed(n=400, seed=0, cap=4096):
    rng = np.random.default_rng(seed)
    return np.minimum(np.ceil(rng.lognormal(5.5, 1.0, n)), cap).astype(np.int64)


def test_cost_model_and_imbalance():
    np.testing.assert_allclose(COST([0, 1024, 2048]), [0, 2048, 6144])
    assert imbalance([1, 1, 1]) == 1.0
    assert imbalance([3, 1, 1, 1]) == pytest.approx(2.0)
    assert imbalance([0, 0]) == 1.0


@pytest.mark.parametrize("ranks", [4, 8])
def test_balancer_fixes_a_long_tailed_step(ranks):
    lengths = long_tailed()
    plan = plan_step(lengths, COST, ranks)
    assert plan.stats["imbalance_before"] >= 1.3  # token-equal split, quadratic cost
    assert plan.stats["imbalance_tokens_before"] <= 1.05  # ... although tokens are equal
    assert plan.stats["imbalance"] <= 1.05
    assert plan.stats["imbalance"] == pytest.approx(imbalance(loads_of(plan.rank, COST(lengths), ranks)))


def test_naive_split_is_contiguous_and_token_equal():
    lengths = np.array([5, 5, 5, 5, 10, 10])
    assert naive_split(lengths, 2).tolist() == [0, 0, 0, 0, 1, 1]
    assert naive_split(lengths, 1).tolist() == [0] * 6


def test_exact_matches_brute_force_on_small_cases():
    rng = np.random.default_rng(3)
    for trial in range(25):
        n, bins = int(rng.integers(2, 8)), int(rng.integers(2, 4))
        lengths = rng.integers(1, 300, size=n)
        w = COST(lengths)
        cap = None if trial % 2 else int(lengths.sum() / bins * 1.3) + int(lengths.max())
        best, _ = brute_force(w, lengths, bins, cap)
        got = solve_exact(w, lengths, bins, cap, time_limit=10, node_limit=100000, mip_rel_gap=0.0)
        assert loads_of(got, w, bins).max() == pytest.approx(best, rel=1e-9)
        greedy = greedy_lpt(w, lengths, bins, cap)
        assert loads_of(got, w, bins).max() <= loads_of(greedy, w, bins).max() + 1e-12
        if cap is not None:
            assert loads_of(got, lengths, bins).max() <= cap


def test_exact_never_worse_than_greedy_and_better_where_greedy_is_poor():
    rng = np.random.default_rng(5)
    for _ in range(10):
        lengths = rng.integers(1, 2000, size=40)
        w = COST(lengths)
        g = loads_of(greedy_lpt(w, lengths, 4), w, 4).max()
        e = loads_of(solve_exact(w, lengths, 4, time_limit=0.5), w, 4).max()
        assert e <= g + 1e-12
    # The classic LPT worst case (2m+1 jobs on m machines): LPT gives 11, the optimum 9.
    w = np.array([5, 5, 4, 4, 3, 3, 3], dtype=float)
    assert loads_of(greedy_lpt(w, w, 3), w, 3).max() == 11
    assert loads_of(solve_exact(w, w, 3, mip_rel_gap=0), w, 3).max() == 9


def test_token_limits_are_respected_or_refused():
    lengths = np.array([900, 100, 100, 100, 100, 100])
    w = COST(lengths)
    # Without a limit LPT puts the 900-token document alone; with 1000 tokens per rank,
    # any split is fine as long as no rank exceeds it.
    for a in (greedy_lpt(w, lengths, 2, cap=1000), solve_exact(w, lengths, 2, cap=1000)):
        assert loads_of(a, lengths, 2).max() <= 1000
    with pytest.raises(BalanceError, match="data.max_tokens"):
        greedy_lpt(w, lengths, 2, cap=600)


def test_micro_batches_fit_their_token_cap():
    rng = np.random.default_rng(7)
    for _ in range(20):
        lengths = rng.integers(1, 65, size=int(rng.integers(10, 60)))
        ranks, micro, cap = 4, int(rng.integers(1, 4)), 128
        if lengths.sum() > ranks * rank_token_cap(cap, micro, int(lengths.max())):
            continue
        plan = plan_step(lengths, COST, ranks, micro, cap)
        for r in range(ranks):
            for m in range(micro):
                assert lengths[plan.items(r, m)].sum() <= cap
        assert sorted(i for r in range(ranks) for m in range(micro) for i in plan.items(r, m)) == \
            list(range(len(lengths)))


# --------------------------------------------------------------------------- per-sequence context parallel


def test_context_parallel_plan_spreads_only_what_must_be_spread():
    lengths = np.concatenate([[12000, 3000], long_tailed(200, seed=1, cap=1000)])
    w = COST(lengths)
    cap = 12288
    ranks = 8
    # The 12000-token document fits one rank's memory, but its W alone is far above a fair
    # share: without spreading it, no assignment can be balanced.
    assert w[0] > 4 * w.sum() / ranks
    plan = plan_context_parallel(lengths, COST, ranks, rank_cap=cap)
    assert plan.degree[0] >= 2 and lengths[0] / plan.degree[0] <= cap
    assert w[0] / plan.degree[0] <= w.sum() / ranks
    assert plan.group_start[0] % plan.degree[0] == 0  # aligned group
    assert np.all(plan.degree[2:] == 1)  # short documents stay whole on one rank
    assert plan.tokens.max() <= cap
    assert plan.imbalance <= 1.05
    # Load bookkeeping: each rank's load is recomputed from the plan.
    loads = np.zeros(ranks)
    for i in range(len(lengths)):
        k = plan.degree[i]
        loads[plan.group_start[i]: plan.group_start[i] + k] += w[i] / k
    np.testing.assert_allclose(loads, plan.loads)
    # Memory alone: a 20000-token document with a 12288-token limit needs two ranks even
    # when its cost would be acceptable (share = 100).
    mem = plan_context_parallel([20000, 100, 100, 100], COST, 4, rank_cap=cap, share=100.0, tolerance=None)
    assert mem.degree.tolist() == [2, 1, 1, 1]
    assert mem.tokens.max() <= cap
    # Granularity: five equal documents on four ranks. None is above a fair share, so the
    # first rule spreads nothing and LPT leaves lambda = 2 / 1.25; the refinement spreads
    # one of them over the four ranks, which balances exactly.
    coarse = plan_context_parallel([1000] * 5, COST, 4, rank_cap=cap, tolerance=None)
    assert coarse.degree.tolist() == [1] * 5 and coarse.imbalance == pytest.approx(1.6)
    refined = plan_context_parallel([1000] * 5, COST, 4, rank_cap=cap)
    assert refined.degree.tolist() == [4, 1, 1, 1, 1] and refined.imbalance == pytest.approx(1.0)
    with pytest.raises(BalanceError, match="power-of-two"):
        plan_context_parallel(lengths, COST, 6, rank_cap=cap)
    with pytest.raises(BalanceError, match="data.max_tokens"):
        plan_context_parallel([60000], COST, 4, rank_cap=cap)


# --------------------------------------------------------------------------- epochs and resume


def corpus(n_docs=60, seed=0):
    from tests.test_packing import corpus_of

    rng = np.random.default_rng(seed)
    return corpus_of(np.minimum(np.ceil(rng.lognormal(3.0, 1.0, n_docs)), 200).astype(int) + 1)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_every_piece_once_per_epoch_for_any_rank_count(ranks):
    pieces = DocumentPieces(corpus(), max_len=32)
    loaders = [BalancedBatches(pieces, COST, ranks, r, n_micro=2, micro_cap=128, tokens_per_step=64 * ranks,
                               seed=11) for r in range(ranks)]
    seen = []
    while loaders[0].sampler.epoch == 0:
        steps = [ld.next_ids() for ld in loaders]
        if loaders[0].sampler.epoch != 0:
            break
        for r, micro in enumerate(steps):
            for ids in micro:
                assert pieces.lengths[ids].sum() <= 128
                seen.extend(ids)
        # Every rank computed the same plan.
        assert all(np.array_equal(ld.last_plan.rank, loaders[0].last_plan.rank) for ld in loaders)
        if loaders[0].sampler.cursor == len(pieces):
            break
    assert sorted(seen) == list(range(len(pieces)))


def test_sampler_order_is_seeded_and_resumes_exactly():
    pieces = DocumentPieces(corpus(), max_len=32)

    def sampler(seed=3):
        return PieceBatchSampler(pieces.lengths, pieces.doc_pieces, 100, seed)

    a = sampler()
    first = [a.next().tolist() for _ in range(40)]  # crosses epoch boundaries
    assert a.epoch >= 1
    assert [sampler().next().tolist() for _ in range(1)] == first[:1]
    assert sampler(seed=4).next().tolist() != first[0]
    # Pieces of a document stay in order and together.
    order = sampler().order()
    for ids in pieces.doc_pieces:
        if len(ids) > 1:
            pos = [int(np.flatnonzero(order == p)[0]) for p in ids]
            assert pos == list(range(pos[0], pos[0] + len(ids)))
    for k in (1, 7, 19, 33):
        b = sampler()
        for _ in range(k):
            b.next()
        state = json.loads(json.dumps(b.state_dict()))
        c = sampler()
        c.load_state_dict(state)
        assert [c.next().tolist() for _ in range(40 - k)] == first[k:]
    other = PieceBatchSampler(pieces.lengths, pieces.doc_pieces, 200, 3)
    with pytest.raises(ConfigError, match="global_batch"):
        other.load_state_dict(a.state_dict())


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("section,key,value,match", [
    ("parallel", "pp", 2, "parallel.pp"),
    ("parallel", "cp", 2, "parallel.cp"),
    ("data", "pack", False, "data.pack"),
    ("data", "max_tokens", 8, "data.max_tokens"),
    ("data", "cost_a", -1.0, "data.cost_a"),
    ("data", "balance_tolerance", 0.5, "data.balance_tolerance"),
    ("data", "seq_cp_max", 3, "data.seq_cp_max"),
])
def test_config_errors_name_the_key(tmp_path, section, key, value, match):
    cfg = tiny_config(str(tmp_path), data={"balance": "greedy"})
    cfg.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match=match):
        validate(from_dict(cfg), 4)


# --------------------------------------------------------------------------- training


def balanced_config(run_dir, source, balance="greedy", **train):
    cfg = tiny_config(run_dir, data={"source": source, "max_docs": 0, "val_docs": 0, "balance": balance,
                                     "cost_a": 1 / 64, "cost_b": 1.0},
                      train={"global_batch": 8, **train})
    return cfg


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    rng = np.random.default_rng(2)
    words = "alpha beta gamma delta eps zeta eta theta iota kappa lambda mu nu xi".split()
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    with open(path, "w") as fh:
        for _ in range(80):  # long-tailed: most documents short, a few several pieces long
            fh.write(json.dumps({"text": " ".join(rng.choice(words, int(min(rng.lognormal(2.3, 1.0), 60)) + 1))})
                     + "\n")
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, source):
    return train_collect(balanced_config(str(tmp_path_factory.mktemp("ref")), source))


@pytest.mark.parametrize("world,parallel,balance,train", [
    pytest.param(2, {"dp_replicate": 2, "dp_shard": 1}, "greedy", {}, id="ddp2-greedy"),
    pytest.param(2, {"dp_shard": 2, "zero": 3}, "exact", {"micro_batch": 2}, id="fsdp2-exact-micro"),
    pytest.param(4, {"dp_shard": 4, "zero": 3}, "greedy", {}, id="fsdp4-greedy"),
])
def test_balanced_training_matches_one_process(world, parallel, balance, train, reference, source, tmp_path):
    """The step's documents are the same for any layout; only their placement differs, so
    losses, every parameter and every gradient match the one-process run (float64)."""
    cfg = balanced_config(str(tmp_path), source, balance, **train)
    cfg["parallel"] = parallel
    got = run_on(world, train_collect, cfg)[0]
    from meshfold.testing import assert_runs_match

    assert_runs_match(reference, got, rtol=1e-9, atol=1e-11)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 5
    for rec in records:
        assert rec["imbalance"] <= rec["imbalance_before"] + 1e-12
        assert {"imbalance_tokens", "imbalance_tokens_before", "step_tokens"} <= set(rec)
        assert rec["step_tokens"] <= 8 * 16


def test_calibration_fits_positive_costs():
    from meshfold.config import ModelConfig
    from meshfold.data.cost_calibration import measure_cost

    fit = measure_cost(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, seq_len=64), lengths=[8, 32, 64],
                       repeats=1)
    assert fit.a >= 0 and fit.b >= 0 and (fit.a > 0 or fit.b > 0)
    # Each length alone and several to a row (about 2 x 64 tokens), so b and the
    # per-micro-batch overhead c are separable.
    assert list(zip(fit.lengths, fit.counts)) == [(8, 1), (8, 16), (32, 1), (32, 4), (64, 1), (64, 2)]
    assert all(s > 0 for s in fit.seconds)
    assert fit.rel_error() == pytest.approx(max(abs(k * (fit.a * l * l + fit.b * l) + fit.c - s) / s
                                                for l, k, s in zip(fit.lengths, fit.counts, fit.seconds)))


def test_calibration_times_one_block_never_the_whole_model(monkeypatch):
    """data.balance without cost_a/cost_b: one block of each kind (dense, MoE) is timed under
    the run's autocast; building the whole model there is an error."""
    from meshfold.config import ModelConfig
    from meshfold.data import cost_calibration
    from meshfold.models import llama

    def no_whole_model(*args, **kwargs):
        raise AssertionError("the cost calibration built the whole model")

    monkeypatch.setattr(llama.Transformer, "__init__", no_whole_model)
    built = []
    real_block = cost_calibration.TransformerBlock
    monkeypatch.setattr(cost_calibration, "TransformerBlock", lambda cfg, i: built.append(i) or real_block(cfg, i))
    cfg = ModelConfig(dim=32, n_layers=4, n_heads=4, vocab_size=64, seq_len=32, moe_experts=4, moe_topk=2, moe_every=2)
    import torch

    fit = cost_calibration.measure_cost(cfg, lengths=[8, 32], repeats=1, autocast_dtype=torch.bfloat16)
    assert sorted(built) == [0, 1]  # layer 0 (dense) and layer 1 (MoE): two blocks for four layers
    # (At these tiny shapes the times are overhead and noise: only their presence is checked.)
    assert fit.a >= 0 and fit.b >= 0 and len(fit.seconds) == 4 and all(s > 0 for s in fit.seconds)


def test_cost_fit_recovers_known_costs_and_reports_its_error():
    """The fit behind calibration: exact on noiseless points, and rel_error is the largest
    relative miss (one point made 10 % slower than the law moves the fit and shows up)."""
    from meshfold.data.cost_calibration import fit_cost

    a, b, c = 3e-9, 2e-6, 5e-4
    lengths = [8, 8, 32, 32, 128, 128]
    counts = [1, 32, 1, 8, 1, 2]
    seconds = [k * (a * l * l + b * l) + c for l, k in zip(lengths, counts)]
    fit = fit_cost(lengths, counts, seconds)
    assert (fit.a, fit.b, fit.c) == pytest.approx((a, b, c), rel=1e-6)
    assert fit.rel_error() < 1e-6
    seconds[4] *= 1.10
    off = fit_cost(lengths, counts, seconds)
    assert 0.005 < off.rel_error() < 0.10
    pred = [k * (off.a * l * l + off.b * l) + off.c for l, k in zip(lengths, counts)]
    assert off.rel_error() == pytest.approx(max(abs(p - s) / s for p, s in zip(pred, seconds)))


def test_per_sequence_context_parallel_matches_one_process(source, tmp_path):
    """data.seq_cp_max = 4: documents costlier than a fair share are spread over 2 or 4
    ranks (ring attention on a group made for them), the rest stay whole; losses, every
    parameter and gradient equal the one-process run on the same documents (float64)."""
    from meshfold.testing import assert_runs_match

    def config(run_dir, seq_cp_max):
        cfg = balanced_config(run_dir, source)
        cfg["model"]["seq_len"] = 32
        cfg["data"].update(cost_a=1.0, cost_b=1.0, seq_cp_max=seq_cp_max)
        return cfg

    ref = train_collect(config(str(tmp_path / "ref"), 1))
    cfg = config(str(tmp_path / "cp"), 4)
    cfg["parallel"] = {"dp_shard": 4, "zero": 3}
    got = run_on(4, train_collect, cfg)[0]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
    records = [json.loads(x) for x in (tmp_path / "cp" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["spread_docs"] for r in records) > 0  # the test exercised spreading
    assert max(r["spread_max_degree"] for r in records) >= 2
    for rec in records:
        assert rec["imbalance"] <= rec["imbalance_before"] + 1e-12


def test_spread_plans_cover_every_piece_once():
    """With per-sequence cp every piece of a step is either whole on one rank or shared by
    every member of one aligned group, and all ranks see the same plan."""
    pieces = DocumentPieces(corpus(80, seed=4), max_len=64)
    ranks = 4
    loaders = [BalancedBatches(pieces, DocumentCost(1.0, 1.0), ranks, r, n_micro=1, micro_cap=256,
                               tokens_per_step=64 * ranks, seed=2, seq_cp_max=4) for r in range(ranks)]
    spread_seen = 0
    for _ in range(10):
        whole = [ld.next_ids()[0] for ld in loaders]
        ids = loaders[0].next_ids_of_step
        plan = loaders[0].last_plan
        owners = {}
        for r, ld in enumerate(loaders):
            assert np.array_equal(ld.last_plan.rank, plan.rank) and np.array_equal(ld.last_plan.degree, plan.degree)
            for p in whole[r]:
                owners.setdefault(p, []).append(r)
            for item, k, start in ld.last_plan.spread_items(r):
                assert start % k == 0 and start <= r < start + k
                owners.setdefault(int(ids[item]), []).append(r)
                spread_seen += 1
        assert sorted(owners) == sorted(ids.tolist())
        for i, p in enumerate(ids.tolist()):
            k, start = int(plan.degree[i]), int(plan.rank[i])
            assert owners[p] == list(range(start, start + k))
    assert spread_seen > 0
