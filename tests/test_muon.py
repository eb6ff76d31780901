"""Muon (optim/muon/): exact against a straightforward one-process implementation, and
every layout (FSDP2, tp, FSDP x tp, HSDP, ZeRO-1 x tp, ep, pp) against one process in
float64, with every matrix orthogonalised by its owner only."""

import math

import pytest
import torch
from torch import nn

from meshfold.optim.muon.newton_schulz import DEFAULT_COEFFICIENTS, update_scale
from meshfold.optim.muon.optimizer import Muon, split_params
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect


def reference_orthogonalize(g, steps=5, coefficients=DEFAULT_COEFFICIENTS):
    """Newton-Schulz on one matrix, written out."""
    a, b, c = coefficients
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if g.shape[0] > g.shape[1] else x


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 9)
        self.experts = nn.Parameter(torch.randn(3, 9, 5))  # [E, a, b]: three matrices
        self.norm = nn.LayerNorm(5)
        self.output = nn.Linear(5, 11, bias=False)

    def forward(self, x):
        h = torch.tanh(self.hidden(self.tok_embeddings(x)))
        h = torch.einsum("ta,eab->tb", h.flatten(0, 1), self.experts)
        return self.output(self.norm(h))


def test_one_process_matches_a_straightforward_muon():
    torch.manual_seed(0)
    model = Tiny().double()
    ref = Tiny().double()
    ref.load_state_dict(model.state_dict())
    muon, adam = split_params(model)
    assert [n for n, _ in muon] == ["experts", "hidden.weight"]  # embeddings, output, norms, biases: AdamW
    lr, wd, mu = 0.02, 0.1, 0.9
    opt = Muon(muon, [{"params": adam, "weight_decay": 0.0}], lr=lr, weight_decay=wd, momentum=mu,
               ns_dtype=torch.float64, adam_kwargs={"lr": lr, "foreach": False})
    ref_muon = [ref.experts, ref.hidden.weight]
    ref_adam = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in ("hidden.weight", "experts")],
                                 lr=lr, weight_decay=0.0, foreach=False)
    bufs = [torch.zeros_like(p) for p in ref_muon]
    x = torch.randint(0, 11, (4, 7))
    for _ in range(4):
        for m in (model, ref):
            m.zero_grad()
            m(x).square().mean().backward()
        opt.step()
        with torch.no_grad():
            for p, buf in zip(ref_muon, bufs):
                buf.mul_(mu).add_(p.grad)
                u = p.grad + mu * buf
                p.mul_(1 - lr * wd)
                for m in range(u.shape[0]) if u.ndim == 3 else [None]:
                    um = u[m] if m is not None else u
                    step = reference_orthogonalize(um) * update_scale(*um.shape, "match_rms_adamw")
                    (p[m] if m is not None else p).sub_(lr * step)
        ref_adam.step()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-15, msg=lambda m, n=name: f"{n}: {m}")
    assert sum(opt.plan.orthogonalized.values()) == 4 * 4  # hidden + 3 experts, 4 steps


# --------------------------------------------------------------------------- every layout

MUON = {"optimizer": "muon", "steps": 5}
# 3 layers: odd numbers of matrices per shape (w2, wo ...); ffn_dim 45: rows FSDP2 pads.
DENSE = {"n_layers": 3, "ffn_dim": 45}
MOE = {"moe_experts": 4, "moe_topk": 2}


def _state_bytes(opt) -> tuple[int, int]:
    """(Muon momentum, AdamW moment) bytes this rank holds (local pieces)."""
    from meshfold.optim.muon.exchange import local_of

    held = [0, 0]
    for s in opt.state.values():
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim():
                held[k != "momentum_buffer"] += local_of(v).numel() * local_of(v).element_size()
    return held[0], held[1]


def _owner_counts(trainer_cfg):
    """Train, and return (rank 0's run, every matrix this rank orthogonalised that it does not
    own, how often it orthogonalised each, how many it owns, its (momentum, AdamW) bytes)."""
    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    import torch.distributed as dist

    trainer = Trainer(from_dict(trainer_cfg))
    trainer.capture_grads = True
    losses = trainer.fit()
    params, grads = trainer.full_state(), trainer.last_grads
    plan = getattr(trainer.optimizer, "plan", None)
    if plan is None:  # AdamW
        return ({"losses": losses, "params": params, "grads": grads} if dist.get_rank() == 0 else None), [], {}, 0, \
            (0, 0)
    foreign = sorted(set(plan.orthogonalized) - plan.owned)
    run = {"losses": losses, "params": params, "grads": grads} if dist.get_rank() == 0 else None
    return run, foreign, dict(plan.orthogonalized), len(plan.owned), _state_bytes(trainer.optimizer)


