"""The planner split by concern: attention kinds behind a registry, multi-token prediction
as arithmetic over its depth, typed layer terms, no planner module over 500 lines."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshfold.models.presets import preset
from meshfold.planner import mtp
from meshfold.planner.attention import VARIANTS, AttentionTerms, attention_terms
from meshfold.planner.attention.gqa import GroupedQuery
from meshfold.planner.attention.mla import LatentAttention
from meshfold.planner.cluster import load_cluster
from meshfold.planner.cost import CostModel, Layout, Workload
from meshfold.planner import kernels, layer
from meshfold.planner.kernels import fp8_cast_elements, layer_gemms
from meshfold.planner.step import MEGATRON_OPTIMIZER_BYTES
from meshfold.planner.terms import BlockTerms, LayerTerms, TpCalls


def test_attention_kind_is_looked_up_by_the_config():
    assert isinstance(attention_terms(preset("llama3-8b")), GroupedQuery)
    assert isinstance(attention_terms(preset("deepseek-v3")), LatentAttention)
    assert set(VARIANTS) >= {"gqa", "mla"}


def test_a_new_attention_kind_plugs_in_with_one_registration(monkeypatch):
    class Wider(GroupedQuery):
        def gemms(self, m, tp):
            return [(2 * x, k) for x, k in super().gemms(m, tp)]

    m = preset("llama3-8b")
    base = layer_gemms(m, 2, False)
    monkeypatch.setitem(VARIANTS, "gqa", Wider())
    assert layer_gemms(m, 2, False)[:4] == [(2 * x, k) for x, k in base[:4]]
    assert layer_gemms(m, 2, False)[4:] == base[4:]
    assert issubclass(Wider, AttentionTerms)


def test_mtp_terms_vanish_without_depth():
    m = preset("llama3-8b")
    cm = CostModel(Workload(m, global_batch=32), load_cluster("h100", devices=16))
    T = cm.layer_terms(2, False, 1, "ring", 1, 1, "none")
    assert mtp.heads_terms(m, T, 4) == (0.0, 0.0, 0.0)
    assert mtp.saved_logits(m, 123.5, 2, True, 4096) == 123.5
    assert mtp.head_kinds(m, cm.kinds) == [] and mtp.embedding_exchanges(m, False) == 0
    deep = dataclasses.replace(m, mtp_depth=2)
    assert mtp.extra_params(deep, 4, 10.0) == 2 * (2 * m.dim ** 2 + 3 * m.dim) + 10.0
    assert mtp.heads_on(deep, True) == 2 and mtp.heads_on(deep, False) == 0


def test_layer_terms_are_typed():
    cm = CostModel(Workload(preset("mixtral-8x7b"), global_batch=64), load_cluster("h100", devices=64))
    T = cm.layer_terms(2, True, 1, "ring", 4, 1, "selective", 0, 2)
    assert isinstance(T, LayerTerms) and all(isinstance(b, BlockTerms) for b in T.kinds.values())
    assert isinstance(T.traffic.tp_layer, TpCalls) and T.traffic.tp_moe.calls > 0
    assert T.params.expert_p > 0 and T.time.tp_ar > 0 and T.acts.act_kinds[True] > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        T.tokens = 0
    est = cm.estimate(Layout(dp_shard=8, tp=2, sp=True, pp=4, ep=4, micro_batch=1, recompute="selective",
                             ep_overlap_chunks=2))
    assert est.step_time_s > 0 and est.collectives["ep"]["count"] > 0


def test_no_planner_module_over_500_lines():
    root = Path(__file__).resolve().parents[1] / "meshfold" / "planner"
    sizes = {p.relative_to(root).as_posix(): p.read_text().count("\n") for p in root.rglob("*.py")}
    assert max(sizes.values()) <= 500, sizes


def test_fp8_casts_and_megatron_optimizer_bytes_follow_the_code_that_runs(monkeypatch):
    # torchao's Float8Linear casts each linear's input forward, and backward its output
    # gradient twice (one layout per GEMM) and its input again; each weight once each way (issue 44)
    assert fp8_cast_elements([(8.0, 4.0), (3.0, 5.0)]) == (9.0, 2 * 11.0 + 9.0)
    m = preset("llama3-8b")
    cluster = load_cluster("h100", devices=8)

    def block(cast_bytes: int) -> BlockTerms:
        monkeypatch.setitem(layer.FP8_CAST_BYTES, "fused", cast_bytes)
        cm = CostModel(Workload(m, global_batch=8, kernels="fused", fp8=True), cluster)
        return cm.layer_terms(1, False, 1, "ring", 1, 1, "none").kinds[False]

    with_casts, without = block(5), block(0)
    shapes = layer_gemms(m, 1, False)
    f, b = fp8_cast_elements(shapes)
    weights = sum(n * k for n, k in shapes)
    tokens = m.seq_len
    bw = cluster.device.hbm_GBps * 1e9 * cluster.device.hbm_eff
    assert with_casts.fwd - without.fwd == pytest.approx(5 * (tokens * f + weights) / bw)
    assert with_casts.bwd - without.bwd == pytest.approx(5 * (tokens * b + weights) / bw)
    # Megatron's fp16 optimizer moves 58 bytes a parameter where the generic pass moves 38
    gpt = dataclasses.replace(m, n_layers=4)
    layout = Layout(dp_replicate=2, tp=4, micro_batch=1)
    a100 = load_cluster("a100", devices=8)
    generic = CostModel(Workload(gpt, global_batch=8, dtype="bf16"), a100).estimate(layout).time["optimizer"]
    megatron = CostModel(Workload(gpt, global_batch=8, dtype="bf16", fp16_optimizer=True), a100).estimate(layout)
    assert MEGATRON_OPTIMIZER_BYTES == 58
    assert megatron.time["optimizer"] == pytest.approx(generic * 58 / 38)


def test_the_eager_loss_prices_its_broadcast_subtractions_at_their_measured_rate():
    # the chunked loss's logits - max (forward) and logits - lse (backward): bf16 in, fp32 out,
    # a broadcast operand: PyTorch's non-vectorized path, 0.268 of the H200's HBM (issue 44)
    m = preset("llama3-8b")
    h200 = load_cluster("h200", devices=1)
    plain = dataclasses.replace(h200, device=dataclasses.replace(h200.device, broadcast_hbm_eff=0.0))

    def out_layer(cluster):
        T = CostModel(Workload(m, global_batch=1), cluster).layer_terms(1, False, 1, "ring", 1, 1, "none")
        return T.time.out_fwd, T.time.out_bwd

    (f, b), (f0, b0) = out_layer(h200), out_layer(plain)
    d = h200.device
    hbm = d.hbm_GBps * 1e9
    extra = (2 + 4) * m.seq_len * m.vocab_size * (1 / (hbm * d.broadcast_hbm_eff) - 1 / (hbm * d.eager_hbm_eff))
    assert f - f0 == pytest.approx(extra) and b - b0 == pytest.approx(extra)
    fused = CostModel(Workload(m, global_batch=1, kernels="fused"), h200).layer_terms(1, False, 1, "ring", 1, 1, "none")
    fused0 = CostModel(Workload(m, global_batch=1, kernels="fused"), plain).layer_terms(1, False, 1, "ring", 1, 1, "none")
    assert fused.time.out_fwd == fused0.time.out_fwd  # (Megatron's and compiled runs' profile: not this path)


def test_moe_blocks_price_their_routing_bytes(monkeypatch):
    # gather_rows, the gates, scatter_add_rows and their gradients (models/moe.py), by the bytes
    # they move per routed row and token; dense blocks have none (issue 44 item 4)
    m = preset("mixtral-8x7b")
    cluster = load_cluster("h100", devices=8)

    def kinds():
        return CostModel(Workload(m, global_batch=8), cluster).layer_terms(2, True, 1, "ring", 1, 1, "none").kinds

    priced = kinds()
    monkeypatch.setattr(layer, "moe_routing_bytes", lambda *args: (0.0, 0.0))
    bare = kinds()
    rf, rb = kernels.moe_routing_bytes(m, 2, True, 2, m.moe_topk)
    bw = cluster.device.hbm_GBps * 1e9 * cluster.device.eager_hbm_eff
    assert True in priced
    assert priced[True].fwd - bare[True].fwd == pytest.approx(m.seq_len * rf / bw)
    assert priced[True].bwd - bare[True].bwd == pytest.approx(m.seq_len * rb / bw)


def test_sandwich_and_qk_norms_are_memory_bound_work():
    # Gemma 3 normalises the attention and MLP outputs too (registry.post_norms) and each head's
    # q and k (qk_norm): two more norms over the residual width and one over q and k (issue 44)
    g = dataclasses.replace(preset("gemma-3-1b"), n_layers=2)
    plain = dataclasses.replace(g, qk_norm=False, sandwich_norm=False)
    eager = [kernels.elementwise_bytes(x, 1, g.seq_len, 1, False, 2, True, True, False, "eager")[0] for x in (g, plain)]
    qk = (g.n_heads + g.kv_heads) * g.head_dim
    assert eager[0] - eager[1] == pytest.approx(2 * 28 * g.dim + (28 + 4 * 2) * qk)
    fused = [kernels.elementwise_bytes(x, 1, g.seq_len, 1, False, 2, True, True, False, "fused") for x in (g, plain)]
    assert fused[0][0] - fused[1][0] == pytest.approx(2 * 4 * g.dim + 4 * qk)
    assert fused[0][3] - fused[1][3] == pytest.approx(2 * 6 * g.dim + 6 * qk)


def test_dropless_routed_experts_run_at_the_grouped_gemm_rate():
    # torch._grouped_mm's experts at Device.grouped_gemm_eff of the dense rate (H200-measured);
    # the shared experts' share and a capacity's batched matmul stay dense (issue 44 item 4)
    h100 = load_cluster("h100", devices=8)
    dense_dev = dataclasses.replace(h100, device=dataclasses.replace(h100.device, grouped_gemm_eff=0.0))

    def compute(m, cluster):
        kinds = CostModel(Workload(m, global_batch=8), cluster).layer_terms(1, False, 1, "ring", 1, 1, "none").kinds
        return kinds[True].compute_fwd

    m = dataclasses.replace(preset("mixtral-8x7b"), moe_shared_experts=1)
    share = m.moe_topk / (m.moe_topk + 1)
    grouped, dense = compute(m, h100), compute(m, dense_dev)
    d = h100.device
    mlp = sum(kernels.gemm_time(d, m.seq_len, n, k, m.dim, 2) for n, k in kernels.layer_gemms(m, 1, True)[-3:])
    assert grouped - dense == pytest.approx(mlp * share * (1 / d.grouped_gemm_eff - 1))
    capped = dataclasses.replace(m, moe_capacity_factor=1.25)
    assert compute(capped, h100) == compute(capped, dense_dev)


def test_a_registered_activation_prices_its_own_eager_ops():
    # gpt-oss's clamped SwiGLU runs 16 elements a hidden element eager (registry.mlp_elements),
    # silu(gate) * up 5: its routed experts' memory-bound bytes follow the registered count
    g = dataclasses.replace(preset("gpt-oss-20b"), n_layers=2)
    plain = dataclasses.replace(g, mlp="swiglu")
    args = (1, g.seq_len, 1, False, 2, True, True, False, "eager")
    moe = [kernels.elementwise_bytes(x, *args, moe=True)[0] for x in (g, plain)]
    f = g.moe_topk * g.expert_dim
    assert moe[0] - moe[1] == pytest.approx((16 - 5) * 2 * f)
    assert kernels.elementwise_bytes(g, *args)[0] == kernels.elementwise_bytes(plain, *args)[0]  # dense blocks
