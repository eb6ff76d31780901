"""Agreement as a property (issue 27): a seeded random matrix of layouts, each dry-run (the
real runtime on fake ranks and fake tensors) against the planner's prediction for it, in a
GPU run's numerics (bf16 autocast over fp32 master weights). Bounds: model state within
2 %, activations within 10 %, every mesh dimension's collective count equal and bytes
within 2 %; a layout the runtime refuses, the planner refuses with the same message.

All layouts' simulated ranks share one pool of fresh processes (``dry_run_many``); small
shapes (2 blocks of width 512, 4 where a pipeline rank runs two chunks; head dim 128: fake
tensors cost nothing, and real head dims keep tiny per-token terms from deciding a bound) keep every dimension in play at world
sizes up to 32. ``test_runtime_and_planner_agree`` runs the whole matrix (about 2-4
minutes here; ``python tests/test_dryrun_matrix.py`` prints every disagreement). KNOWN
lists the disagreements that are understood and not yet fixed, each with its reason: a
new disagreement fails, and so does a KNOWN one that went away (remove it)."""

import random

import pytest

from meshfold.config import from_dict, validate
from meshfold.dryrun import dry_run, dry_run_many
from meshfold.errors import ConfigError
from meshfold.planner.from_config import footprint
from meshfold.testing import tiny_config

SEED, CASES = 27, 56
STATE_TOL, ACT_TOL, BYTES_TOL = 0.02, 0.10, 0.02

# (case id, term): why the two sides still differ (none left; a new one is added here with its reason)
KNOWN: dict[tuple[str, str], str] = {}


def _draw(rng: random.Random) -> tuple[str, int, dict, dict, dict]:
    moe = rng.random() < 0.3
    model = {"dim": 512, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 4096,
             "seq_len": rng.choice([256, 512])}
    if moe:
        model.update({"moe_experts": 4, "moe_topk": 2, "moe_ffn_dim": 512})
    tp = rng.choice([1, 2])
    pp = rng.choice([1, 1, 2])
    cp = rng.choice([1, 1, 2, 4])
    ep = rng.choice([1, 2]) if moe else 1
    parallel = {"tp": tp, "pp": pp, "cp": cp, "sp": tp > 1 and rng.random() < 0.5,
                "cp_mode": rng.choice(["ring", "ulysses", "hybrid"]) if cp > 1 else "ring",
                "zero": rng.choice([0, 1, 2, 3]), "ep": ep}
    if pp > 1:
        sched = rng.choice(["1f1b", "gpipe", "interleaved", "zbv"])
        parallel.update({"pp_schedule": sched, "pp_virtual_stages": 2 if sched == "interleaved" else 1,
                         "pp_microbatches": rng.choice([2, 4])})
        if sched in ("interleaved", "zbv"):  # two chunks per pipeline rank: a block each
            model["n_layers"] = 4
    dp_rep, dp_shard = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2), (1, 4)])
    parallel.update({"dp_replicate": dp_rep, "dp_shard": dp_shard})
    world = tp * pp * cp * dp_rep * dp_shard
    dp = dp_rep * dp_shard
    train = {"steps": 1, "dtype": "bfloat16", "recompute": rng.choice(["none", "selective", "full"]),
             "global_batch": dp * rng.choice([1, 2, 4]), "micro_batch": 1 if pp == 1 else 0,
             "offload": "optimizer" if rng.random() < 0.1 else "none"}
    name = (f"{'moe' if moe else 'dense'}-w{world}-tp{tp}{'sp' if parallel['sp'] else ''}-pp{pp}"
            f"{parallel.get('pp_schedule', '')}-cp{cp}{parallel['cp_mode'] if cp > 1 else ''}-ep{ep}"
            f"-dp{dp_rep}x{dp_shard}-z{parallel['zero']}-{train['recompute']}-gb{train['global_batch']}"
            f"-s{model['seq_len']}{'-off' if train['offload'] != 'none' else ''}")
    return name, world, model, parallel, train


def matrix() -> tuple[list, list]:
    """(valid cases, refused cases): CASES layouts that validation accepts, and the refused
    ones drawn on the way (each with its config dict)."""
    rng = random.Random(SEED)
    valid, refused, seen = [], [], set()
    while len(valid) < CASES:
        name, world, model, parallel, train = _draw(rng)
        if name in seen:
            continue
        seen.add(name)
        cfg = tiny_config("/nonexistent", parallel=parallel, train=train)
        cfg["model"].update(model)
        try:
            validate(from_dict(cfg), world)
        except ConfigError:
            if len(refused) < 6:
                refused.append((name, world, cfg))
            continue
        valid.append((name, world, cfg))
    return valid + mtp_cases(), refused


def mtp_cases() -> list:
    """Fixed layouts beyond the draw: multi-token prediction (DeepSeek-V3, one depth) on the
    last stage of tp x pp, and as its own FSDP unit of a MoE model."""
    cases = []
    for name, world, moe, parallel in [
        ("mtp-dense-w4-tp2-pp21f1b-z1", 4, False, {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 2,
                                                  "zero": 1, "dp_shard": 1}),
        ("mtp-moe-w4-tp1-pp1-ep2-dp1x4-z3", 4, True, {"ep": 2, "zero": 3, "dp_shard": 4}),
    ]:
        cfg = tiny_config("/nonexistent", parallel=parallel,
                          train={"steps": 1, "dtype": "bfloat16", "global_batch": 4, "micro_batch": 1 if "pp" not in parallel else 0})
        cfg["model"].update({"dim": 512, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 4096,
                             "seq_len": 256, "mtp_depth": 1})
        if moe:
            cfg["model"].update({"moe_experts": 4, "moe_topk": 2, "moe_ffn_dim": 512})
        cases.append((name, world, cfg))
    return cases


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1.0)