def train_layouts(cfgs: list[dict]) -> list:
    """Several layouts one after another on one pool (one multi-process task)."""
    return [_owner_counts(cfg) for cfg in cfgs]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = {}
    for name, model in (("dense", DENSE), ("moe", MOE)):
        out[name] = train_collect(tiny_config(str(tmp_path_factory.mktemp(name)), model=model, train=MUON))
    return out


def _check(references, layouts, results):
    for (kind, parallel), per_rank in zip(layouts, zip(*results)):
        run = per_rank[0][0]
        assert_runs_match(references[kind], run, rtol=1e-12, atol=1e-14)
        for rank, (_, foreign, counts, owned, _) in enumerate(per_rank):
            assert not foreign, f"{parallel}: rank {rank} orthogonalised matrices it does not own: {foreign}"
            assert all(c == MUON["steps"] for c in counts.values()), (parallel, counts)
            assert len(counts) == owned, parallel
        if parallel.get("zero") == 1:
            _check_zero_one_states(references[kind], parallel, [r[4] for r in per_rank])


def _check_zero_one_states(reference, parallel, held):
    """ZeRO-1 (whole-parameter ownership): every momentum and AdamW moment element on exactly
    one data-parallel rank of its tp piece (the ranks together hold one process's), and each
    rank about 1/dp of its tp piece's and pipeline stage's momentum (whole matrices: within 10%)."""
    from meshfold.optim.muon.optimizer import is_muon_matrix

    dp, tp = parallel["dp_shard"], parallel.get("tp", 1)  # (ep: experts over ep x edp = dp ranks)
    muon = sum(v.numel() * v.element_size() for n, v in reference["params"].items() if is_muon_matrix(n, v))
    adam = 2 * sum(v.numel() * v.element_size() for n, v in reference["params"].items() if not is_muon_matrix(n, v))
    assert sum(m for m, _ in held) == muon, (parallel, held, muon)
    if tp == 1:  # (under tp the norms' and embeddings' AdamW moments are whole on every tp rank)
        assert sum(a for _, a in held) == adam, (parallel, held, adam)
    per_stage = len(held) // parallel.get("pp", 1)  # (stages outermost in the mesh)
    for rank, (m, _) in enumerate(held):
        share = sum(x for x, _ in held[rank - rank % per_stage: rank - rank % per_stage + per_stage]) / (tp * dp)
        assert abs(m - share) <= 0.1 * share, (parallel, held, muon)


@pytest.mark.parametrize("world,layouts", [
    pytest.param(2, [("dense", {"dp_shard": 2}), ("dense", {"tp": 2, "dp_shard": 1}),
                     ("moe", {"dp_shard": 2, "ep": 2}), ("dense", {"pp": 2, "dp_shard": 1}),
                     ("dense", {"dp_shard": 2, "zero": 1})], id="2-ranks"),
    pytest.param(4, [("dense", {"dp_shard": 2, "tp": 2}), ("dense", {"dp_replicate": 2, "dp_shard": 2}),
                     ("dense", {"dp_shard": 2, "tp": 2, "zero": 1}), ("moe", {"dp_shard": 4, "ep": 2, "zero": 1}),
                     ("dense", {"dp_shard": 2, "pp": 2, "zero": 1})],
                 id="4-ranks"),
])
def test_every_layout_matches_one_process(world, layouts, references, tmp_path):
    cfgs = [tiny_config(str(tmp_path / str(i)), model=DENSE if kind == "dense" else MOE, parallel=parallel,
                        train=MUON) for i, (kind, parallel) in enumerate(layouts)]
    _check(references, layouts, run_on(world, train_layouts, cfgs))


