"""``meshfold dry-run`` of MoE layouts: routing is data, which fake tensors do not carry, so the
dispatch asks for its counts through one seam (``models/moe.py``: ``count_rows`` /
``read_counts``) that gives a perfectly balanced router's counts on tensors without values,
the planner's assumption. Checked here: the seam is exactly ``bincount`` / ``tolist`` on real
tensors and the balanced counts on fake ones; the dry-run runs the real code (a real gloo run
of the same layout sends the same collectives, bytes of every data-independent dimension
equal); and runtime and planner agree (model state within 2 %, activations within 10 %,
collective calls per dimension equal, expert-parallel all-to-all bytes equal)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from meshfold.testing import one_step_report, run_on, tiny_config

ROOT = Path(__file__).resolve().parent.parent
MOE = {"moe_experts": 8, "moe_topk": 2}


def test_balanced_counts_seam_is_bincount_on_real_tensors_and_balanced_on_fake_ones():
    from meshfold.models.moe import balanced_counts
    from meshfold.models.moe_experts import count_rows, read_counts

    assert balanced_counts(12, 8) == [2, 2, 2, 2, 1, 1, 1, 1] and sum(balanced_counts(1000, 7)) == 1000
    key = torch.tensor([3, 0, 3, 5, 0, 3])
    assert torch.equal(count_rows(key, 8, lambda: [9] * 8), torch.bincount(key, minlength=8))
    assert read_counts(torch.bincount(key, minlength=8)[:4], lambda: [9]) == [2, 0, 0, 3]
    with FakeTensorMode():
        fake = torch.randint(0, 8, (64,))
        counts = count_rows(fake, 8, lambda: balanced_counts(64, 8))
        assert counts.shape == (8,) and counts.dtype == torch.int64
        assert read_counts(counts.sum(), lambda: 64) == 64


def test_compiled_moe_reads_the_real_routing():
    # torch.compile traces with fake tensors too: the compiled block must still count and read
    # the real routing (``has_values`` answers True while compiling; balanced counts baked into
    # a graph would compute the wrong rows). A skewed router
    # (one expert takes most tokens) makes balanced and real counts differ. float64: the
    # padded kernel (torch's shape function for the grouped GEMM takes bf16 only).
    from meshfold.models.config import ModelConfig
    from meshfold.models.moe import MoE

    torch.manual_seed(0)
    for capacity in (0.0, 1.0):
        moe = MoE(ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=32, seq_len=8, moe_experts=4, moe_topk=2,
                              moe_capacity_factor=capacity)).double().eval()
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.5)
        with torch.no_grad():
            moe.router.weight[0] += 3.0
        x = torch.randn(2, 8, 16, dtype=torch.float64)
        with torch.no_grad():
            eager = moe(x)
            torch._dynamo.reset()
            compiled = torch.compile(moe, backend="aot_eager")(x)
        torch.testing.assert_close(compiled, eager)


def test_moe_dry_run_matches_a_real_run(tmp_path):
    # ep 2 folded on FSDP 4 (float64, the padded expert kernel): the same parameter bytes,
    # collective calls on every dimension, and data-parallel bytes (FSDP and the balance
    # statistics do not depend on the routing); ep bytes depend on where the real router
    # sends the tokens, so only their call count is compared with the real run.
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run

    cfg = tiny_config(str(tmp_path), model=MOE, parallel={"dp_shard": 4, "ep": 2, "zero": 3},
                      train={"steps": 1, "micro_batch": 1})
    real = run_on(4, one_step_report, cfg)
    dry = dry_run(from_dict(cfg), 4, cluster="cpu")
    assert dry["runtime"]["param_bytes"] == max(r["param_bytes"] for r in real)
    sim = dry["runtime"]["ranks"]["0"]["collectives"]
    assert {d: x["count"] for d, x in sim.items()} == {d: x["count"] for d, x in real[0]["collectives"].items()}
    assert sim["dp"] == real[0]["collectives"]["dp"]
    assert sim["ep"]["count"] == 2 * 5 * 2  # micro-batches x (counts, dispatch, combine, 2 backward) x layers


# Runtime vs planner in a GPU run's numerics (bf16 autocast over fp32 weights, fused attention),
# as tests/test_dryrun.py does for dense layouts. The planner assumes a balanced router; the
# dry-run simulates exactly that, so every collective's bytes agree too (not only its count).
AGREEMENT = [
    pytest.param(8, {"dp_shard": 8, "ep": 4, "zero": 3}, {}, id="ep4-fsdp8-zero3"),
    pytest.param(8, {"tp": 2, "dp_shard": 4, "ep": 2, "zero": 3}, {}, id="ep2xtp2-fsdp4-zero3"),
    pytest.param(8, {"tp": 2, "dp_shard": 4, "ep": 4, "zero": 3}, {}, id="ep4xtp2-edp1"),  # experts: no FSDP peers
    # 4 experts at ep 2: E_l = 2 local experts over edp = 4 ranks (HSDP 2 x 4: the experts' FSDP
    # group spans the replicas; the router's 4 rows divide dp_shard), sharded on dim 1, no padding
    pytest.param(8, {"dp_replicate": 2, "dp_shard": 4, "ep": 2, "zero": 3}, {"moe_experts": 4},
                 id="ep2-hsdp2x4-experts-dim1"),
    pytest.param(4, {"tp": 2, "dp_shard": 2, "zero": 3},
                 {"n_layers": 3, "moe_first_dense": 1, "moe_shared_experts": 1}, id="tp2-experts-dense+moe-shared"),
    pytest.param(8, {"pp": 2, "dp_shard": 4, "ep": 2, "zero": 3, "pp_microbatches": 2},
                 {"n_layers": 4, "moe_capacity_factor": 0.5}, id="pp2xep2-capacity0.5"),
    # ep over DDP / ZeRO-1 data parallel (DeepSeek-V3's layout): dense gradients all-reduced over
    # dp x cp, the experts' over edp; ZeRO-1 shards (and gathers in bf16) each part over its own
    # ranks, the fp32 masters only for the rank's segments
    pytest.param(8, {"dp_shard": 8, "ep": 4, "zero": 1}, {}, id="ep4-dp8-zero1"),
    pytest.param(8, {"dp_replicate": 8, "dp_shard": 1, "ep": 2, "zero": 0}, {}, id="ep2-ddp8-zero0"),
    pytest.param(8, {"pp": 2, "dp_shard": 4, "ep": 2, "zero": 1, "pp_microbatches": 2}, {"n_layers": 4},
                 id="pp2xep2-dp4-zero1"),
    pytest.param(8, {"tp": 2, "dp_shard": 4, "ep": 2, "zero": 1}, {}, id="ep2xtp2-dp4-zero1"),
    # sequence parallel: each tp rank routes its slice; tokens, experts and gates gathered over
    # tp around the experts, sums reduce-scattered back; stats and router gradient over tp
    pytest.param(4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 3},
                 {"n_layers": 3, "moe_first_dense": 1, "moe_shared_experts": 1}, id="tp2-sp-dense+moe-shared"),
    # a capacity under sp: the chosen experts gathered for the whole sequences' slots
    pytest.param(8, {"tp": 2, "sp": True, "dp_shard": 4, "ep": 2, "zero": 3},
                 {"moe_capacity_factor": 1.0, "recompute": "full"}, id="ep2xtp2-sp-capacity-full"),
    # the all-to-all pipelined in chunks: n times the dispatches and combines, the same bytes
    # (dropless: one counts exchange, n chunks' counts in it)
    pytest.param(8, {"dp_shard": 8, "ep": 4, "zero": 3, "ep_overlap_chunks": 3}, {}, id="ep4-overlap3"),
    pytest.param(8, {"tp": 2, "dp_shard": 4, "ep": 2, "zero": 3, "ep_overlap_chunks": 2},
                 {"moe_capacity_factor": 1.0}, id="ep2xtp2-capacity-overlap2"),
    # expert tp (parallel.expert_tp = tp): each expert split over tp, every tp rank dispatching all
    # its tokens' rows; 4 experts at ep 4 x tp 2 (whole experts could not fold so)
    pytest.param(8, {"tp": 2, "dp_shard": 4, "ep": 4, "expert_tp": 2, "zero": 3}, {"moe_experts": 4},
                 id="ep4xetp2-fsdp4-4experts"),
    pytest.param(8, {"tp": 2, "sp": True, "dp_shard": 4, "ep": 2, "expert_tp": 2, "zero": 1}, {},
                 id="ep2xetp2-sp-dp4-zero1"),
    pytest.param(4, {"tp": 2, "dp_shard": 2, "expert_tp": 2, "zero": 3}, {}, id="ep1-etp2-fsdp2"),
    pytest.param(8, {"tp": 2, "dp_shard": 4, "ep": 2, "expert_tp": 2, "zero": 3}, {"moe_experts": 2},
                 id="ep2xetp2-edp2-1expert"),  # FSDP2 on the dims tp leaves whole; the router's 2 rows padded to 4
]


def test_moe_dry_runs_agree_with_planner(tmp_path):
    # Every AGREEMENT layout in one pool of simulated ranks (dry_run_many: both cores busy):
    # model state within 2 %, activations within 10 %, every dimension's call count equal, and
    # dp, ep and tp bytes equal (to rounding).
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run_many

    cases = []
    for p in AGREEMENT:
        world, parallel, model = p.values
        model = dict(model)
        train = {"steps": 1, "micro_batch": 1, "dtype": "bfloat16", "recompute": model.pop("recompute", "none")}
        cfg = tiny_config(str(tmp_path / p.id), parallel=parallel, train=train)
        cfg["model"].update({"dim": 64, "seq_len": 64, "vocab_size": 512, **MOE, **model})
        cases.append((from_dict(cfg), world))
    bad = []
    for p, out in zip(AGREEMENT, dry_run_many(cases, cluster="h100")):
        if isinstance(out, Exception):
            bad.append(f"{p.id}: {type(out).__name__}: {out}")
            continue
        rt, pl = out["runtime"], out["planner"]
        for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            if pl[field] != pytest.approx(rt[field], rel=0.02):
                bad.append(f"{p.id} {field}: {rt[field]} vs {pl[field]}")
        if pl["activation_bytes"] != pytest.approx(rt["activation_bytes"], rel=0.10):
            bad.append(f"{p.id} activation_bytes: {rt['activation_bytes']} vs {pl['activation_bytes']}")
        counts = ({d: x["count"] for d, x in rt["collectives"].items()},
                  {d: x["count"] for d, x in pl["collectives"].items()})
        if counts[0] != counts[1]:
            bad.append(f"{p.id} counts: {counts[0]} vs {counts[1]}")
        for dim in ("dp", "ep", "tp"):
            if dim in rt["collectives"] and \
                    pl["collectives"][dim]["bytes"] != pytest.approx(rt["collectives"][dim]["bytes"], rel=1e-6):
                bad.append(f"{p.id} {dim} bytes: {rt['collectives'][dim]['bytes']} vs {pl['collectives'][dim]['bytes']}")
    assert not bad, "\n".join(bad)


def test_latent_attention_under_tp_agrees_with_planner():
    # DeepSeek's latent attention with its heads split over tp (parallel/tp/mla.py): the
    # latent gathered (sp) or entered instead of the block input, the down-projections whole
    # on every rank; low-rank and full-rank q, each recompute mode, with MoE blocks. Width
    # 512, head widths 64 + 32 (v 64, zero-padded to 96 for the fused kernel).
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run_many
    from tests.test_dryrun_matrix import disagreements

    cases = []
    for q_rank, sp, recompute, moe in [(96, True, "none", False), (0, False, "none", False),
                                        (0, True, "selective", False), (96, True, "full", True)]:
        cfg = tiny_config("/nonexistent", parallel={"tp": 2, "sp": sp, "dp_shard": 2, "zero": 3},
                          train={"steps": 1, "dtype": "bfloat16", "recompute": recompute, "global_batch": 2,
                                 "micro_batch": 1})
        cfg["model"].update({"dim": 512, "n_layers": 2, "n_heads": 4, "n_kv_heads": 0, "vocab_size": 4096,
                             "seq_len": 256, "mla_kv_rank": 128, "mla_q_rank": q_rank, "mla_rope_dim": 32,
                             "mla_nope_dim": 64, "mla_v_dim": 64, **(MOE if moe else {})})
        cases.append((f"q{q_rank}-tp2{'sp' if sp else ''}-{recompute}{'-moe' if moe else ''}", cfg))
    outs = dry_run_many([(from_dict(cfg), 4) for _, cfg in cases], cluster="h100")
    found = {}
    for (name, _), out in zip(cases, outs):
        found.update(disagreements(name, out))
    assert not found, found


def test_moe_sp_with_ep_and_full_recompute_collectives_agree(tmp_path):
    # ep 2 x tp 2 with sp under full recompute, with the sequence-wise balance loss: the
    # recomputed forward re-runs the three tp gathers, the per-sequence counts' tp sum and the
    # ep counts, dispatch and combine; every collective's calls and bytes agree (activations
    # under full recompute are item 1 of issue 27: dense layouts differ alike).
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run

    cfg = tiny_config(str(tmp_path), parallel={"tp": 2, "sp": True, "dp_shard": 4, "ep": 2, "zero": 3},
                      train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16", "recompute": "full"})
    cfg["model"].update({"dim": 64, "seq_len": 64, "vocab_size": 512, **MOE, "moe_seq_aux_loss_coef": 0.01})
    out = dry_run(from_dict(cfg), 8, cluster="h100")
    rt, pl = out["runtime"]["collectives"], out["planner"]["collectives"]
    assert {d: x["count"] for d, x in pl.items()} == {d: x["count"] for d, x in rt.items()}, (rt, pl)
    for dim in rt:
        assert pl[dim]["bytes"] == pytest.approx(rt[dim]["bytes"], rel=1e-6), (dim, rt, pl)


def test_moe_preset_at_1024_ranks(tmp_path):
    # deepseek-moe-16b (64 fine-grained experts, 2 shared, first layer dense) on 1,024 ranks:
    # tp 2 x pp 2 x dp 256 with ep 8, through the CLI; the two pipeline ranks are simulated.
    # Shortened to 4 layers and 2,048-token sequences to keep the test small.
    cfg = tmp_path / "ds.toml"
    cfg.write_text('[model]\npreset = "deepseek-moe-16b"\nn_layers = 4\nseq_len = 2048\n\n'
                   '[train]\nglobal_batch = 512\ndtype = "bfloat16"\n')
    out = subprocess.run([sys.executable, "-m", "meshfold", "dry-run", str(cfg), "--world", "1024", "--json",
                          "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--set", "parallel.dp_shard=256",
                          "--set", "parallel.ep=8", "--set", "parallel.zero=3"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rt, pl = report["runtime"], report["planner"]
    assert report["world"] == 1024 and sorted(rt["ranks"]) == ["0", "512"]
    for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert pl[field] == pytest.approx(rt[field], rel=0.02), (field, rt, pl)
    assert pl["activation_bytes"] == pytest.approx(rt["activation_bytes"], rel=0.10)
    assert {d: x["count"] for d, x in pl["collectives"].items()} == {d: x["count"] for d, x in rt["collectives"].items()}
    assert pl["collectives"]["ep"]["bytes"] == pytest.approx(rt["collectives"]["ep"]["bytes"], rel=1e-6)


def test_deepseek_v3_layout_at_2048_ranks(tmp_path):
    # DeepSeek-V3 in its own layout: pp 16, ep 64 over ZeRO-1 data parallel (dp 128, edp 2), no tp,
    # full recompute (docs/moe.md). The 4 distinct pipeline ranks are simulated, and the planner
    # prices each of them (rank 0: the embedding and the dense layers' fp32 gradients; a rank of
    # MoE layers holds more expert state, sharded over only 2 ranks): the states agree rank by
    # rank and so do their maxima; GradReducer's buckets of the latent-attention / MoE chunk are
    # counted exactly, so every collective's calls agree and their bytes within rounding.
    out = subprocess.run([sys.executable, "-m", "meshfold", "dry-run", "configs/llama3-8b.toml", "--world", "2048",
                          "--json", "--set", "model.preset=deepseek-v3", "--set", "parallel.pp=16",
                          "--set", "parallel.ep=64", "--set", "parallel.dp_shard=128", "--set", "parallel.zero=1",
                          "--set", "train.global_batch=15360", "--set", "train.micro_batch=1",
                          "--set", "train.recompute=full"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rt, pl = report["runtime"], report["planner"]
    assert sorted(rt["ranks"], key=int) == sorted(pl["ranks"], key=int) == ["0", "128", "256", "1920"]
    fields = ("param_bytes", "grad_bytes", "optimizer_bytes")
    for r, mine in rt["ranks"].items():
        for field in fields:
            assert pl["ranks"][r][field] == pytest.approx(mine[field], rel=0.02), (r, field, mine, pl["ranks"][r])
        assert pl["ranks"][r]["activation_bytes"] == pytest.approx(mine["activation_bytes"], rel=0.10), r
    for field in fields:  # the most over the same ranks on both sides (before: 1.34 vs 0.41 GiB parameters)
        assert pl[field] == pytest.approx(rt[field], rel=0.02), (field, rt, pl)
    assert rt["ranks"]["256"]["optimizer_bytes"] > 3 * rt["ranks"]["0"]["optimizer_bytes"]  # experts over edp = 2 only
    assert pl["activation_bytes"] == pytest.approx(rt["activation_bytes"], rel=0.10)
    assert {d: x["count"] for d, x in pl["collectives"].items()} == {d: x["count"] for d, x in rt["collectives"].items()}
    for dim in ("dp", "ep", "pp"):
        assert pl["collectives"][dim]["bytes"] == pytest.approx(rt["collectives"][dim]["bytes"], rel=1e-6), dim


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2-lite", "mixtral-8x7b", "moe-debug"])
def test_moe_chunk_param_sizes_are_the_models_parameters_in_order(preset):
    # What the planner counts GradReducer's buckets from: every parameter of the (meta) model in
    # registration order, the routed experts' marked, at ep 1 and (their local share) ep 4.
    from meshfold.config import from_dict
    from meshfold.models.llama import Transformer
    from meshfold.planner.counts import moe_chunk_param_sizes

    m = from_dict({"model": {"preset": preset, "n_layers": 4}}).model
    with torch.device("meta"):
        model = Transformer(m)
    want = [(p.numel(), ".experts." in name) for name, p in model.named_parameters()]
    assert moe_chunk_param_sizes(m, m.n_layers, True, True) == want
    assert moe_chunk_param_sizes(m, m.n_layers, True, True, ep=4) == [(n // 4 if x else n, x) for n, x in want]


def test_latent_attention_under_cp_agrees_with_planner(tmp_path):
    # A tiny deepseek-v2-lite-shaped model (MLA, q/k heads 16 + 8 wide, v 16; a dense first layer,
    # then MoE) under the latent ring (cp 2 over FSDP 2) and hybrid 2 x 2 (Ulysses all-to-alls of
    # the expanded heads, then the ring): model state within 2 %, activations within 10 %, every
    # dimension's calls equal, cp bytes within 2 % (they agree exactly: latent or heads per hop).
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run_many

    model = {"dim": 64, "seq_len": 64, "vocab_size": 512, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, **MOE,
             "moe_ffn_dim": 32, "moe_first_dense": 1, "mla_kv_rank": 32, "mla_rope_dim": 8, "mla_nope_dim": 16,
             "mla_v_dim": 16}
    layouts = [{"cp": 2, "dp_shard": 2, "zero": 3}, {"cp": 4, "cp_mode": "hybrid", "cp_ulysses": 2, "dp_shard": 1}]
    cfgs = []
    for i, parallel in enumerate(layouts):
        cfg = tiny_config(str(tmp_path / str(i)), parallel=parallel,
                          train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16", "recompute": "none"})
        cfg["model"].update(model)
        cfgs.append((from_dict(cfg), 4))
    for parallel, out in zip(layouts, dry_run_many(cfgs, "h100")):
        rt, pl = out["runtime"], out["planner"]
        for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert pl[field] == pytest.approx(rt[field], rel=0.02), (parallel, field, rt, pl)
        assert pl["activation_bytes"] == pytest.approx(rt["activation_bytes"], rel=0.10), (parallel, rt, pl)
        assert {d: x["count"] for d, x in pl["collectives"].items()} == \
            {d: x["count"] for d, x in rt["collectives"].items()}, (parallel, rt["collectives"], pl["collectives"])
        assert pl["collectives"]["cp"]["bytes"] == pytest.approx(rt["collectives"]["cp"]["bytes"], rel=0.02), parallel


def test_report_sets_both_sides_for_the_same_ranks():
    # pp rank 0 holds the embedding and two dense blocks, pp rank 1 two MoE blocks and the output
    # (ep 2 over ZeRO-1: the experts' states sharded over 2 ranks, the rest over 4): rank 0 holds
    # the most gradients and activations, rank 1 the most parameters and optimizer state. Every
    # simulated rank is reported on both sides (the planner's terms for its pipeline rank); each
    # side's top-level terms are the most over those same ranks, so like is compared with like
    # although no one rank holds the most of everything.
    from meshfold.config import from_dict
    from meshfold.dryrun import FIELDS, STATES, dry_run

    cfg = tiny_config("/nonexistent", parallel={"pp": 2, "dp_shard": 4, "ep": 2, "zero": 1, "pp_microbatches": 2},
                      train={"steps": 1, "micro_batch": 0, "dtype": "bfloat16"})
    cfg["model"].update({"dim": 64, "seq_len": 64, "vocab_size": 512, "n_layers": 4, "ffn_dim": 80, **MOE,
                         "moe_ffn_dim": 16, "moe_first_dense": 2})
    out = dry_run(from_dict(cfg), 8, cluster="h100")
    rt, pl = out["runtime"], out["planner"]
    assert sorted(rt["ranks"], key=int) == sorted(pl["ranks"], key=int) == ["0", "4"]
    for r, pp_rank in (("0", 0), ("4", 1)):
        mine, priced = rt["ranks"][r], pl["ranks"][r]
        assert mine["pp_rank"] == priced["pp_rank"] == pp_rank
        for field in STATES:
            assert priced[field] == pytest.approx(mine[field], rel=0.02), (r, field, mine, priced)
        assert priced["activation_bytes"] == pytest.approx(mine["activation_bytes"], rel=0.10), (r, mine, priced)
    for side in (rt, pl):
        for field in FIELDS:
            assert side[field] == max(v[field] for v in side["ranks"].values()), field
        assert side["grad_bytes"] == side["ranks"]["0"]["grad_bytes"] > side["ranks"]["4"]["grad_bytes"]
        assert side["optimizer_bytes"] == side["ranks"]["4"]["optimizer_bytes"] > side["ranks"]["0"]["optimizer_bytes"]
    for field in STATES:
        assert pl[field] == pytest.approx(rt[field], rel=0.02), (field, rt, pl)
    assert pl["activation_bytes"] == pytest.approx(rt["activation_bytes"], rel=0.10)
