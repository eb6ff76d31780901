"""Gradient codecs on the per-step data-parallel path: error-feedback invariants (what is
not sent is carried, nothing is lost over steps), DGC's warm-up and momentum correction,
L-GreCo's dynamic program, 1-bit Adam's exact warm-up, and the DDP hook end to end."""

import itertools
import math

import pytest
import torch

from meshfold.config import LowCommConfig
from meshfold.lowcomm.codecs import LGreCo, PowerSGD, Sign, TopK, build_codec
from meshfold.lowcomm.codecs.lgreco import knapsack_min_size
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

SHAPES = {"a.weight": (8, 6), "b.weight": (5, 7), "b.bias": (5,)}


def _grads(rank: int, step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [(n, torch.randn(s, generator=g, dtype=torch.float64)) for n, s in SHAPES.items()]


def _make(kind: str, group=None):
    lc = LowCommConfig(compression=kind, powersgd_rank=2, topk_ratio=0.2, lgreco_error_budget=0.3, lgreco_every=2)
    return build_codec(kind, group, lc, seed=5)


def _error(codec, name, shape):
    e = codec.state.get(name, {}).get("error")
    return torch.zeros(shape, dtype=torch.float64) if e is None else e.reshape(shape)


def _ef_run(kind: str, steps: int = 5):
    """Run ``steps`` reductions on this rank's gradients; return the summed decoded means,
    the summed local gradients and the final error buffers."""
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_initialized() else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    codec = _make(kind, group)
    sent_sum = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    grad_sum = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    for step in range(steps):
        named = _grads(rank, step)
        for n, g in named:
            grad_sum[n] += g
        codec.step_begin()
        codec.reduce(named)
        for n, g in named:
            sent_sum[n] += g
    errors = {n: _error(codec, n, s).clone() for n, s in SHAPES.items()}
    return {"sent": sent_sum, "grads": grad_sum, "errors": errors}


@pytest.mark.parametrize("kind", ["powersgd", "topk", "onebit", "lgreco"])
def test_error_feedback_loses_nothing_one_rank(kind):
    r = _ef_run(kind)
    for n in SHAPES:  # sum of what was applied + what is still carried = sum of gradients
        torch.testing.assert_close(r["sent"][n] + r["errors"][n], r["grads"][n], rtol=1e-12, atol=1e-12)
    assert any(r["errors"][n].abs().sum() > 0 for n in SHAPES)  # it really compressed


@pytest.mark.parametrize("kind", ["powersgd", "topk", "onebit", "lgreco"])
def test_error_feedback_loses_nothing_across_ranks(kind):
    """Over 2 ranks: sum_t decoded_mean_t + mean_ranks(e_T) = sum_t mean_ranks(g_t), and every
    rank applies the same decoded mean."""
    res = run_on(2, _ef_run, kind)
    for n in SHAPES:
        torch.testing.assert_close(res[0]["sent"][n], res[1]["sent"][n], rtol=0, atol=0)
        mean_grads = (res[0]["grads"][n] + res[1]["grads"][n]) / 2
        mean_err = (res[0]["errors"][n] + res[1]["errors"][n]) / 2
        torch.testing.assert_close(res[0]["sent"][n] + mean_err, mean_grads, rtol=1e-11, atol=1e-11)


def test_powersgd_rank_and_bytes():
    codec = PowerSGD(None, rank=2, seed=0)
    named = _grads(0, 0)
    before = {n: g.clone() for n, g in named}
    codec.step_begin()
    codec.reduce(named)
    g = dict(named)
    assert torch.linalg.matrix_rank(g["a.weight"]) == 2
    torch.testing.assert_close(g["b.bias"], before["b.bias"])  # vectors go uncompressed


def test_topk_dgc_momentum_correction_and_warmup_by_hand():
    codec = TopK(None, ratio=0.1, momentum=0.5, warmup=4)
    # warm-up: 25% -> 10% exponentially over 4 steps, then 10%
    ratios = []
    for _ in range(6):
        codec.step_begin()
        ratios.append(codec.current_ratio())
    want = [0.25 * (0.1 / 0.25) ** (k / 4) for k in range(4)] + [0.1, 0.1]
    assert ratios == pytest.approx(want)
    # momentum correction on a 10-element vector with k = 1 (ratio 0.1 after warm-up)
    g1 = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 0, 3.0], dtype=torch.float64)
    g2 = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0], dtype=torch.float64)
    x = g1.clone()
    codec.reduce([("v", x)])
    # u = g1, v = g1 -> top-1 is index 9 (3.0): sent, and u[9] = v[9] = 0
    assert x.tolist() == [0.0] * 9 + [3.0]
    x = g2.clone()
    codec.reduce([("v", x)])
    # u = 0.5 * [1,0..0] + g2 = [1.5, ...]; v = [1, ..] + [1.5, ..] = [2.5, ..] -> sent 2.5
    assert x.tolist() == [2.5] + [0.0] * 9
    assert codec.state["v"]["momentum"].abs().sum() == 0 and codec.state["v"]["error"].abs().sum() == 0


