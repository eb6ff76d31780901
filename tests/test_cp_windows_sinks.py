"""Context parallel attention (ring, Ulysses, hybrid) with sliding windows, attention sinks and
a softmax scale of the layer's own, against the one-process core attention, float64.

Every rank computes the one-process attention (``CoreAttention(window=..., scale=...)`` with
the sinks) on the same random q/k/v and the cp attention on its slice, and compares its
slice of the output and of dq/dk/dv, and the sinks' gradient summed over the cp ranks
(what the data-parallel reduction over dp x cp sums in training). Tolerance 1e-12 absolute.
The ring skips (never computes) the tile pairs wholly outside the window: more skipped
tiles than without it; with a window shorter than a chunk it skips the sends no member needs
(ledger bytes), and the gpt-oss shape trains at cp 2 and cp 4 as one process.
"""

import pytest
import torch

from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect
from tests.test_gpt_oss import MODEL, _layouts, short_docs

ATOL = 1e-12


def _doc_ids(batch: int, seq: int) -> torch.Tensor:
    cuts = [torch.tensor([5, 18]), torch.tensor([9, 10, 27])]
    return torch.stack([torch.bucketize(torch.arange(seq), cuts[r % 2]) for r in range(batch)])


def cp_cases(cases):
    """Each (cp_mode, balance, documents, window, sinks, scale, cp_ulysses[, chunk]) on the whole
    world as one cp group: (max errors of out, dq, dk, dv, d sinks; skipped tiles; cp bytes
    sent) on this rank."""
    import torch.distributed as dist

    from meshfold.comm import reset_ledger
    from meshfold.config import Config, ModelConfig, ParallelConfig
    from meshfold.mesh import build_mesh
    from meshfold.models.llama import CoreAttention
    from meshfold.parallel.cp.attention import ContextParallelAttention, _MetaCache
    from meshfold.parallel.cp.batch import token_indices
    from meshfold.parallel.cp.groups import build_plan

    cp = dist.get_world_size()
    b, S, H, Hkv, d = 2, 32, 4, 2, 8
    results = []
    for mode, balance, doc, window, with_sinks, scale, ulysses, *chunk in cases:
        chunk = chunk[0] if chunk else 0
        cfg = Config(model=ModelConfig(dim=H * d, n_heads=H, n_kv_heads=Hkv, seq_len=S),
                     parallel=ParallelConfig(cp=cp, dp_shard=1, cp_mode=mode, cp_balance=balance,
                                             cp_ulysses=ulysses))
        plan = build_plan(cfg, build_mesh(cfg.parallel))
        plan.tile = 4  # several tiles per rank, so the window leaves whole pairs out
        core = ContextParallelAttention(plan, _MetaCache(plan), window, scale, chunk)
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(b, S, H, d, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(b, S, Hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(b, S, Hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
        sinks = (torch.randn(H, generator=gen, dtype=torch.float64) * 2).requires_grad_() if with_sinks else None
        dout = torch.randn(b, S, H, d, generator=gen, dtype=torch.float64)
        pos = torch.arange(S).expand(b, -1)
        docs = _doc_ids(b, S) if doc else None
        ref = CoreAttention(dense=True, window=window, scale=scale, chunk=chunk)(q, k, v, positions=pos, doc_ids=docs,
                                                                               sinks=sinks)
        ref.backward(dout)

        idx = token_indices(S, cp, plan.cp_rank, plan.ulysses, plan.balance)
        ql, kl, vl = (t.detach()[:, idx].requires_grad_() for t in (q, k, v))
        sl = None if sinks is None else sinks.detach().clone().requires_grad_()
        lpos, ldoc = pos[:, idx].contiguous(), None if docs is None else docs[:, idx].contiguous()
        sent = reset_ledger()
        out = core(ql, kl, vl, positions=lpos, doc_ids=ldoc, sinks=sl)
        out.backward(dout[:, idx])
        ring_bytes = sent.total["cp"]
        errors = [float((got.detach() - want[:, idx]).abs().max())
                  for got, want in ((out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad))]
        if sl is not None:
            total = sl.grad.clone()
            dist.all_reduce(total)
            errors.append(float((total - sinks.grad).abs().max()))
        results.append({"errors": errors, "skipped": plan.work.skipped_tiles, "bytes": ring_bytes})
    return results


CASES = [(mode, balance, doc, window, sinks, scale, 0)
         for mode, balance in (("ring", True), ("ring", False), ("ulysses", True))
         for doc in (False, True)
         for window, sinks, scale in ((5, True, None), (0, True, 0.3), (7, False, 0.3))]


@pytest.mark.parametrize("cp", [2, 4])
def test_windows_sinks_scale_match_one_process(cp):
    cases = CASES + [("ring", True, True, 0, False, None, 0)]  # (the plain layout, for the skipped-tile count)
    if cp == 4:
        cases += [("hybrid", True, True, 5, True, None, 2)]
    per_rank = run_on(cp, cp_cases, cases)
    for i, case in enumerate(cases):
        for rank, res in enumerate(per_rank):
            assert max(res[i]["errors"]) < ATOL, f"cp={cp} {case} rank {rank}: errors {res[i]['errors']}"
    windowed, plain = cases.index(("ring", True, True, 5, True, None, 0)), len(CASES)
    assert sum(r[windowed]["skipped"] for r in per_rank) > sum(r[plain]["skipped"] for r in per_rank)


def test_window_shorter_than_a_chunk_skips_ring_sends():
    """Balanced ring (member m holds chunks m and 2R-1-m of S/(2R) tokens) with a window of 3
    keys, shorter than a chunk (S = 32: 8 tokens at cp 2, 4 at cp 4): member m's queries see
    only members m-1 and m+1 (the end members only one of them), and of each only the tile
    next to its own chunk: at cp 4 no block goes to a member at ring distance 2, and members
    1 and 2 send half a block (one of its two tiles) forward, half backward and half a
    gradient to each neighbour, members 0 and 3 to one: 3 and 1.5 blocks instead of 3 + 3 +
    4 relayed; at cp 2 a quarter block each way (bytes counted by the ledger, float64).
    Output and gradients equal one process (1e-12) at cp 2 and cp 4, with and without
    documents."""
    cases = [("ring", True, doc, 3, sinks, None, 0) for doc, sinks in ((False, False), (True, True))]
    cases += [("ring", True, False, 0, False, None, 0)]  # full causal attention: the relayed ring
    block = 2 * 2 * 8 * 2 * 8 * 8  # [k, v] x b x Hkv x (S/R tokens at cp 4) x d x 8 bytes, cp 4
    for cp in (2, 4):
        per_rank = run_on(cp, cp_cases, cases)
        for i, case in enumerate(cases):
            for rank, res in enumerate(per_rank):
                assert max(res[i]["errors"]) < ATOL, f"cp={cp} {case} rank {rank}: errors {res[i]['errors']}"
        one_block, meta = block * 4 // cp, (cp - 1) * 2 * 2 * (32 // cp) * 8  # (+ the positions/doc ids gather)
        # direct: to each member that needs it, forward and backward, the key tiles it sees, and
        # their gradient back; the end members (0: chunks 0 and 2R-1; R-1: chunks R-1 and R) need
        # one neighbour. A member's block is 2 chunks: cp 4, one tile (= chunk) of 2 is seen;
        # cp 2, one tile of 4 (tiles of 4 tokens, chunks of 8)
        want = [0.75, 0.75] if cp == 2 else [1.5, 3, 3, 1.5]
        for rank, res in enumerate(per_rank):
            assert res[2]["bytes"] - meta == (2 * (cp - 1) + cp) * one_block  # relayed: kv fwd + bwd, R gradient hops
            assert res[0]["bytes"] - meta == res[1]["bytes"] - meta == want[rank] * one_block, (cp, rank, res)


def test_window_shorter_than_a_chunk_trains_as_one_process(tmp_path):
    """The gpt-oss shape (sinks; windows of 3 keys on alternate layers, full attention on the
    others) on packed documents of rows of 32: 5 steps' losses, every parameter and gradient
    equal one process's (float64) under cp 4 ring and cp 4 hybrid (Ulysses 2 x ring 2), where
    the window is shorter than a balanced chunk (4 tokens): the windowed layers' direct ring and
    the full layers' relayed ring in the same step. (cp 2, window 5 shorter than its chunks of 8: tests/test_gpt_oss.py's
    cp 2 ring x FSDP 2 run.)"""
    data = short_docs(tmp_path)

    def cfg(name, **parallel):
        return tiny_config(str(tmp_path / name), model={**MODEL, "alternating_window": 3}, parallel=parallel,
                           train={"steps": 5}, data=data)

    ref = train_collect(cfg("one"))
    names = ("cp4ring", "cp4hybrid")
    layouts = [cfg(names[0], cp=4, dp_shard=1), cfg(names[1], cp=4, cp_mode="hybrid", cp_ulysses=2, dp_shard=1)]
    for name, got in zip(names, run_on(4, _layouts, layouts)[0]):
        try:
            assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
