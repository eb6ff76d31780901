"""MoE block (one process): routing, capacity dropping, auxiliary losses against naive
formulas, parameter/FLOP counts of MoE shapes; and the global-batch balance loss across
real gloo ranks against the one-process value."""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshfold.config import ModelConfig
from meshfold.models.llama import Transformer, init_weights
from meshfold.models.moe import MoE, moe_aux_loss, moe_end_step
from meshfold.models.counts import flops_per_token, param_count
from meshfold.models.presets import preset
from meshfold.testing import run_on


def tiny(**kw) -> ModelConfig:
    base = dict(dim=16, n_layers=2, n_heads=2, vocab_size=64, seq_len=8, moe_experts=4, moe_topk=2, ffn_dim=24)
    base.update(kw)
    return ModelConfig(**base)


def build_moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    """Random weights, drawn per logical matrix (w1, w2, w3 of the experts in that order, then
    the rest), so the values do not depend on how the experts store w1|w3 (one ``w13``)."""
    torch.manual_seed(seed)
    moe = MoE(cfg).double()
    for name, p in moe.named_parameters():
        with torch.no_grad():
            if name == "experts.w13":
                w1 = torch.randn_like(p[:, : p.shape[1] // 2]) * 0.1
                w2 = torch.randn_like(moe.experts.w2) * 0.1
                p.copy_(torch.cat([w1, torch.randn_like(w1) * 0.1], dim=1))
                moe.experts.w2.copy_(w2)
            elif name != "experts.w2" or cfg.mlp != "swiglu":
                p.copy_(torch.randn_like(p) * (0.3 if "router" in name else 0.1))
    return moe


def naive_moe(moe: MoE, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Per token, per chosen expert, in plain Python: the definition the block must meet."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ moe.router.weight.t()
    scores = logits.softmax(-1) if cfg.moe_router == "softmax" else logits.sigmoid()
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        choice = scores[t] + (moe.expert_bias if moe.expert_bias is not None else 0)
        idx = torch.topk(choice, cfg.moe_topk).indices
        gates = scores[t, idx]
        if cfg.moe_norm_topk or cfg.moe_router == "sigmoid":
            gates = gates / gates.sum()
        for g, e in zip(gates, idx):
            (w1, w3), w2 = moe.experts.w13[e].chunk(2), moe.experts.w2[e]  # w13: w1's rows, then w3's
            out[t] += g * (w2 @ (F.silu(w1 @ flat[t]) * (w3 @ flat[t])))
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.view_as(x)


@pytest.mark.parametrize("router,norm,shared", [("softmax", True, 0), ("softmax", False, 1), ("sigmoid", True, 2)])
def test_dropless_matches_naive(router, norm, shared):
    cfg = tiny(moe_router=router, moe_norm_topk=norm, moe_shared_experts=shared)
    moe = build_moe(cfg)
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(moe(x), naive_moe(moe, x, cfg), rtol=1e-12, atol=1e-12)


def test_bias_changes_choice_not_gates():
    cfg = tiny(moe_bias_balance=True, moe_topk=1)
    moe = build_moe(cfg)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    moe.expert_bias[:] = torch.tensor([10.0, 0, 0, 0])  # force expert 0 for every token
    torch.testing.assert_close(moe(x), naive_moe(moe, x, cfg), rtol=1e-12, atol=1e-12)
    _, idx, gates = moe.route(moe.router(x.reshape(-1, 16)))
    assert (idx == 0).all() and torch.allclose(gates, torch.ones_like(gates))  # renormalised top-1


def test_bias_balancing_update():
    cfg = tiny(moe_bias_balance=True, moe_bias_update_rate=0.5)
    moe = build_moe(cfg).train()
    moe(torch.randn(2, 8, 16, dtype=torch.float64)).sum().backward()
    load = moe._step_stats[:4].clone()
    moe.end_step()
    expected = 0.5 * torch.sign(load.mean() - load)
    torch.testing.assert_close(moe.expert_bias, expected.to(moe.expert_bias.dtype))
    assert moe.end_step() is None  # statistics were consumed


def test_capacity_drops_later_tokens_and_second_choices():
    # 4 experts, top-2, 8 tokens per sequence, capacity factor 0.5 -> C = ceil(0.5*8*2/4) = 2.
    cfg = tiny(moe_capacity_factor=0.5)
    moe = build_moe(cfg)
    with torch.no_grad():  # every token: first choice expert 0, second choice expert 1
        moe.router.weight.zero_()
        moe.router.weight[0, 0], moe.router.weight[1, 0] = 2.0, 1.0
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    x[..., 0] = x[..., 0].abs() + 0.1
    _, idx, _ = moe.route(moe.router(x.reshape(-1, 16)))
    assert (idx[:, 0] == 0).all() and (idx[:, 1] == 1).all()
    keep = moe.capacity_keep(idx, 2, 8).view(2, 8, 2)
    expected = torch.zeros(2, 8, 2, dtype=torch.bool)
    expected[:, :2, :] = True  # in each sequence the first two tokens fit in both queues
    assert torch.equal(keep, expected)

    # Mixed: first choices fill expert 0's queue before any second choice is queued there.
    idx = torch.tensor([[1, 0], [0, 2], [0, 3], [2, 0]])  # one sequence of 4 tokens
    moe_c = build_moe(tiny(moe_capacity_factor=1.0))  # C = ceil(1*4*2/4) = 2
    keep = moe_c.capacity_keep(idx, 1, 4)
    assert keep.tolist() == [[True, False], [True, True], [True, True], [True, False]]

    # Forward: dropped assignments contribute nothing; the count is logged.
    moe.train()
    out = moe(x)
    out = out.view(2, 8, 16)
    assert torch.equal(out[:, 2:], torch.zeros(2, 6, 16, dtype=torch.float64))  # both choices dropped
    assert (out[:, :2].abs().sum(-1) > 0).all()
    stats = moe.end_step()
    assert int(stats["dropped"]) == 2 * 6 * 2


def test_aux_and_z_loss_match_formula():
    cfg = tiny(moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
    moe = build_moe(cfg).train()
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    moe(x)
    aux = moe.pop_aux()
    logits = x.reshape(-1, 16) @ moe.router.weight.t()
    probs = logits.softmax(-1)
    idx = probs.topk(2, -1).indices
    f = torch.bincount(idx.flatten(), minlength=4).double() / (24 * 2)
    expected = 0.1 * 4 * (f * probs.mean(0)).sum() + 0.01 * torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(aux, expected, rtol=1e-12, atol=1e-14)
    # A perfectly uniform router gives the balance loss its minimum, coef * 1.
    assert 0.1 * 4 * (torch.full((4,), 0.25) * torch.full((4,), 0.25)).sum() == pytest.approx(0.1)


def test_trainer_hooks_collect_from_model():
    cfg = tiny(moe_every=2)
    model = Transformer(cfg).double().train()
    init_weights(model, cfg, seed=0)
    assert [i for i, b in model.layers.items() if isinstance(b.feed_forward, MoE)] == ["1"]
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert moe_aux_loss(model) is not None and moe_aux_loss(model) is None  # popped once
    fields = moe_end_step(model)
    assert set(fields) == {"expert_imbalance", "expert_load", "dropped_tokens"}
    assert sum(fields["expert_load"]["1"]) == 2 * 8 * 2 and fields["dropped_tokens"] == 0
    assert fields["expert_imbalance"] >= 1.0


# --------------------------------------------------------------------------- counts


def test_published_moe_counts():
    mixtral = preset("mixtral-8x7b")
    assert param_count(mixtral) == 46_702_792_704  # Hugging Face Mixtral-8x7B-v0.1: 46.7B
    assert round(param_count(mixtral, active=True) / 1e9, 1) == 12.9  # published 12.9B active
    ds = preset("deepseek-moe-16b")
    assert round(param_count(ds) / 1e9, 1) == 16.4  # DeepSeekMoE 16B: 16.4B total
    assert round(param_count(ds, active=True) / 1e9, 1) == 2.8  # 2.8B activated


@pytest.mark.parametrize("kw", [
    dict(),
    dict(moe_shared_experts=2, moe_ffn_dim=12, moe_first_dense=1, n_layers=3),
    dict(moe_every=2, n_layers=4, bias=True, mlp="gelu", norm="layernorm", moe_shared_experts=1),
    dict(moe_bias_balance=True, moe_router="sigmoid"),
])
def test_param_count_matches_built_model(kw):
    cfg = tiny(**kw)
    model = Transformer(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    per_token = param_count(cfg, active=True)
    expert = (3 if cfg.mlp == "swiglu" else 2) * cfg.dim * cfg.expert_dim
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    assert param_count(cfg) - per_token == moe_layers * (cfg.moe_experts - cfg.moe_topk) * expert


def test_flops_use_active_parameters():
    mixtral = preset("mixtral-8x7b")
    dense_equal = preset("mixtral-8x7b", moe_experts=0, ffn_dim=2 * 14336)  # same active MLP width
    # Router adds dim*E per layer; otherwise an MoE token costs what the active dense model does.
    diff = flops_per_token(mixtral) - flops_per_token(dense_equal)
    assert diff == 3 * 2 * mixtral.n_layers * mixtral.dim * mixtral.moe_experts


# --------------------------------------------------------------------------- global batch


def _balance_loss_on_ranks(cfg_kw: dict, x: torch.Tensor):
    """Rank r takes its slice of the global batch; stats are summed over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = tiny(**cfg_kw)
    moe = build_moe(cfg).train()

    def reduce(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    moe.reduce_stats = reduce
    local = x.chunk(world)[rank]
    moe(local)
    aux = moe.pop_aux()
    aux.backward()
    total = aux.detach().clone()
    dist.all_reduce(total)
    grad = moe.router.weight.grad.clone()
    dist.all_reduce(grad)
    return total, grad, moe.end_step()["load"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cfg_kw", [dict(moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01),
                                    # + DeepSeek-V3's group-limited routing and sequence-wise loss
                                    dict(moe_router="sigmoid", moe_aux_loss_coef=0.1, moe_seq_aux_loss_coef=0.05,
                                         moe_groups=2, moe_topk_groups=1, moe_routed_scale=2.0)])
def test_global_batch_balance_loss_across_ranks(world, cfg_kw):
    x = torch.randn(8, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    moe = build_moe(tiny(**cfg_kw)).train()
    moe(x)
    ref = moe.pop_aux()
    ref.backward()
    ref_load = moe.end_step()["load"]
    # The per-micro-batch loss (each rank on its own slice, then averaged) is different:
    # the point of the global statistic.
    local = build_moe(tiny(**cfg_kw)).train()
    per_rank = []
    for part in x.chunk(world):
        local(part)
        per_rank.append(local.pop_aux())
        local.end_step()
    assert abs(float(sum(per_rank).detach() / world) - float(ref.detach())) > 1e-6

    outs = run_on(world, _balance_loss_on_ranks, cfg_kw, x)
    for total, grad, load in outs:
        torch.testing.assert_close(total, ref.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, moe.router.weight.grad, rtol=1e-10, atol=1e-14)
        assert torch.equal(load, ref_load)
    assert math.isfinite(float(ref.detach()))


def test_bf16_autocast_combines_in_fp32():
    cfg = tiny(moe_shared_experts=1)
    moe = build_moe(cfg).float()
    x = torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), moe(x), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("model,key", [
    ({"moe_first_dense": 2}, "model.moe_first_dense"),
    ({"moe_capacity_factor": -1.0}, "model.moe_capacity_factor"),
    ({"moe_topk": 5}, "model.moe_topk"),
    ({"moe_router": "relu"}, "model.moe_router"),
])
def test_bad_moe_keys_name_the_key(model, key, tmp_path):
    from meshfold.config import ConfigError, from_dict, validate
    from meshfold.testing import tiny_config

    cfg = from_dict(tiny_config(str(tmp_path), model={"moe_experts": 4, **model}))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, 1)


@contextlib.contextmanager
def no_host_reads():
    """Fail on any tensor -> Python value read (.item, .tolist, int/float/bool of a tensor)."""
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(self, *a, **k):
        raise AssertionError("host read of a tensor in the forward")

    try:
        for n in names:
            setattr(torch.Tensor, n, refuse)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_grouped_gemm_matches_naive_without_host_reads(dtype, tol):
    """fp32/bf16 through ``torch._grouped_mm`` (the default where it exists): equal to the per-token definition within the stated tolerance (relative to the
    output scale), equal to the padded-bmm kernel, and neither the forward nor the backward
    reads a tensor on the host."""
    from meshfold.models.moe_experts import _Groups, grouped_gemm_supported, grouped_linear

    cfg = tiny(moe_experts=8, moe_topk=3, moe_shared_experts=1, moe_aux_loss_coef=0.01, moe_z_loss_coef=1e-3)
    moe = build_moe(cfg).train()
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    want = naive_moe(moe, x, cfg)
    moe = moe.to(dtype)
    xl = x.to(dtype).requires_grad_()
    assert grouped_gemm_supported(xl)
    with no_host_reads():
        got = moe(xl)
        got.float().pow(2).sum().backward()
    scale = want.abs().max()
    assert float((got.detach().double() - want).abs().max() / scale) < tol
    assert moe.pop_aux() is not None  # the aux-loss statistics were built without host reads
    # The grouped GEMM and the padded bmm agree, values and weight gradients.
    w = moe.experts.w13.detach().clone().requires_grad_()
    rows = torch.randn(10, 16, dtype=dtype)
    counts = torch.tensor([3, 0, 4, 0, 0, 2, 1, 0])
    out, grads = [], []
    for kernel in ("grouped_mm", "padded_bmm"):
        y = grouped_linear(rows, w, _Groups(counts, 10, kernel))
        out.append(y)
        grads.append(torch.autograd.grad(y, w, torch.ones_like(y))[0])
    torch.testing.assert_close(out[0], out[1], rtol=tol, atol=tol)
    torch.testing.assert_close(grads[0], grads[1], rtol=tol, atol=tol)
    assert (grads[0][[1, 3, 4, 7]] == 0).all()  # experts without tokens: zero gradient


def test_aligned_groups_equal_unaligned(monkeypatch):
    """The grouped GEMM's 16-byte group padding (CUDA's layout, run here on the CPU kernel by
    asking for it): the same output and gradients as the unpadded groups the CPU uses."""
    from meshfold.models import moe_experts

    cfg = tiny(moe_experts=8, moe_topk=3)
    moe = build_moe(cfg).float().train()
    x = torch.randn(3, 8, 16)
    results = []
    for align in (1, 4):
        monkeypatch.setattr(moe_experts, "group_align", lambda t, a=align: a)
        xg = x.clone().requires_grad_()
        out = moe(xg)
        grads = torch.autograd.grad(out.square().sum(), [xg, moe.experts.w13, moe.experts.w2])
        results.append((out.detach(), *grads))
        moe.end_step()
        moe.pop_aux()
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def naive_capacity_moe(moe: MoE, x: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, int]:
    """The capacity definition in plain Python: per sequence, each expert takes the first
    C = ceil(c s k / E) assignments of its queue (first choices of every position, then second
    choices, ...); the rest are dropped. (Output, assignments dropped.)"""
    b, s, _ = x.shape
    k, E = cfg.moe_topk, cfg.moe_experts
    cap = math.ceil(cfg.moe_capacity_factor * s * k / E)
    out, dropped = torch.zeros_like(x), 0
    for q in range(b):
        logits = x[q] @ moe.router.weight.t()
        scores = logits.softmax(-1)
        idx = scores.topk(k, dim=-1).indices
        taken = [0] * E
        for j in range(k):
            for t in range(s):
                e = int(idx[t, j])
                if taken[e] >= cap:
                    dropped += 1
                    continue
                taken[e] += 1
                g = scores[t, e] / (scores[t, idx[t]].sum() if cfg.moe_norm_topk else 1.0)
                (w1, w3), w2 = moe.experts.w13[e].chunk(2), moe.experts.w2[e]  # w13: w1's rows, then w3's
                out[q, t] += g * (w2 @ (F.silu(w1 @ x[q, t]) * (w3 @ x[q, t])))
    return out, dropped


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_capacity_matches_naive_without_host_reads(factor):
    """Capacity mode runs in fixed slots (padded, ``CapacitySlots``): the same output and the
    same dropped assignments as the plain definition, float64, and neither the forward nor the
    backward reads a tensor on the host (the router and expert weights get gradients)."""
    cfg = tiny(moe_capacity_factor=factor, moe_norm_topk=True)
    moe = build_moe(cfg).train()
    x = torch.randn(3, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    want, dropped = naive_capacity_moe(moe, x, cfg)
    if factor < 1.5:
        assert dropped > 0  # the case really drops
    xg = x.clone().requires_grad_()
    with no_host_reads():
        got = moe(xg)
        got.pow(2).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert int(moe.end_step()["dropped"]) == dropped
    xn = x.clone().requires_grad_()
    ref = build_moe(cfg)
    naive_capacity_moe(ref, xn, cfg)[0].pow(2).sum().backward()
    torch.testing.assert_close(xg.grad, xn.grad, rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
