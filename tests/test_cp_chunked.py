"""Context parallel with chunked (block-local) attention, Llama 4's ``attention_chunk_size``:
a query sees the earlier keys of its own chunk of positions (and of its document).

The ring classifies tile pairs by chunk as it does by window: pairs in other chunks are
skipped, and a member whose queries see none of another member's keys never gets that
block (``RingLayout.need``). Ulysses runs the whole sequences' chunks as documents. Checked
in float64 against the one-process S x S reference (1e-12), at cp 2 and cp 4, chunks that
cut the balanced layout's chunks and chunks made of whole ones, with and without packed
documents; the ring's bytes (ledger) show the skipped sends; and a tiny Llama 4 trains
under cp 2 Ulysses x FSDP 2 and cp 4 ring as one process does.
"""

from meshfold.config import from_dict
from meshfold.dryrun import dry_run_many
from meshfold.parallel.cp.batch import default_members
from meshfold.parallel.cp.groups import ContextParallelPlan
from meshfold.parallel.cp.ring import RingLayout
from meshfold.models.presets import preset
from meshfold.planner.attention.ring import _layer_sends, ring_sends, ring_tiles
from meshfold.planner.search import structures
from meshfold.planner.workload import Workload
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect
from tests.test_cp_windows_sinks import ATOL, cp_cases
from tests.test_gpt_oss import MODEL as GPT_OSS

# S = 32: balanced chunks of 8 tokens at cp 2, 4 at cp 4; chunk 8 (whole balanced chunks at
# cp 4: two each), chunk 6 (cutting them), with sinks and a scale once
CASES = [(mode, balance, doc, 0, sinks, scale, 0, chunk)
         for mode, balance in (("ring", True), ("ring", False), ("ulysses", True))
         for doc in (False, True)
         for chunk, sinks, scale in ((8, False, None), (6, True, 0.3))]


# hybrid (Ulysses 2 x ring 2 at cp 4): windows shorter and longer than a balanced chunk,
# chunks, sinks, with and without documents, and the plain layout
HYBRID = [("hybrid", True, doc, window, sinks, None, 2, chunk) for doc in (False, True)
          for window, sinks, chunk in ((3, True, 0), (5, True, 0), (0, False, 8), (0, True, 6), (0, False, 0))]


def test_hybrid_takes_windows_sinks_and_chunks_as_one_process():
    """Hybrid cp 4 (Ulysses 2 inside, the ring over 2 groups) equals the one-process S x S
    reference (1e-12) with windows, sinks and chunks; the ring part skips what no member sees:
    fewer bytes than the plain layout's."""
    per_rank = run_on(4, cp_cases, HYBRID)
    for i, case in enumerate(HYBRID):
        for rank, res in enumerate(per_rank):
            assert max(res[i]["errors"]) < ATOL, f"{case} rank {rank}: errors {res[i]['errors']}"
    plain = [r[HYBRID.index(("hybrid", True, True, 0, False, None, 2, 0))]["bytes"] for r in per_rank]
    for case in [c for c in HYBRID if c[3] or c[7]]:
        assert all(r[HYBRID.index(case)]["bytes"] < p for r, p in zip(per_rank, plain)), case


def test_chunked_attention_matches_one_process_and_skips_sends():
    for cp in (2, 4):
        per_rank = run_on(cp, cp_cases, CASES)
        for i, case in enumerate(CASES):
            for rank, res in enumerate(per_rank):
                assert max(res[i]["errors"]) < ATOL, f"cp={cp} {case} rank {rank}: errors {res[i]['errors']}"
        if cp == 4:
            # balanced ring, chunk 8 = two balanced chunks of 4: member m (chunks m, 7-m) sees
            # only member m ^ 1's keys (chunk pairs {0,1}, {2,3}, ...), and of them one chunk
            # (tile): half a block forward, half backward, half a gradient back (a block: float64
            # [k, v] x b 2 x Hkv 2 x 8 tokens x d 8 = 4096 bytes), instead of 3 + 3 + 4 relayed;
            # plus the positions/doc ids gather
            block, meta = 4096, 3 * 2 * 2 * 8 * 8
            assert [r[0]["bytes"] - meta for r in per_rank] == [1.5 * block] * 4


MODEL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=40, vocab_size=320, seq_len=16, norm_eps=1e-5,
             moe_experts=4, moe_ffn_dim=24, moe_every=2, moe_topk=1, moe_shared_experts=1, moe_router="sigmoid",
             moe_norm_topk=False, moe_gate_input=True, attention_chunk_size=6, nope_interval=4,
             attn_temperature_tuning=True, attn_floor_scale=4.0, attn_scale=0.5, l2_qk_norm=True,
             moe_aux_loss_coef=0.0)


def _layouts(cfgs: list[dict]) -> list:
    return [train_collect(cfg) for cfg in cfgs]