def disagreements(name: str, out) -> dict:
    """{(name, term): 'runtime vs planner'} for every term outside its bound."""
    bad = {}
    if isinstance(out, Exception):
        return {(name, "runs"): f"{type(out).__name__}: {str(out)[:200]}"}
    rt, pl = out["runtime"], out["planner"]
    for term in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        if _rel(rt[term], pl[term]) > STATE_TOL:
            bad[(name, term)] = f"{rt[term]} vs {pl[term]}"
    if _rel(rt["activation_bytes"], pl["activation_bytes"]) > ACT_TOL:
        bad[(name, "activation_bytes")] = f"{rt['activation_bytes']} vs {pl['activation_bytes']}"
    for dim in sorted(set(rt["collectives"]) | set(pl["collectives"])):
        r, p = rt["collectives"].get(dim, {}), pl["collectives"].get(dim, {})
        if r.get("count") != p.get("count"):
            bad[(name, f"{dim}_count")] = f"{r.get('count')} vs {p.get('count')}"
        if _rel(r.get("bytes", 0), p.get("bytes", 0)) > BYTES_TOL:
            bad[(name, f"{dim}_bytes")] = f"{r.get('bytes')} vs {p.get('bytes')}"
    return bad


def test_matrix_is_large_and_varied():
    valid, refused = matrix()
    names = " ".join(n for n, _, _ in valid)
    assert len(valid) >= 50 and refused
    for part in ("moe", "dense", "sp", "1f1b", "gpipe", "interleaved", "zbv", "ring", "ulysses", "hybrid",
                 "ep2", "z0", "z1", "z2", "z3", "dp2x2", "none", "selective", "full", "-off"):
        assert part in names, part


def test_runtime_and_planner_refuse_alike():
    _, refused = matrix()
    for name, world, cfg in refused:
        with pytest.raises(ConfigError) as runtime:
            dry_run(from_dict(cfg), world)
        with pytest.raises(ConfigError) as planner:
            footprint(from_dict(cfg), world, device="cuda")
        assert str(runtime.value) == str(planner.value), name


def agreement_report() -> dict:
    """{(case, term): 'runtime vs planner'} over the whole matrix (``python tests/test_dryrun_matrix.py``)."""
    valid, _ = matrix()
    outs = dry_run_many([(from_dict(cfg), world) for _, world, cfg in valid], cluster="h100")
    found = {}
    for (name, _, _), out in zip(valid, outs):
        found.update(disagreements(name, out))
    return found


def test_runtime_and_planner_agree():
    # Every layout of the matrix within the bounds (model state 2 %, activations 10 %,
    # collective counts equal, bytes 2 %), but the understood disagreements in KNOWN.
    found = agreement_report()
    new = {k: v for k, v in found.items() if k not in KNOWN}
    gone = sorted(set(KNOWN) - set(found))
    assert not new, "runtime vs planner outside the bounds:\n" + "\n".join(
        f"{case}  {term}: {what}" for (case, term), what in sorted(new.items()))
    assert not gone, f"fixed, remove from KNOWN: {gone}"


def worst_per_term() -> dict:
    """{term: (relative difference (counts: absolute), case, runtime, planner)}, the largest over
    the matrix outside KNOWN (``python tests/test_dryrun_matrix.py --worst``; docs/planner.md)."""
    valid, _ = matrix()
    outs = dry_run_many([(from_dict(cfg), world) for _, world, cfg in valid], cluster="h100")
    worst: dict = {}
    for (name, _, _), out in zip(valid, outs):
        rt, pl = out["runtime"], out["planner"]
        terms = [(t, rt[t], pl[t], _rel(rt[t], pl[t])) for t in
                 ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")]
        for dim in set(rt["collectives"]) | set(pl["collectives"]):
            r, p = rt["collectives"].get(dim, {}), pl["collectives"].get(dim, {})
            terms.append((f"{dim}_count", r.get("count", 0), p.get("count", 0),
                          abs(r.get("count", 0) - p.get("count", 0))))
            terms.append((f"{dim}_bytes", r.get("bytes", 0), p.get("bytes", 0), _rel(r.get("bytes", 0), p.get("bytes", 0))))
        for term, r, p, diff in terms:
            if (name, term) not in KNOWN and diff >= worst.get(term, (-1,))[0]:
                worst[term] = (diff, name, r, p)
    return worst


if __name__ == "__main__":
    import sys

    if "--worst" in sys.argv:
        for term, (diff, case, r, p) in sorted(worst_per_term().items()):
            print(f"{term}: {diff:.4g}  {case}  runtime {r}  planner {p}")
    else:
        for (case, term), what in sorted(agreement_report().items()):
            print(f"{case}  {term}: {what}")