def test_resume_into_another_layout_is_bit_exact(tmp_path):
    """3 steps on dp_shard 2, then 2 more from its checkpoint: on dp_shard 2 bit-exact
    against 5 uninterrupted steps; on tp 2 (momentum resharded) within 1e-12 (tp sums in
    another order). An AdamW checkpoint is refused by a Muon run in one line."""
    from meshfold.testing import train_chain

    def cfg_for(world, parallel, run_dir=tmp_path / "chain", optimizer="muon"):
        return tiny_config(str(run_dir), model=DENSE, parallel=parallel,
                           train={**MUON, "optimizer": optimizer, "checkpoint_every": 0})

    whole = run_on(2, train_collect, cfg_for(2, {"dp_shard": 2}, tmp_path / "whole"))[0]
    starts, losses, params = train_chain([(2, {"dp_shard": 2}, 3), (2, {"dp_shard": 2}, 5)], cfg_for)
    assert starts == [0, 3]
    assert losses == whole["losses"]
    for name, value in whole["params"].items():
        assert torch.equal(params[name], value), name
    _, losses, params = train_chain([(2, {"dp_shard": 2}, 3), (2, {"tp": 2, "dp_shard": 1}, 5)],
                                    lambda w, p: cfg_for(w, p, tmp_path / "cross"))
    assert_runs_match({**whole, "grads": {}}, {"losses": losses, "params": params, "grads": {}},
                      rtol=1e-12, atol=1e-14)

    adam_dir = tmp_path / "adamw"
    run_on(2, __import__("meshfold.testing", fromlist=["train_segment"]).train_segment,
           cfg_for(2, {"dp_shard": 2}, adam_dir, "adamw"), 2)
    with pytest.raises(Exception, match="no Muon momentum"):
        run_on(2, __import__("meshfold.testing", fromlist=["train_segment"]).train_segment,
               cfg_for(2, {"dp_shard": 2}, adam_dir), 4)


def test_resume_between_fsdp_and_zero_one_is_bit_exact(tmp_path):
    """3 steps on FSDP2 dp 2, then 2 on ZeRO-1 dp 2 (the momentum's FSDP2 pieces read back
    as whole matrices by their owners): bit-exact against 5 uninterrupted ZeRO-1 steps; and
    the other way round against 5 FSDP2 steps. Gradient clipping off: its norm sums the
    squares per FSDP2 shard, then over ranks, so it rounds differently from the whole
    gradients' sum; otherwise these layouts compute bit-identical steps (tp's do not: see
    docs/optimizers.md, "Resume")."""
    from meshfold.testing import train_chain

    fsdp, zero_one = {"dp_shard": 2}, {"dp_shard": 2, "zero": 1}

    def cfg_for(parallel, run_dir):
        return tiny_config(str(run_dir), model=DENSE, parallel=parallel,
                           train={**MUON, "checkpoint_every": 0, "grad_clip": 0.0})

    for first, then in ((fsdp, zero_one), (zero_one, fsdp)):
        name = "z1" if then is zero_one else "fsdp"
        whole = run_on(2, train_collect, cfg_for(then, tmp_path / f"whole-{name}"))[0]
        starts, losses, params = train_chain([(2, first, 3), (2, then, 5)],
                                             lambda w, p, d=tmp_path / f"to-{name}": cfg_for(p, d))
        assert starts == [0, 3]
        assert losses == whole["losses"], name
        for key, value in whole["params"].items():
            assert torch.equal(params[key], value), (name, key)


def test_resume_from_zero_one_with_tp_into_fsdp(tmp_path):
    """ZeRO-1 x tp 2 saves each owner's tp pieces of the momentum (the other dp rank holds
    none); 3 steps there, then 2 on FSDP2 dp 2: within 1e-12 of one process (tp's own rounding)."""
    from meshfold.testing import train_chain

    def cfg_for(parallel, run_dir):
        return tiny_config(str(run_dir), model=DENSE, parallel=parallel, train={**MUON, "checkpoint_every": 0})

    whole = train_collect(cfg_for({}, tmp_path / "whole"))
    starts, losses, params = train_chain([(4, {"dp_shard": 2, "tp": 2, "zero": 1}, 3), (2, {"dp_shard": 2}, 5)],
                                         lambda w, p: cfg_for(p, tmp_path / "chain"))
    assert starts == [0, 3]
    assert_runs_match({**whole, "grads": {}}, {"losses": losses, "params": params, "grads": {}},
                      rtol=1e-12, atol=1e-14)