def test_sign_codec_sends_one_bit_per_element():
    from meshfold.comm import reset_ledger

    res = run_on(2, _sign_bytes)
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    # all-gather of packed bits + one fp32 scale per tensor, (n-1)/n of n pieces = 1 piece
    want = sum(-(-torch.Size(s).numel() // 8) + 4 for s in SHAPES.values())
    assert res[0] == want and want < numel * 8 / 16  # >16x fewer than fp64 all-reduce bytes
    reset_ledger()


def _sign_bytes():
    import torch.distributed as dist

    from meshfold.comm import ledger

    codec = Sign(dist.group.WORLD)
    codec.step_begin()
    codec.reduce(_grads(dist.get_rank(), 0))
    return ledger().step["dp"]


def test_lgreco_knapsack_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        layers = 4
        sizes = [sorted(torch.randint(1, 50, (3,), generator=g).tolist()) + [100] for _ in range(layers)]
        errors = [sorted(torch.rand(3, generator=g).tolist(), reverse=True) + [0.0] for _ in range(layers)]
        limit = float(torch.rand((), generator=g)) * 2
        bins = 400
        choice = knapsack_min_size(sizes, errors, limit, bins)
        assert sum(errors[i][c] for i, c in enumerate(choice)) <= limit + 1e-12  # the budget holds
        # optimal for the discretised problem (errors rounded up to multiples of limit/bins)
        unit = limit / bins
        cost = [[0 if e <= 0 else math.ceil(e / unit) for e in row] for row in errors]
        best = min(sum(sizes[i][c] for i, c in enumerate(cs))
                   for cs in itertools.product(range(4), repeat=layers)
                   if sum(cost[i][c] for i, c in enumerate(cs)) <= bins)
        assert sum(sizes[i][c] for i, c in enumerate(choice)) == best


def test_lgreco_picks_lower_ranks_for_low_rank_layers():
    codec = LGreCo(None, default_rank=2, budget=0.05, every=1)
    g = torch.Generator().manual_seed(0)
    low = torch.randn(20, 1, generator=g, dtype=torch.float64) @ torch.randn(1, 20, generator=g, dtype=torch.float64)
    full = torch.randn(20, 20, generator=g, dtype=torch.float64)
    codec.step_begin()
    codec.reduce([("low", low), ("full", full)])
    assert codec.ranks["low"] == 1  # exactly rank 1: one component is free of error
    assert codec.ranks["full"] in (0, 4) or codec.ranks["full"] > 1  # the noisy one needs more


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("ref"))))


def test_onebit_adam_warmup_is_exact_adamw(reference, tmp_path):
    """While the variance is not frozen, 1-bit Adam is AdamW on full-precision averaged
    gradients: DDP over 2 ranks must match the one-process run (float64)."""
    cfg = tiny_config(str(tmp_path), parallel={"dp_replicate": 2, "dp_shard": 1},
                      lowcomm={"compression": "onebit", "onebit_adam": True, "onebit_warmup_steps": 100},
                      train={"weight_decay": 0.1})
    got = run_on(2, train_collect, cfg)[0]
    assert_runs_match(reference, got, rtol=1e-9, atol=1e-11)


def _train_bytes(cfg_dict):
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    tr = Trainer(from_dict(cfg_dict))
    losses = tr.fit()
    return {"losses": losses, "dp": tr.ledger.total.get("dp", 0.0), "params": tr.full_state(),
            "rank": dist.get_rank()}


@pytest.mark.parametrize("kind,extra", [("none", {}), ("powersgd", {"powersgd_rank": 1}),
                                        ("topk", {"topk_ratio": 0.05, "dgc_warmup_steps": 2}),
                                        ("onebit", {}), ("onebit", {"onebit_adam": True, "onebit_warmup_steps": 2}),
                                        ("lgreco", {"powersgd_rank": 2, "lgreco_every": 2})])
