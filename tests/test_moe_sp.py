"""MoE blocks under tensor + sequence parallel (Megatron's layout: each tp rank routes its own
1/tp of the sequence, the tokens are gathered around the tp-split experts and the block's
output stays sequence-sharded) against a one-process reference, float64: losses of 2
steps (an optimizer update between them), every gradient and parameter after the second
update, the global expert load of every step, and the rows the MoE blocks see on each rank."""

import json
from pathlib import Path

import pytest

from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

# softmax router, top-2, a shared expert; global-batch, sequence-wise and z losses large enough to matter
MOE = {"moe_experts": 4, "moe_topk": 2, "moe_aux_loss_coef": 0.05, "moe_z_loss_coef": 1e-3,
       "moe_seq_aux_loss_coef": 0.02, "moe_shared_experts": 1}
TRAIN = {"steps": 2}


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _train_counting_router_rows(cfg_dict: dict) -> dict | None:
    """``train_collect`` plus the token rows every router saw on this rank (all ranks report)."""
    import torch.distributed as dist

    from meshfold.config import from_dict
    from meshfold.models.moe import moe_layers
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    trainer.capture_grads = True
    rows = [0]
    for _, moe in moe_layers(trainer.model):
        moe.register_forward_hook(lambda mod, args, out: rows.__setitem__(0, rows[0] + args[0].shape[:2].numel()))
    losses = trainer.fit()
    params, grads = trainer.full_state(), trainer.last_grads  # collectives: on every rank
    out = {"rows": rows[0]}
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.update(losses=losses, params=params, grads=grads)
    return out


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    out = _train_counting_router_rows(tiny_config(str(run_dir), model=MOE, train=TRAIN))
    return out, _metrics(run_dir)


@pytest.mark.parametrize("world,parallel", [
    pytest.param(2, {"tp": 2, "sp": True}, id="tp2-sp-experts-split"),
    pytest.param(4, {"dp_shard": 2, "tp": 2, "sp": True, "ep": 2}, id="tp2-sp-ep2"),
])
def test_moe_with_sequence_parallel_matches_one_process(world, parallel, ref, tmp_path):
    ref_out, ref_metrics = ref
    outs = run_on(world, _train_counting_router_rows,
                  tiny_config(str(tmp_path), model=MOE, parallel=parallel, train=TRAIN))
    assert_runs_match(ref_out, outs[0], rtol=1e-9, atol=1e-11)
    for mine, theirs in zip(_metrics(tmp_path), ref_metrics, strict=True):
        assert mine["expert_load"] == theirs["expert_load"]  # global statistics: reduced over tp and dp
        assert mine["expert_imbalance"] == pytest.approx(theirs["expert_imbalance"], rel=1e-12)
        assert mine["comm_bytes"]["tp"] > 0
    # each rank's MoE blocks saw its 1/(dp tp) of the tokens: nothing routed twice
    assert [o["rows"] for o in outs] == [ref_out["rows"] // world] * world


def _gates_across_tp(sp: bool, n: int, experts: int) -> tuple:
    """``tokens_in`` on a real tp group of 2 under bf16 autocast: the gates it returns and the
    gradient their fp32 originals get when each tp rank uses only its expert column's gates
    (weights ``c``: fp32 values that bf16 cannot hold)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshfold.parallel.ep.dispatch import tokens_in
    from meshfold.parallel.tp.collectives import TensorParallelGroup

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    tp = TensorParallelGroup(mesh, mesh.get_group(), 2, rank, sp)
    gen = torch.Generator().manual_seed(7)
    g_all = torch.rand(2 * n, generator=gen, dtype=torch.float32)
    expert_all = torch.randint(0, experts, (2 * n,), generator=gen)
    c_all = torch.randn(2 * n, generator=gen, dtype=torch.float32)
    mine = slice(rank * n, (rank + 1) * n) if sp else slice(None)  # sp: this rank's tokens only
    g = g_all[mine].clone().requires_grad_()
    x = torch.randn(g.shape[0] // 2, 4, generator=gen)  # top-2: two assignments per row
    token = torch.arange(x.shape[0]).repeat_interleave(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, expert, w = tokens_in(tp, x, token, expert_all[mine], g)
        column = expert // (experts // 2) == rank  # this rank's experts
        (w[column].float() * c_all[column]).sum().backward()
    return w.dtype, w.detach().float(), g.grad


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_gates_cross_tp_in_bf16_and_their_gradient_sum_is_exact(sp):
    """Under bf16 autocast the gates cross tp in bf16 (as the tokens do): the values are the
    gates rounded to bf16, and the gradient summed over tp is exactly each assignment's one
    non-zero term (the owning rank's, a bf16 number): what one process gets from the same
    loss on the rounded gates."""
    import torch

    n, experts = 8, 4
    outs = run_on(2, _gates_across_tp, sp, n, experts)
    gen = torch.Generator().manual_seed(7)
    g_all = torch.rand(2 * n, generator=gen, dtype=torch.float32)
    torch.randint(0, experts, (2 * n,), generator=gen)
    c_all = torch.randn(2 * n, generator=gen, dtype=torch.float32)
    for rank, (dtype, w, grad) in enumerate(outs):
        assert dtype == torch.bfloat16
        assert torch.equal(w, g_all.bfloat16().float())  # sp: gathered rank-major
        want = c_all.bfloat16().float()  # d/dg of c * bf16(g): c rounded as autograd casts it back
        assert torch.equal(grad, want[rank * n:(rank + 1) * n] if sp else want)
