"""``meshfold dry-run``: the fake-rank, fake-tensor simulation reports what a real run of the
same layout holds and sends. Checked against real gloo runs in the same test: per-rank
parameter bytes and every mesh dimension's collective count and bytes of one step (exact;
the dry-run extrapolates 4 micro-batches from steps of 1 and 2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshfold.testing import one_step_report, run_on, tiny_config

ROOT = Path(__file__).resolve().parent.parent


LAYOUTS = [
    pytest.param(8, {"tp": 2, "pp": 2, "dp_shard": 2, "zero": 1, "pp_microbatches": 4}, id="tp2xpp2xdp2-zero1"),
    pytest.param(4, {"dp_shard": 4, "zero": 3}, id="fsdp4-zero3"),
    pytest.param(4, {"tp": 2, "sp": True, "dp_replicate": 2, "dp_shard": 1, "zero": 0}, id="tp2-sp-ddp2"),
]


@pytest.mark.parametrize("world,parallel", LAYOUTS)
def test_dry_run_matches_real_run(world, parallel, tmp_path):
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run

    cfg = tiny_config(str(tmp_path), parallel=parallel, train={"steps": 1, "micro_batch": 1})
    real = run_on(world, one_step_report, cfg)
    dry = dry_run(from_dict(cfg), world, cluster="cpu")
    assert dry["runtime"]["param_bytes"] == max(r["param_bytes"] for r in real)
    for rank, sim in dry["runtime"]["ranks"].items():
        assert sim["collectives"] == real[int(rank)]["collectives"], rank
    assert set(dry) == {"world", "layout", "runtime", "planner", "seconds"}
    for side in ("runtime", "planner"):
        assert {"param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "collectives"} <= set(dry[side])


def test_cli_json_and_one_line_errors(tmp_path):
    base = [sys.executable, "-m", "meshfold", "dry-run", str(ROOT / "configs" / "debug.toml"), "--cluster", "cpu"]
    out = subprocess.run(base + ["--world", "4", "--set", "parallel.tp=2", "--set", "parallel.pp=2", "--json"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)  # stdout is the JSON alone (no stage-split lines before it)
    assert report["world"] == 4 and report["layout"]["tp"] == 2 and report["layout"]["pp"] == 2
    assert report["runtime"]["collectives"]["tp"]["count"] > 0
    bad = subprocess.run(base + ["--world", "6", "--set", "parallel.tp=4"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


# Runtime (dry-run: the real code on fake ranks) vs planner, in the numerics of a real GPU run
# (train.dtype = bfloat16: fp32 master weights, gradients and Adam moments, bf16 autocast,
# the fused attention kernel). Model state within 2 %; activations within ACT_TOL (what each
# side counts is in docs/memory.md); collective counts per mesh dimension equal.
ACT_TOL = 0.10
AGREEMENT = [
    pytest.param(4, {"tp": 2, "dp_shard": 2, "zero": 1}, {}, id="tp2-zero1"),
    pytest.param(4, {"dp_shard": 4, "zero": 1}, {}, id="ddp-zero1"),
    # 4 micro-batches: two simulated steps, DDP's buckets kept after the first backward
    pytest.param(2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}, {}, id="ddp2-4-micro-batches"),
    pytest.param(4, {"dp_shard": 4, "zero": 3}, {}, id="fsdp4-zero3"),
    pytest.param(8, {"tp": 2, "pp": 2, "dp_shard": 2, "zero": 1, "pp_microbatches": 4}, {}, id="tp2xpp2xdp2-zero1"),
]


@pytest.mark.parametrize("world,parallel,model", AGREEMENT)
def test_dry_run_runtime_agrees_with_planner(world, parallel, model, tmp_path):
    _agree(world, parallel, model, {}, tmp_path)


# torchtitan's op recompute policy (train.recompute = "op"): what its cache keeps
@pytest.mark.parametrize("world,parallel", [(4, {"dp_shard": 4, "zero": 3}), (4, {"tp": 2, "dp_shard": 2, "zero": 1})],
                         ids=["fsdp4-zero3-op", "tp2-zero1-op"])
def test_dry_run_agrees_with_planner_under_op_recompute(world, parallel, tmp_path):
    _agree(world, parallel, {}, {"recompute": "op"}, tmp_path)


def _agree(world, parallel, model, train, tmp_path):
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run

    cfg = tiny_config(str(tmp_path), parallel=parallel,
                      train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16", **train})
    cfg["model"].update({"dim": 64, "seq_len": 64, "vocab_size": 512, **model})
    out = dry_run(from_dict(cfg), world, cluster="h100")
    rt, pl = out["runtime"], out["planner"]
    for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert pl[field] == pytest.approx(rt[field], rel=0.02), (field, rt, pl)
    assert pl["activation_bytes"] == pytest.approx(rt["activation_bytes"], rel=ACT_TOL), (rt, pl)
    assert {d: x["count"] for d, x in pl["collectives"].items()} == \
        {d: x["count"] for d, x in rt["collectives"].items()}, (rt["collectives"], pl["collectives"])


# A model whose output layer costs more than its blocks (vocab 2048 at dim 64), so the
# runtime's cost-balanced split is uneven: pp 2 -> [4, 2] (count split: [3, 3]); zbv's four
# stages -> [1, 2, 2, 1], rank 0 holding stages 0 and 3 (the embedding and the output).
UNEVEN = {"n_layers": 6, "dim": 64, "seq_len": 64, "vocab_size": 2048}


@pytest.mark.parametrize("parallel,split", [
    ({"pp": 2, "dp_shard": 2, "zero": 1, "pp_microbatches": 4}, [4, 2]),
    ({"pp": 2, "pp_schedule": "zbv", "dp_shard": 2, "zero": 1, "pp_microbatches": 4}, [1, 2, 2, 1]),
    ({"pp": 2, "dp_shard": 2, "zero": 1, "pp_microbatches": 4, "pp_split": [2, 4]}, [2, 4]),
], ids=["1f1b-balanced", "zbv-balanced", "1f1b-pp_split"])
def test_planner_prices_the_runtime_stage_split(parallel, split, tmp_path):
    from meshfold.config import from_dict, validate
    from meshfold.dryrun import dry_run
    from meshfold.parallel.pp.stage_modules import stage_split
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.cost import CostModel
    from meshfold.planner.from_config import layout_from_config, workload_from_config
    from meshfold.schedules import get_schedule

    cfg = tiny_config(str(tmp_path), parallel=parallel, train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16"})
    cfg["model"].update(UNEVEN)
    config = validate(from_dict(cfg), 4)
    assert stage_split(config)[0] == split
    layout = layout_from_config(config, 4)
    cm = CostModel(workload_from_config(config, on_gpu=True), load_cluster("h100", devices=4))
    assert cm.stage_split(layout) == split
    ranks, last_rank = cm.stage_kinds(layout)
    sched, pp = config.parallel.pp_schedule, config.parallel.pp
    schedule = get_schedule(sched)
    chunks = schedule.chunks_per_rank(config.parallel.pp_virtual_stages)
    assert [sum(r.values()) for r in ranks] == \
        [sum(split[schedule.stage_of(pp, r, c)] for c in range(chunks)) for r in range(pp)]
    assert last_rank == (0 if sched == "zbv" else pp - 1)
    out = dry_run(from_dict(cfg), 4, cluster="h100")
    rt, pl = out["runtime"], out["planner"]
    for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert pl[field] == pytest.approx(rt[field], rel=0.02), (field, rt, pl)


def test_fresh_processes_answer_raise_or_report_a_dead_child():
    # Each simulated rank runs in its own spawned process: answers come back in order, a
    # child's exception reaches the parent as one line naming it, and a child that dies without
    # answering is an error naming it (a multiprocessing.Pool would wait for it forever).
    import os

    from meshfold.dryrun import DryRunError, _in_fresh_processes

    assert _in_fresh_processes(pow, [(2, 3), (3, 2), (5, 1)], 2) == [8, 9, 5]
    with pytest.raises(DryRunError, match="ValueError: invalid literal"):
        _in_fresh_processes(int, [("12",), ("not a number",)], 2)
    with pytest.raises(RuntimeError, match="died with exit code 3"):
        _in_fresh_processes(os._exit, [(3,)], 1)


# train.optimizer = "muon": the owner-computes exchange (two all-to-alls per same-shape bucket
# over dp_shard, tp or both) and one momentum per matrix, exactly as the runtime issues and holds them
@pytest.mark.parametrize("world,parallel", [(2, {"dp_shard": 2, "zero": 3}), (2, {"tp": 2, "dp_shard": 1, "zero": 0}),
                                            (4, {"tp": 2, "dp_shard": 2, "zero": 3}), (2, {"dp_shard": 2, "zero": 1}),
                                            (4, {"tp": 2, "dp_shard": 2, "zero": 1})],
                         ids=["fsdp2", "tp2", "tp2xfsdp2", "zero1-dp2", "zero1-dp2xtp2"])
def test_dry_run_agrees_with_planner_under_muon(world, parallel, tmp_path):
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run

    cfg = tiny_config(str(tmp_path), parallel=parallel,
                      train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16", "optimizer": "muon"})
    cfg["model"].update({"dim": 64, "seq_len": 64, "vocab_size": 512})
    out = dry_run(from_dict(cfg), world, cluster="h100")
    rt, pl = out["runtime"], out["planner"]
    for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert pl[field] == rt[field], (field, rt, pl)
    assert pl["collectives"] == rt["collectives"]


def test_planner_newton_schulz_flops_are_the_runtime_formula():
    from meshfold.optim.muon.newton_schulz import newton_schulz_flops
    from meshfold.planner import optimizer

    for rows, cols in ((64, 176), (176, 64), (32, 32)):
        assert optimizer.newton_schulz_flops(rows, cols, 5) == newton_schulz_flops(rows, cols, 5)


# Muon on the MoE preset (stacked experts: E matrices each, whole on their rank, or with an odd E
# sharded by FSDP2 on a matrix dimension: exchanged) and on latent attention with MoE and
# multi-token prediction (its low-rank down- and up-projections, the depth's eh_proj): states,
# calls and bytes as the runtime's. (With 3 experts the planner's FSDP2 bytes differ from the
# runtime's under AdamW already, by the same amount: there Muon's additions are compared.)
# (the latent-attention model's 4 experts are the whole-on-their-rank case)
MUON_MOE = {"moe-odd-experts-fsdp2": {"preset": "moe-debug", "moe_experts": 3},
            "mla-moe-mtp-fsdp2": {"dim": 64, "seq_len": 64, "vocab_size": 512, "n_layers": 2, "n_heads": 4,
                                  "n_kv_heads": 4, "moe_experts": 4, "moe_topk": 2, "moe_ffn_dim": 32,
                                  "moe_first_dense": 1, "mla_kv_rank": 32, "mla_q_rank": 24, "mla_rope_dim": 8,
                                  "mla_nope_dim": 16, "mla_v_dim": 16, "mtp_depth": 1}}
MUON_MOE["mla-moe-mtp-zero1"] = MUON_MOE["mla-moe-mtp-fsdp2"]  # ZeRO-1 dp 2: whole-parameter ownership


def test_dry_run_agrees_with_planner_under_muon_for_moe_and_mla(tmp_path):
    from meshfold.config import from_dict
    from meshfold.dryrun import dry_run

    def config(name, optimizer):
        cfg = tiny_config(str(tmp_path / name / optimizer), parallel={"dp_shard": 2, "zero": 1 if "zero1" in name else 3},
                          train={"steps": 1, "micro_batch": 1, "dtype": "bfloat16", "optimizer": optimizer})
        model = MUON_MOE[name]
        cfg["model"] = {"seq_len": 64, **model} if "preset" in model else {**cfg["model"], **model}
        return from_dict(cfg)

    odd = "moe-odd-experts-fsdp2"
    outs = [dry_run(config(name, "muon"), 2, cluster="h100") for name in MUON_MOE]
    outs.append(dry_run(config(odd, "adamw"), 2, cluster="h100"))
    for name, out in zip(MUON_MOE, outs):
        rt, pl = out["runtime"], out["planner"]
        for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert pl[field] == pytest.approx(rt[field], rel=0.02), (name, field, rt, pl)
        if name != odd:
            assert pl["collectives"] == rt["collectives"], (name, rt["collectives"], pl["collectives"])
            continue
        adamw = outs[-1]
        for dim, got in rt["collectives"].items():
            for k in ("count", "bytes"):
                assert got[k] - adamw["runtime"]["collectives"][dim][k] == \
                    pl["collectives"][dim][k] - adamw["planner"]["collectives"][dim][k], (name, dim, k)