def test_ddp_hook_trains_and_saves_bytes(kind, extra, tmp_path):
    cfg = tiny_config(str(tmp_path), parallel={"dp_replicate": 2, "dp_shard": 1},
                      lowcomm={"compression": kind, **extra}, train={"steps": 5, "weight_decay": 0.0})
    res = run_on(2, _train_bytes, cfg)
    for n, v in res[0]["params"].items():  # replicas stay identical
        torch.testing.assert_close(res[1]["params"][n], v, rtol=0, atol=0)
    assert res[0]["losses"][-1] < res[0]["losses"][0]
    _BYTES[(kind, tuple(sorted(extra)))] = res[0]["dp"]
    if kind != "none" and ("none", ()) in _BYTES:
        full = _BYTES[("none", ())]
        # 1-bit Adam: full-precision all-reduce only in its 2 warm-up steps of 5
        bound = full * 2.2 / 5 if extra.get("onebit_adam") else full / 3
        assert res[0]["dp"] < bound, (kind, res[0]["dp"], full)


_BYTES: dict = {}


def test_compression_refused_on_fsdp():
    from meshfold.config import ConfigError, from_dict, validate

    cfg = from_dict(tiny_config("/tmp/x", parallel={"dp_shard": 2, "zero": 3}, lowcomm={"compression": "topk"}))
    with pytest.raises(ConfigError, match="lowcomm.compression"):
        validate(cfg, 2)


