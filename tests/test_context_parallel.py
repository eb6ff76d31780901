"""Context parallel (ring, Ulysses, hybrid) against one-process attention and training, float64.

Attention level: every rank computes the full single-process attention (the model's
``CoreAttention``) on the same random q/k/v, runs the cp attention on its slice, and
compares its slice of the output and of dq/dk/dv. Tolerance: 1e-12 absolute (float64;
the observed error is ~2e-15). Whole model: losses over 5 steps, every gradient and
every parameter against a one-process run (``assert_runs_match``: rtol 1e-9, atol 1e-11).
"""

import contextlib

import pytest
import torch

from meshfold.config import ConfigError, from_dict, validate
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

ATOL = 1e-12
MODES = [("ring", True), ("ring", False), ("ulysses", True), ("hybrid", True)]


def _doc_ids(batch: int, seq: int) -> torch.Tensor:
    """Packed documents with boundaries inside and across every rank's slice (row 1 has a
    one-token document)."""
    cuts = [torch.tensor([5, 18]), torch.tensor([9, 10, 27])]
    return torch.stack([torch.bucketize(torch.arange(seq), cuts[r % 2]) for r in range(batch)])


def attention_cases(cases):
    """Run each (cp_mode, balance, doc_mask, cp_ulysses[, dtype, kernel, meta]) on the whole
    world as one cp group; return per case the max errors of (out, dq, dk, dv) against the
    float64 one-process attention and this rank's attention work. ``meta``: the cp forward
    and backward run under ``torch.set_default_device("meta")``, so any tensor created
    without ``device=`` is a meta tensor and fails at the collective it reaches."""
    import torch.distributed as dist

    from meshfold.config import Config, ModelConfig, ParallelConfig
    from meshfold.mesh import build_mesh
    from meshfold.models.llama import CoreAttention
    from meshfold.parallel.cp.attention import ContextParallelAttention, _MetaCache
    from meshfold.parallel.cp.batch import token_indices
    from meshfold.parallel.cp.groups import build_plan

    cp = dist.get_world_size()
    b, S, H, Hkv, d = 2, 32, 4, 2, 8
    results = []
    for mode, balance, doc, ulysses, *rest in cases:
        dtype, kernel, meta = (list(rest) + ["float64", "auto", False][len(rest):])
        cfg = Config(model=ModelConfig(dim=H * d, n_heads=H, n_kv_heads=Hkv, seq_len=S),
                     parallel=ParallelConfig(cp=cp, dp_shard=1, cp_mode=mode, cp_balance=balance,
                                             cp_ulysses=ulysses))
        plan = build_plan(cfg, build_mesh(cfg.parallel))
        plan.kernel = kernel
        core = ContextParallelAttention(plan, _MetaCache(plan))
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(b, S, H, d, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(b, S, Hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(b, S, Hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(b, S, H, d, generator=gen, dtype=torch.float64)
        pos = torch.arange(S).expand(b, -1)
        docs = _doc_ids(b, S) if doc else None
        ref = CoreAttention(dense=True)(q, k, v, positions=pos, doc_ids=docs)
        ref.backward(dout)

        idx = token_indices(S, cp, plan.cp_rank, plan.ulysses, plan.balance)
        low = getattr(torch, dtype)
        ql, kl, vl = (t.detach()[:, idx].to(low).requires_grad_() for t in (q, k, v))
        lpos, ldoc = pos[:, idx].contiguous(), None if docs is None else docs[:, idx].contiguous()
        with torch.device("meta") if meta else contextlib.nullcontext():
            out = core(ql, kl, vl, positions=lpos, doc_ids=ldoc)
            out.backward(dout[:, idx].to(low))
        errors = [float((got.detach().double() - want[:, idx]).abs().max())
                  for got, want in ((out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad))]
        w = plan.work
        results.append({"errors": errors, "ulysses": plan.ulysses, "visible": w.visible, "computed": w.computed,
                        "tiles": w.tiles, "skipped": w.skipped_tiles})
    return results


ATTENTION_CASES = [(mode, bal, doc, 0) for mode, bal in MODES for doc in (False, True)]


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_matches_full_attention(cp):
    cases = ATTENTION_CASES + [("hybrid", True, True, 1), ("hybrid", True, True, cp)]
    per_rank = run_on(cp, attention_cases, cases)
    for i, case in enumerate(cases):
        for rank, res in enumerate(per_rank):
            assert max(res[i]["errors"]) < ATOL, f"cp={cp} {case} rank {rank}: errors {res[i]['errors']}"
    uly = {c: per_rank[0][i]["ulysses"] for i, c in enumerate(cases)}
    assert uly[("ulysses", True, False, 0)] == cp
    assert uly[("hybrid", True, True, 0)] == (2 if cp == 4 else 1)  # auto: largest below cp that fits


def test_ring_at_cp8_forward_and_backward():
    cases = [("ring", True, False, 0), ("ring", True, True, 0), ("ring", False, True, 0)]
    per_rank = run_on(8, attention_cases, cases)
    for i, case in enumerate(cases):
        for rank, res in enumerate(per_rank):
            assert max(res[i]["errors"]) < ATOL, f"cp=8 {case} rank {rank}: errors {res[i]['errors']}"


# Fused kernels in low precision against the float64 reference (inputs ~N(0, 1), 32 tokens):
# observed max errors fp32 ~1e-6, bf16 ~3e-2 (8 mantissa bits: rounding q/k/v alone costs ~1e-2).
LOW_PRECISION = {"float32": 1e-5, "bfloat16": 1.5e-1}


def test_fused_kernels_low_precision_and_math_reference():
    """cp 2: the explicit math kernel equals the fused one in float64 (both exact), and the
    fused kernels in fp32/bf16 stay within the stated tolerances of the float64 result."""
    cases = [("ring", True, True, 0, "float64", "math"), ("hybrid", True, True, 1, "float64", "math")]
    cases += [(mode, True, doc, 0, dt) for dt in LOW_PRECISION for mode in ("ring", "ulysses") for doc in (False, True)]
    per_rank = run_on(2, attention_cases, cases)
    for i, case in enumerate(cases):
        tol = LOW_PRECISION.get(case[4], ATOL)
        for rank, res in enumerate(per_rank):
            assert max(res[i]["errors"]) < tol, f"{case} rank {rank}: errors {res[i]['errors']}"


def test_no_tensor_created_without_device():
    """Ring, Ulysses and hybrid forward+backward with the default device set to meta: a tensor
    created without ``device=`` would be a meta tensor and the comm layer would refuse it."""
    cases = [("ring", True, True, 0, "float64", "auto", True), ("ulysses", True, True, 0, "float64", "auto", True),
             ("hybrid", True, False, 0, "float64", "auto", True)]
    per_rank = run_on(4, attention_cases, cases)
    for i, case in enumerate(cases):
        for res in per_rank:
            assert max(res[i]["errors"]) < ATOL, case


def test_causal_balance_and_skipped_tiles():
    """Visible (query, key) entries per rank at cp 4, causal: exactly equal with the balanced
    split; contiguous: max/mean = 2R/(R+1)-ish (1.73 here, -> 2 as cp grows)."""
    cases = [("ring", True, False, 0), ("ring", False, False, 0), ("ring", True, True, 0)]
    per_rank = run_on(4, attention_cases, cases)
    b, S = 2, 32
    balanced = [r[0]["visible"] for r in per_rank]
    contiguous = [r[1]["visible"] for r in per_rank]
    assert sum(balanced) == sum(contiguous) == b * S * (S + 1) // 2  # every causal pair, once
    assert max(balanced) == min(balanced)  # stated bound: no difference at all
    mean = sum(contiguous) / 4
    assert max(contiguous) / mean > 1.7 and max(contiguous) / min(contiguous) > 6
    assert contiguous == sorted(contiguous)  # the last rank does the most
    # Blocks in the future (and, with documents, across boundaries) are skipped, not computed:
    # balanced causal at cp 4 = 2*cp chunk tiles per rank computed of 4 per ring step.
    for r in per_rank:
        assert r[0]["tiles"] == 16 and r[0]["skipped"] == 16 - 9
        assert r[2]["skipped"] > r[0]["skipped"]
        assert r[2]["computed"] < r[0]["computed"]


def test_uneven_sequence_and_heads_are_config_errors():
    def check(model, parallel, world):
        cfg = from_dict(tiny_config("/tmp/unused", model=model, parallel=parallel))
        with pytest.raises(ConfigError) as err:
            validate(cfg, world)
        return str(err.value)

    assert "seq_len" in check({"seq_len": 20}, {"cp": 4, "dp_shard": 1}, 4)  # 20 % (2*4)
    assert "seq_len" in check({"seq_len": 18}, {"cp": 4, "cp_mode": "ulysses", "dp_shard": 1}, 4)
    msg = check({"n_heads": 4, "n_kv_heads": 4, "dim": 32}, {"cp": 8, "cp_mode": "ulysses", "dp_shard": 1}, 8)
    assert "cp" in msg and "\n" not in msg
    msg = check({}, {"cp": 4, "cp_mode": "hybrid", "cp_ulysses": 3, "dp_shard": 1}, 4)
    assert "parallel.cp_ulysses" in msg
    # The sharding itself refuses uneven lengths too (e.g. an evaluation batch of another length).
    from meshfold.parallel.cp.batch import token_indices

    with pytest.raises(ConfigError, match="multiple of 8"):
        token_indices(20, 4, 0, ulysses=1, balance=True)
    # Hybrid 2 x 2, 24 tokens: 4 chunks of 6; ring member 0 holds chunks 0 and 3, member 1
    # chunks 1 and 2; each member's two Ulysses ranks split its share.
    got = [token_indices(24, 4, r, ulysses=2, balance=True).tolist() for r in range(4)]
    assert got == [list(range(0, 6)), list(range(18, 24)), list(range(6, 12)), list(range(12, 18))]
    # Ulysses with 2 kv heads over 4 ranks is fine (kv heads repeated), as is hybrid auto.
    validate(from_dict(tiny_config("/tmp/unused", parallel={"cp": 4, "cp_mode": "ulysses", "dp_shard": 1})), 4)


# --------------------------------------------------------------------------- whole model


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """A corpus of short documents (1-8 words), so every 16-token sequence packs several
    and the document masks matter (the default corpus's documents are far longer)."""
    import json
    import random

    rng = random.Random(5)
    words = "ring attention splits the sequence across ranks while ulysses swaps heads for tokens".split()
    path = tmp_path_factory.mktemp("corpus") / "short.jsonl"
    with path.open("w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))}) + "\n")
    return {"source": str(path), "max_docs": 0, "cache_dir": str(path.parent / "cache")}


def _config(run_dir, data, **sections):
    return tiny_config(run_dir, data={**data}, **sections)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, short_docs):
    return train_collect(_config(str(tmp_path_factory.mktemp("ref")), short_docs))


def test_short_docs_pack_several_documents_per_sequence(short_docs, tmp_path):
    from meshfold.data.dataset import build_data

    cfg = validate(from_dict(_config(str(tmp_path), short_docs)))
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len)
    per_row = [len(set(row.tolist())) for row in data.train.batch(range(8))["doc_ids"]]
    assert min(per_row) >= 2 and sum(per_row) >= 3 * len(per_row), per_row


LAYOUTS = [
    pytest.param(2, {"cp": 2, "cp_mode": "ring"}, id="ring2"),
    pytest.param(2, {"cp": 2, "cp_mode": "ring", "cp_balance": False}, id="ring2-contiguous"),
    pytest.param(2, {"cp": 2, "cp_mode": "ulysses"}, id="ulysses2"),
    pytest.param(2, {"cp": 2, "cp_mode": "hybrid", "cp_ulysses": 2}, id="hybrid2"),
    pytest.param(4, {"cp": 4, "cp_mode": "hybrid", "cp_ulysses": 2}, id="hybrid2x2"),
    pytest.param(4, {"cp": 2, "dp_shard": 2, "zero": 3}, id="ring2-fsdp2"),
    pytest.param(4, {"cp": 2, "dp_replicate": 2, "dp_shard": 1, "zero": 0}, id="ring2-ddp2"),
    pytest.param(4, {"cp": 2, "tp": 2, "dp_shard": 1}, id="ring2-tp2"),
    pytest.param(4, {"cp": 2, "cp_mode": "ulysses", "tp": 2, "sp": True, "dp_shard": 1}, id="ulysses2-tp2-sp"),
    pytest.param(4, {"cp": 2, "pp": 2, "dp_shard": 1}, id="ring2-pp2"),
]


@pytest.mark.parametrize("world,parallel", LAYOUTS)
def test_training_matches_one_process(world, parallel, reference, short_docs, tmp_path):
    got = run_on(world, train_collect, _config(str(tmp_path), short_docs, parallel=parallel))[0]
    assert_runs_match(reference, got)


def test_one_process_block_skipping_attention(reference, short_docs, tmp_path):
    """data.skip_masked_blocks at cp = 1: the tiled attention (masked tiles skipped) trains
    exactly like the model's dense masked attention."""
    from meshfold.parallel.cp.attention import ContextParallelAttention
    from meshfold.models.llama import document_causal_mask
    from meshfold.train.trainer import Trainer

    got = train_collect(_config(str(tmp_path), {**short_docs, "skip_masked_blocks": True}))
    assert_runs_match(reference, got)
    trainer = Trainer(from_dict(_config(str(tmp_path / "t"), {**short_docs, "skip_masked_blocks": True})))
    cores = [b.attention.core for b in trainer.model.layers.values()]
    assert all(isinstance(c, ContextParallelAttention) for c in cores)
    batch = trainer.local_batch()
    trainer.forward_loss(batch)
    work = cores[0].plan.work  # one plan shared by the layers
    pos = torch.arange(batch["inputs"].shape[1]).expand_as(batch["inputs"])
    visible = int(document_causal_mask(batch["doc_ids"], batch["doc_ids"], pos, pos).sum())
    assert work.visible == visible * len(cores)  # exactly the document-causal entries
    tile = cores[0].plan.tile
    assert work.skipped_tiles > 0 and work.computed < work.tiles * batch["inputs"].shape[0] * tile * tile


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_training_with_recompute(recompute, reference, short_docs, tmp_path):
    # The recomputed forward re-runs the ring inside backward, on every cp rank alike.
    got = run_on(2, train_collect, _config(str(tmp_path), short_docs, parallel={"cp": 2, "cp_mode": "ring"},
                                           train={"recompute": recompute}))[0]
    assert_runs_match(reference, got)


def test_training_without_document_masks(short_docs, tmp_path):
    import json

    data = {**short_docs, "doc_mask": False, "val_docs": 16}  # causal across the packed documents
    train = {"eval_every": 5, "eval_batches": 2}  # validation loss on sharded batches too
    ref = train_collect(_config(str(tmp_path / "ref"), data, train=train))
    got = run_on(2, train_collect, _config(str(tmp_path / "cp"), data, parallel={"cp": 2}, train=train))[0]
    assert_runs_match(ref, got)
    ref_rec, records = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                        for run in ("ref", "cp"))
    assert records[-1]["val_loss"] == pytest.approx(ref_rec[-1]["val_loss"], rel=1e-10)
    # Causal only, balanced split: both ranks did exactly the same attention work each step.
    assert [r["cp_imbalance"] for r in records] == [1.0] * 5
    assert all(r["comm_bytes"]["cp"] > 0 for r in records)


# --------------------------------------------------------------------------- latent attention (MLA)


def mla_cases(cases):
    """A tiny float64 MLA model (q/k heads 8 + 4 wide, v heads 8: narrower, as in DeepSeek)
    under cp on the whole world, per (cp_mode, balance, doc_mask, cp_ulysses): loss and every gradient
    (summed over the cp ranks) against one process on the whole batch, as max abs errors;
    plus whether ring steps carried the latent (the ``attend`` override)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshfold.config import Config, ModelConfig, ParallelConfig
    from meshfold.mesh import build_mesh
    from meshfold.models.llama import Transformer
    from meshfold.parallel.cp.batch import shard_batch
    from meshfold.parallel.cp.plan import apply_context_parallel

    cp = dist.get_world_size()
    b, S = 2, 32
    mcfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=64, seq_len=S, mla_kv_rank=16,
                       mla_q_rank=24, mla_rope_dim=4, mla_nope_dim=8, mla_v_dim=8)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (b, S), generator=gen)
    labels = torch.randint(0, 64, (b, S), generator=gen)

    def run(model, batch):
        logits = model(batch["inputs"], positions=batch.get("positions"), doc_ids=batch.get("doc_ids"))
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        loss.backward()
        return loss.detach()

    results = []
    for mode, balance, doc, ulysses in cases:
        batch = {"inputs": tokens, "labels": labels}
        if doc:
            batch["doc_ids"] = _doc_ids(b, S)
        torch.manual_seed(0)
        ref = Transformer(mcfg).double()
        want = run(ref, {**batch, "positions": torch.arange(S).expand(b, -1)})
        torch.manual_seed(0)
        model = Transformer(mcfg).double()
        cfg = Config(model=mcfg, parallel=ParallelConfig(cp=cp, dp_shard=1, cp_mode=mode, cp_balance=balance,
                                                         cp_ulysses=ulysses))
        plan = apply_context_parallel(model, cfg, build_mesh(cfg.parallel))
        got = run(model, shard_batch(batch, plan))
        dist.all_reduce(got)
        errors = [float((got - want).abs())]
        for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
            g = p.grad.clone()
            dist.all_reduce(g)
            errors.append(float((g - p_ref.grad).abs().max()))
        latent = "attend" in vars(model.layers["0"].attention)
        results.append({"errors": errors, "latent": latent, "ulysses": plan.ulysses})
    return results


def test_latent_attention_matches_one_process():
    """MLA under ring (latent on the ring), Ulysses (expanded heads all-to-all) and hybrid
    2 x 2 (Ulysses, then the expanded heads on the ring) at cp 4, float64: loss and grads
    within 1e-10 of one process (observed ~1e-14)."""
    cases = [("ring", True, True, 0), ("ring", False, False, 0), ("ulysses", True, True, 0),
             ("hybrid", True, True, 2), ("hybrid", True, False, 2)]
    per_rank = run_on(4, mla_cases, cases)
    for i, case in enumerate(cases):
        for rank, res in enumerate(per_rank):
            assert max(res[i]["errors"]) < 1e-10, f"{case} rank {rank}: errors {res[i]['errors']}"
    assert [per_rank[0][i]["latent"] for i in range(len(cases))] == [True, True, False, False, False]
    assert [per_rank[0][i]["ulysses"] for i in range(len(cases))] == [1, 1, 4, 2, 2]


def test_metadata_cache_forgets_a_batch_once_its_doc_ids_are_gone():
    """The layers' shared metadata is keyed by the identity of the positions and doc-id
    tensors. The default positions outlive every batch, and a freed doc-id tensor's id is
    reused by a later batch's: the entry must end with either tensor, or a later batch
    reads an earlier one's document layout (seen as a cp = 1 block-skipping run that went
    wrong at its third step after unrelated tests had run in the same process)."""
    import gc

    from meshfold.parallel.cp.attention import _MetaCache
    from meshfold.parallel.cp.groups import ContextParallelPlan

    cache = _MetaCache(ContextParallelPlan(1, 1, False, 0, None, None, None))
    positions = torch.arange(8).expand(2, 8)  # lives on, as the layer's default positions do
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]] * 2)
    first = cache.get(positions, docs)
    assert torch.equal(first[0, 1], docs) and len(cache.entries) == 1
    del docs, first
    gc.collect()
    assert not cache.entries  # gone with the doc ids, though the positions live
    other = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]] * 2)
    assert torch.equal(cache.get(positions, other)[0, 1], other)
