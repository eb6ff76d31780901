"""Issue 44's terms, each priced as the code that runs does it: NCCL's share of an NVLink,
Megatron's overlapped tensor-parallel backward, the per-micro-batch gradient accumulation,
fused kernels' backward bytes, backward GEMMs by their shapes and Ampere's GEMM epilogue.
Arithmetic only: no timing, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshfold.config import ConfigError
from meshfold.models.config import ModelConfig
from meshfold.planner.cluster import DEVICES, cluster_from_dict, load_cluster
from meshfold.planner.cost import CostModel, Layout, Workload, estimate
from meshfold.planner.counts import DTYPE_BYTES
from meshfold.planner.kernels import elementwise_bytes, gemm_backward_time, gemm_time

GPT = ModelConfig(dim=1024, n_layers=4, n_heads=16, vocab_size=4096, seq_len=1024, norm="layernorm",
                  mlp="gelu", bias=True, pos="learned", tie_embeddings=True)


def test_nvlink_at_nccl_rate_and_files_keep_theirs():
    """NVLink presets carry NCCL's per-link rate (src/graph/topo.h) of the line rate; the
    inter-node links and a cluster file without the field are as given."""
    a100, h100 = load_cluster("a100", devices=16), load_cluster("h100", devices=16)
    assert a100.link(1, 8)[1] == pytest.approx(300e9 * 20.0 / 25.0)
    assert h100.link(1, 8)[1] == pytest.approx(450e9 * 20.6 / 25.0)
    assert a100.link(1, 16)[1] == 25e9 and h100.link(1, 16)[1] == 50e9
    own = cluster_from_dict({"devices_per_node": 8, "device": "h100-sxm", "intra_node_GBps": 450.0})
    assert own.intra_node_eff == 1.0 and own.link(1, 8)[1] == 450e9
    with pytest.raises(ConfigError, match="intra_node_eff"):
        cluster_from_dict({"preset": "h100-dgx", "intra_node_eff": 1.5})


def test_megatron_overlaps_the_column_parallel_backward():
    """With ``tp_overlap`` the column-parallel linears' input-gradient reductions (sp: and
    the input's re-gather) run beside a GEMM: the backward waits less, never less than the
    row-parallel gathers sp leaves exposed; the forward is the same."""
    c = load_cluster("a100", devices=8)
    for sp in (False, True):
        plain = CostModel(Workload(GPT, 8, flash=False, kernels="fused"), c).layer_terms(8, sp, 1, "ring", 1, 1, "none")
        over = CostModel(Workload(GPT, 8, flash=False, kernels="fused", tp_overlap=True), c).layer_terms(
            8, sp, 1, "ring", 1, 1, "none")
        tp_ar = plain.time.tp_ar
        saved = plain.kinds[False].bwd - over.kinds[False].bwd
        assert over.kinds[False].fwd == plain.kinds[False].fwd
        assert 0 < saved <= 2 * tp_ar * (1 + 1e-12)  # at most the two column-parallel all-reduces' worth
        # what still waits: the sp gathers (one all-reduce's worth) at least
        assert over.kinds[False].bwd > plain.kinds[False].bwd - (2 + sp) * tp_ar + (tp_ar if sp else 0.0) - 1e-12


def test_gradient_accumulation_pass_unless_fused():
    """Each micro-batch after the first adds its weight gradients into the held ones (read
    both, write one), unless the GEMM accumulates them (Megatron's fusion); bf16-amp's casts
    already hold it."""
    c = load_cluster("a100", devices=8)
    lay = Layout(dp_replicate=8, micro_batch=1)
    gb = DTYPE_BYTES["bf16"][1]
    plain, fused = (CostModel(Workload(GPT, 32, wgrad_fused=f), c) for f in (False, True))
    n_micro = 32 // 8
    p_stage = plain.estimate(lay).param_bytes / DTYPE_BYTES["bf16"][0]
    extra = plain.estimate(lay).time["casts_and_copies"] - fused.estimate(lay).time["casts_and_copies"]
    assert extra == pytest.approx((n_micro - 1) * 3 * gb * p_stage / plain.bw, rel=1e-9)
    one = Layout(dp_replicate=8, micro_batch=4)  # one micro-batch: nothing to accumulate
    assert plain.estimate(one).time["casts_and_copies"] == fused.estimate(one).time["casts_and_copies"] == 0.0


def test_fused_backward_bytes_counted_by_kernel():
    """Eager backward: twice the forward's bytes; fused groups' backward kernels move less
    (e.g. softmax reads y and dy and writes dx: 3a against twice 2a)."""
    for flash, dropout in ((False, True), (True, False)):
        fwd, attn, sums, bwd = elementwise_bytes(GPT, 1, 1024, 8, False, 2, False, flash, dropout, "eager")
        assert bwd == pytest.approx(2 * fwd)
        fwd, attn, sums, bwd = elementwise_bytes(GPT, 1, 1024, 8, False, 2, False, flash, dropout, "fused")
        assert 0.5 * fwd < bwd < 2 * fwd  # (an add's gradient passes through: no kernel)


def test_gemm_epilogue_on_ampere_only():
    """On the A100 a GEMM with a shorter k than MAMF's shape pays its tiles' writes (k0 = the
    machine balance, 146 k-steps); from that k on, MAMF; on Hopper's persistent kernels large
    GEMMs stay at MAMF. Backward GEMMs by their shapes."""
    a100, h100 = DEVICES["a100-80gb"], DEVICES["h100-sxm"]
    m, n = 8192, 6144
    per_flop = {k: gemm_time(a100, m, n, k, 1) / (2 * m * n * k) for k in (768, 2048, 8192)}
    k0 = 2 * a100.peak_tflops * 1e12 * a100.matmul_eff / (2 * a100.hbm_GBps * 1e9 * a100.hbm_eff)
    assert 140 < k0 < 150 and a100.gemm_epilogue_k == 2048
    assert per_flop[768] / per_flop[2048] == pytest.approx((1 + k0 / 768) / (1 + k0 / 2048), rel=1e-9)
    assert per_flop[8192] == pytest.approx(per_flop[2048], rel=1e-9)
    no_epilogue = replace(a100, gemm_epilogue_k=0)
    assert gemm_time(no_epilogue, m, n, 8192, 1) == gemm_time(a100, m, n, 8192, 1)
    assert gemm_time(no_epilogue, m, n, 768, 1) < gemm_time(a100, m, n, 768, 1)
    big = gemm_time(h100, 16384, 4096, 4096, 4096)
    assert big == pytest.approx(2 * 16384 * 4096**2 / (h100.peak_tflops * 1e12 * h100.matmul_eff), rel=0.05)
    dgrad, wgrad = gemm_backward_time(a100, m, n, 768, 1)
    assert dgrad == gemm_time(a100, m, 768, n, 1) and wgrad == gemm_time(a100, 768, n, m, 1)
    # the weight gradient's inner dimension is the tokens: a short-k forward has a long-k wgrad
    assert wgrad < gemm_time(a100, m, n, 768, 1)


def test_published_jobs_priced_as_run():
    """Korthikanti's 2022 runs use Megatron's overlapped, accumulation-fused linears; the
    2021 runs (Narayanan) do not."""
    from meshfold.planner.published import KORTHIKANTI, MEGATRON, rows

    for r in rows():
        if r.source == KORTHIKANTI:
            assert r.workload["tp_overlap"] and r.workload["wgrad_fused"]
        if r.source == MEGATRON:
            assert not r.workload.get("tp_overlap") and not r.workload.get("wgrad_fused")
    est = estimate(Workload(GPT, 8, flash=False, kernels="fused", tp_overlap=True, wgrad_fused=True),
                   load_cluster("a100", devices=8), Layout(tp=8, micro_batch=1))
    assert est.step_time_s > 0


def test_megatron_scatter_gather_and_fp32_weight_gradients():
    """Megatron's pipeline sends split over tp and re-gathered (no sp) cost less than whole
    ones across nodes; under sp they are split already. A weight gradient accumulated in fp32
    by its GEMM (8 bytes an output) pays more for its tiles' writes on the A100."""
    c = load_cluster("a100", devices=32)
    lay = Layout(dp_replicate=2, tp=8, pp=2, micro_batch=1)
    plain, split = (estimate(Workload(GPT, 16, flash=False, pp_scatter_gather=f), c, lay).step_time_s
                    for f in (False, True))
    assert split < plain
    lay_sp = replace(lay, sp=True)
    assert (estimate(Workload(GPT, 16, flash=False, pp_scatter_gather=True), c, lay_sp).step_time_s
            == estimate(Workload(GPT, 16, flash=False), c, lay_sp).step_time_s)
    a100 = DEVICES["a100-80gb"]
    bf16, fp32 = (gemm_backward_time(a100, 2048, 1536, 12288, 1, wgrad_fused=f) for f in (False, True))
    assert bf16[0] == fp32[0] and fp32[1] > bf16[1]


def test_eager_kernels_at_their_measured_bandwidth():
    """Hopper's eager memory-bound kernels run at the fraction measured on an H200
    (``eager_hbm_eff``); the fused profile, the optimizer pass and A100s keep ``hbm_eff``."""
    c = load_cluster("h100", devices=8)
    plain = replace(c, device=replace(c.device, eager_hbm_eff=0.0))
    lay = Layout(dp_shard=8, zero=3, micro_batch=1)
    for kernels, slower in (("eager", True), ("fused", False)):
        w = Workload(GPT, 8, kernels=kernels)
        a, b = estimate(w, c, lay), estimate(w, plain, lay)
        assert (a.step_time_s > b.step_time_s) == slower
        assert a.time["optimizer"] == b.time["optimizer"]
    assert 0 < c.device.eager_hbm_eff < c.device.hbm_eff and DEVICES["a100-80gb"].eager_hbm_eff == 0.0


def test_cp_ring_and_expert_all_to_all_contention():
    """The ring's hops and the pipelined expert all-to-all chunks that hide behind compute
    slow it by ``overlap_slowdown`` of their hidden seconds, as the data-parallel traffic does."""
    from meshfold.models.presets import preset

    c = load_cluster("h100", devices=16)
    calm = replace(c, device=replace(c.device, overlap_slowdown=0.0))
    w = Workload(preset("llama3-8b"), 8, 32768)
    busy, free = (CostModel(w, x).layer_terms(1, False, 8, "ring", 1, 1, "none") for x in (c, calm))
    assert busy.time.cp_fwd > free.time.cp_fwd and busy.kinds[False].fwd > free.kinds[False].fwd
    moe = Workload(preset("mixtral-8x7b"), 8, 4096)
    busy, free = (CostModel(moe, x).layer_terms(1, False, 1, "ring", 8, 1, "none", 0, 4) for x in (c, calm))
    assert busy.kinds[True].fwd > free.kinds[True].fwd and busy.kinds[True].bwd > free.kinds[True].bwd