def test_llama4_trains_under_cp_as_one_process(tmp_path):
    """Tiny Llama 4 (three chunked layers of chunk 6 over rows of 16, one NoPE layer), packed
    documents: 5 steps' losses, every parameter and gradient equal one process's (float64)
    under cp 2 Ulysses x FSDP 2, cp 4 ring and cp 4 hybrid (Ulysses 2 x ring 2; the ring at
    cp 2: the attention test above)."""
    def cfg(name, **parallel):
        return tiny_config(str(tmp_path / name), model=MODEL, parallel=parallel, train={"steps": 5})

    ref = train_collect(cfg("one"))
    names = ("cp2ulysses_fsdp2", "cp4ring", "cp4hybrid")
    layouts = [cfg(names[0], cp=2, cp_mode="ulysses", dp_shard=2), cfg(names[1], cp=4, dp_shard=1),
               cfg(names[2], cp=4, cp_mode="hybrid", cp_ulysses=2, dp_shard=1)]
    for name, got in zip(names, run_on(4, _layouts, layouts)[0]):
        try:
            assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def test_planner_reach_equals_the_ring_layouts():
    """The planner's plain-Python ``ring_tiles`` (default positions) equals every member's
    ``RingLayout.need_tiles`` for windows and chunks shorter and longer than a balanced chunk,
    cp 2 to 8, balanced and contiguous; and its per-layer sends for member 0 follow from it."""
    seq = 96
    for cp in (2, 3, 4, 8):
        for balance in (True, False):
            plan = ContextParallelPlan(cp, 1, balance, 0, None, None, None)
            meta = default_members(plan, 1, seq // cp)
            tile = max(1, seq // (2 * max(cp, 4)))
            for window, chunk in ((3, 0), (20, 0), (0, 6), (0, 24), (0, 50)):
                want = ring_tiles(seq, cp, 1, balance, window, chunk)
                for r in range(cp):
                    got = RingLayout(meta, False, r, tile, window, chunk).need_tiles
                    assert tuple(tuple(map(tuple, row)) for row in got) == want, (cp, balance, window, chunk, r)
    # balanced cp 4, window 3 < chunk 12 (= a tile): member 0 feeds member 1 only and uses
    # member 1's block only, of each one tile of two
    assert _layer_sends(seq, 4, 1, True, 3, 0) == (0.5, 0.5, 2, 1, 1)
    assert _layer_sends(seq, 4, 1, True, 0, 0) == (3, 4, 3, 3, 4)  # relayed


def test_cuda_dry_run_ring_bytes_skip_and_equal_the_planner(tmp_path):
    """``meshfold dry-run --device cuda`` (fake CUDA, bf16) of a tiny gpt-oss shape (windows of
    32 on alternate layers) and a tiny Llama 4 (chunks of 128 on three of four layers) at seq
    512 with cp 4 ring: no errors, no math attention, no host read in the ring; rank 0's cp
    bytes and sends equal the planner's, and a windowed layer of the gpt-oss run sends half
    a key/value block forward, half backward and half an fp32 gradient block (rank 0 feeds
    and uses one tile of member 1's only) where full attention sends 3 + 3 + 4 blocks. The
    presets at seq 32,768: docs/context_parallel.md."""
    gpt_oss = dict(GPT_OSS, dim=64, attn_head_dim=16, seq_len=512, alternating_window=32)
    llama4 = dict(MODEL, seq_len=512, attention_chunk_size=128)
    models = {"windows": gpt_oss, "chunks": llama4}
    cases = [(from_dict(tiny_config(str(tmp_path / name), model=model, parallel={"cp": 4, "dp_shard": 1},
                                    train={"dtype": "bfloat16", "global_batch": 1, "micro_batch": 1})), 4)
             for name, model in models.items()]
    reports = dict(zip(models, dry_run_many(cases, device="cuda")))
    for name, report in reports.items():
        gpu, rt, pl = report["gpu"], report["runtime"]["collectives"]["cp"], report["planner"]["collectives"]["cp"]
        assert gpu["errors"] == [] and "math" not in gpu["attention"], (name, gpu)
        assert not any("cp/ring.py" in sync["where"] for sync in gpu["host_syncs"]), (name, gpu["host_syncs"])
        assert rt == pl, (name, rt, pl)
    kv = 512 // 4 * GPT_OSS["n_kv_heads"] * 2 * 16 * 2  # a member's k and v: tokens x kv heads x (16 + 16) x bf16
    # relayed: 3 kv forward, 3 backward, 4 fp32 gradients; windowed: half a block (the one tile
    # of member 1's two that member 0 sees, and the one of its own member 1 sees) each way
    full_layer, windowed_layer = 6 * kv + 4 * 2 * kv, (2 * kv + 2 * kv) // 2
    gathers = 3 * 2 * 512 // 4 * 8 + 3 * 8  # the positions / doc ids, the balance metric's all-gathers
    assert reports["windows"]["runtime"]["collectives"]["cp"]["bytes"] == 2 * full_layer + 2 * windowed_layer + gathers


def test_planner_offers_and_prices_cp_for_windowed_and_chunked_presets():
    """The search offers cp ring and Ulysses to gpt-oss-120b (windows, sinks) and llama4-scout
    (chunks) as for any model; their ring at seq 32,768, cp 4 sends member 0's share of the
    blocks the dry-run measures (docs/context_parallel.md): gpt-oss alternates 0.5 with 3
    key/value blocks (0.5 with 4 gradients), Scout three chunked layers of 0.5 with one full."""
    for name in ("gpt-oss-120b", "llama4-scout"):
        w = Workload(preset(name, seq_len=32768), global_batch=8)
        modes = {(s[3], s[6]) for s in structures(w, 8)}
        assert {(4, "ring"), (8, "ulysses")} <= modes, (name, sorted(modes))
    gpt_oss = ring_sends(preset("gpt-oss-120b"), 32768, 4, 1)
    assert (gpt_oss.kv, gpt_oss.grad, gpt_oss.kv_calls, gpt_oss.grad_calls) == (1.75, 2.25, 2, 2.5)
    scout = ring_sends(preset("llama4-scout"), 32768, 4, 1)
    assert (scout.kv, scout.grad, scout.kv_calls, scout.grad_calls) == (1.125, 1.375, 1.5, 1.75)