def _deflate_exchange(numel: int):
    """The deflated FP4 mean next to the fixed-length one, and the bytes handed to every
    collective during the deflated exchange (measured by wrapping torch.distributed)."""
    import torch.distributed as dist

    from meshfold.lowcomm.codecs.fp4 import fp4_all_reduce_mean, fp4_deflate_all_reduce_mean

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(numel, generator=g, dtype=torch.float64) * torch.rand(numel, generator=g) ** 3
    x[: numel // 5] = 0.0  # a fifth of zeros (e.g. untouched embedding rows): compressible
    fixed = fp4_all_reduce_mean(x, None, dim=None)
    leaving = []  # bytes that leave this rank, from the buffers actually passed in
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # (comm.py)
    a2a, ag = dist.all_to_all_single, getattr(dist, gather)

    def spy_a2a(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        splits = input_split_sizes or [inp.numel() // n] * n
        leaving.append(inp.element_size() * (sum(splits) - splits[rank]))
        return a2a(out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                   group=group, **kw)

    def spy_ag(out, inp, group=None, **kw):
        leaving.append(inp.numel() * inp.element_size() * (n - 1))
        return ag(out, inp, group=group, **kw)

    dist.all_to_all_single = spy_a2a
    setattr(dist, gather, spy_ag)
    try:
        got, sent = fp4_deflate_all_reduce_mean(x, None)
    finally:
        dist.all_to_all_single = a2a
        setattr(dist, gather, ag)
    return {"fixed": fixed, "got": got, "sent": sent, "leaving": sum(leaving), "calls": len(leaving)}


def test_fp4_deflate_exchange_is_lossless_and_ledger_equals_payloads():
    from meshfold.lowcomm.codecs.fp4 import FP4_BLOCK, fp4_bytes

    n, numel = 4, 5000  # not a multiple of the block: padding included
    res = run_on(n, _deflate_exchange, numel)
    padded = FP4_BLOCK * n * -(-numel // (FP4_BLOCK * n))
    fixed_bytes = 2 * (n - 1) / n * fp4_bytes(padded)
    for r in res:
        assert torch.equal(r["got"], r["fixed"])  # decoding is exact: bit-identical mean
        assert torch.equal(r["got"], res[0]["got"])
        assert r["calls"] == 6  # 2 phases x (lengths, codes, scales)
        assert r["sent"] == r["leaving"]  # what the ledger gets is what the collectives carried
        assert r["sent"] < 0.9 * fixed_bytes  # and the coding saved bytes on this data


# ---------------------------------------------------------------------------- NCCL rules

def _codec_outputs(strict: bool) -> dict:
    """Every codec, the FP4 exchanges and an outer step on a real gloo group, with every
    input made beforehand. ``strict``: new tensors default to the ``meta`` device, as under
    the suite's strict mode, so any tensor a hot path creates without ``device=`` lands on
    meta and is refused by the comm layer (or fails to mix with real tensors)."""
    import torch.distributed as dist

    from meshfold.lowcomm.codecs.fp4 import fp4_all_reduce_mean, fp4_deflate_all_reduce_mean
    from meshfold.lowcomm.outer import build_outer

    rank = dist.get_rank()
    group = dist.group.WORLD
    codecs = {kind: _make(kind, group) for kind in ("powersgd", "topk", "onebit", "lgreco")}
    grads = {kind: [_grads(rank, s) for s in range(3)] for kind in codecs}
    g = torch.Generator().manual_seed(rank)
    vec = torch.randn(700, generator=g, dtype=torch.float64)
    params = {n: torch.nn.Parameter(t.clone()) for n, t in _grads(0, 9)}
    lc = LowCommConfig(method="co2", workers=2, inner_steps=1, outer_lr=0.7, outer_momentum=0.9)
    outer = build_outer("co2", list(params.items()), lc, group, total_steps=10)
    out = {}
    previous = torch.get_default_device()
    if strict:
        torch.set_default_device("meta")
    try:
        for kind, codec in codecs.items():
            for named in grads[kind]:
                codec.step_begin()
                codec.reduce(named)
            out[kind] = [g for named in grads[kind] for _, g in named]
        out["fp4"] = fp4_all_reduce_mean(vec, group)
        out["fp4_deflate"] = fp4_deflate_all_reduce_mean(vec, group)[0]
        with torch.no_grad():
            for p in params.values():
                p.sub_(0.1 * (rank + 1))
        outer.after_step(1)
        out["co2"] = [p.detach().clone() for p in params.values()]
    finally:
        torch.set_default_device(previous)
    return out


def _strict_and_plain():
    return {"strict": _codec_outputs(True), "plain": _codec_outputs(False)}


def test_codecs_create_every_tensor_on_the_device_strict():
    """Under a meta default device nothing in the codecs, the FP4 exchanges or the outer
    step falls back to the host, and the results equal the ordinary run exactly."""
    for r in run_on(2, _strict_and_plain):
        for key, want in r["plain"].items():
            got = r["strict"][key]
            for a, b in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]):
                assert a.device.type == "cpu", key
                assert torch.equal(a, b), key


def test_meta_tensor_reaching_a_collective_is_caught():
    """The emulation can fail: a tensor made without device= under the meta default is refused."""
    res = run_on(2, _meta_all_reduce)
    assert all("meta device" in r for r in res), res


def _meta_all_reduce():
    import torch.distributed as dist

    from meshfold import comm

    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        comm.all_reduce(torch.zeros(4), dist.group.WORLD, "dp")
    except comm.CommError as err:
        return str(err)
    finally:
        torch.set_default_device(previous)
    return "not caught"


def _powersgd_async():
    """One call with 3 matrices + 1 vector: how many all-reduces, and whether the future is
    still unfinished when reduce_async returns (rank 1 joins only after rank 0 looked)."""
    import torch.distributed as dist

    from meshfold import comm

    rank = dist.get_rank()
    side = dist.new_group(backend="gloo")
    codec = PowerSGD(dist.group.WORLD, rank=1, seed=3)
    shapes = {"a.weight": (8, 6), "b.weight": (5, 7), "c.weight": (9, 4), "c.bias": (9,)}
    gen = torch.Generator().manual_seed(rank)
    named = [(n, torch.randn(s, generator=gen, dtype=torch.float64)) for n, s in shapes.items()]
    reference = PowerSGD(dist.group.WORLD, rank=1, seed=3)
    ref_named = [(n, g.clone()) for n, g in named]
    calls = []
    real = dist.all_reduce

    def counting(t, *a, **kw):
        calls.append(t.numel())
        return real(t, *a, **kw)

    dist.all_reduce = counting
    try:
        codec.step_begin()
        if rank == 0:
            fut = codec.reduce_async(named)
            unfinished = not fut.done()
            comm.barrier(side)
        else:
            comm.barrier(side)
            fut = codec.reduce_async(named)
            unfinished = None
        fut.wait()
    finally:
        dist.all_reduce = real
    # the synchronous path (per-matrix maths are the same) gives the same means
    reference.step_begin()
    reference.reduce(ref_named)
    same = all(torch.equal(g, r) for (_, g), (_, r) in zip(named, ref_named))
    return {"calls": calls, "unfinished": unfinished, "same": same}


def test_powersgd_batches_all_p_and_all_q_and_overlaps():
    res = run_on(2, _powersgd_async)
    # two all-reduces: the vector with every P (9 + 8 + 5 + 9 with rank 1), then every Q
    assert res[0]["calls"] == [9 + 8 + 5 + 9, 6 + 7 + 4], res[0]["calls"]
    assert res[0]["unfinished"] is True  # returned before the exchange finished
    assert all(r["same"] for r in res)
