"""The planner's collectives are the runtime's: in one real training step on gloo
processes, the calls and bytes rank 0 hands to the communication layer (measured at
``meshfold/comm.py``'s ledger, one count per recorded collective or point-to-point send)
equal the planner's ``collectives`` for the same layout, per mesh dimension.

Every dimension is compared, data parallel included: DDP's communication hook, the
gradient reducer, ZeRO-1's parameter exchange, and FSDP2's own all-gathers and
reduce-scatters (ZeRO-2 and ZeRO-3, whose roots are re-gathered in backward like every
block), all recorded at the communication layer."""

from __future__ import annotations

import pytest

from meshfold.testing import run_on, tiny_config


def _one_step_ledger(cfg_dict: dict) -> dict | None:
    """{dim: {"count", "bytes"}} rank 0 recorded in the ledger during one training step."""
    import torch.distributed as dist

    from meshfold.comm import CommLedger
    from meshfold.config import from_dict
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    trainer.ledger.pop_step()  # set-up traffic is not a step's
    counts: dict[str, int] = {}
    original = CommLedger.add_sent  # every record (collective or send) ends here

    def counting(self, dim, sent_bytes):
        counts[dim] = counts.get(dim, 0) + 1
        original(self, dim, sent_bytes)

    CommLedger.add_sent = counting
    try:
        trainer.train_step()
    finally:
        CommLedger.add_sent = original
    sent = trainer.ledger.pop_step()
    if dist.get_rank() != 0:
        return None
    return {d: {"count": counts[d], "bytes": sent[d]} for d in sent}


def _predicted(cfg_dict: dict, world: int) -> dict:
    from meshfold.config import from_dict
    from meshfold.planner.from_config import footprint

    return footprint(from_dict(cfg_dict), world, device="cpu")["collectives"]


def _compare(parallel: dict, model: dict | None = None, train: dict | None = None, world: int = 4,
             tmp_path=None) -> None:
    sections = {"parallel": parallel, "train": {"steps": 1, **(train or {})}}
    if model:
        sections["model"] = model
    cfg = tiny_config(str(tmp_path / "run"), **sections)
    measured = run_on(world, _one_step_ledger, cfg)[0]
    predicted = _predicted(cfg, world)
    assert set(predicted) == set(measured), (predicted, measured)
    for dim, got in measured.items():
        want = predicted[dim]
        assert want["count"] == got["count"], (dim, predicted, measured)
        # the ledger rounds each step's bytes to an integer
        assert want["bytes"] == pytest.approx(got["bytes"], rel=1e-9, abs=1), (dim, predicted, measured)


@pytest.mark.parametrize("parallel,train", [
    ({"dp_replicate": 4, "zero": 0}, {}),  # DDP: one bucket per step
    ({"dp_replicate": 4, "zero": 0}, {"micro_batch": 1}),  # ... whatever the micro-batches
    ({"dp_shard": 4, "zero": 1}, {"micro_batch": 1}),  # + ZeRO-1's exchange of updated params
], ids=["ddp", "ddp-8-micro", "zero1-8-micro"])
def test_dp_collectives_match_runtime(tmp_path, parallel, train):
    _compare(parallel, train=train, tmp_path=tmp_path)


@pytest.mark.parametrize("parallel,model,train", [
    ({"tp": 2, "dp_shard": 2, "zero": 3}, None, {}),  # Megatron tp around FSDP
    ({"tp": 2, "sp": True, "dp_shard": 2}, None, {}),  # sequence parallel: gathers, re-gathers, norms
    ({"tp": 2, "sp": True, "dp_shard": 2}, None, {"recompute": "full", "micro_batch": 2}),
    ({"cp": 2, "dp_shard": 2, "zero": 2}, None, {}),  # ring hops + positions/doc ids + work counter
    ({"cp": 2, "cp_mode": "ulysses", "dp_shard": 2, "zero": 2}, None, {}),  # q, k, v, out all-to-alls (GQA)
    ({"pp": 2, "dp_shard": 2, "zero": 1}, None, {}),  # activations, loss and bubble statistics; dp
    ({"pp": 2, "dp_replicate": 2, "zero": 0, "pp_schedule": "interleaved", "pp_virtual_stages": 2},
     {"n_layers": 4}, {}),  # interleaved: stage 0 also sends gradients back from its second chunk
    ({"tp": 2, "sp": True, "pp": 2}, None, {}),  # rank 0 is stage 0: embedding, no output or loss
    ({"tp": 2, "dp_shard": 2, "zero": 1},  # learned positions: whole on every tp rank, in dp's buckets
     {"pos": "learned", "norm": "layernorm", "bias": True, "mlp": "gelu"}, {}),
], ids=["tp-fsdp", "tp-sp", "tp-sp-recompute", "cp-ring", "cp-ulysses", "pp-zero1", "pp-interleaved-ddp", "tp-sp-pp",
        "tp-zero1-gpt2"])
def test_model_parallel_collectives_match_runtime(tmp_path, parallel, model, train):
    _compare(parallel, model=model, train=train, tmp_path=tmp_path)


# train.dtype = bfloat16 (fp32 master weights, bf16 compute weights, bf16 residual stream): the
# tp activations and their gradients travel in bf16 (parallel/tp/collectives.py's wire_dtype), the
# loss's per-token statistics in fp32, and replicated weights' gradients in the dtype backward
# makes them: the compute weights' (bf16: FSDP2's param_dtype or the step's compute copies,
# parallel/compute_weights.py). Exact, as in float64.
@pytest.mark.parametrize("world,parallel,model", [
    (8, {"tp": 2, "pp": 2, "dp_shard": 2, "zero": 1}, None),  # f's gradient all-reduce, embedding all-reduce
    (4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 1}, None),  # embedding reduce-scatter + all-gather
    (4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 3},  # FSDP2: bf16 weight gradients; per-head norms
     {"n_kv_heads": 1, "qk_norm": True}),  # and replicated kv weights summed over tp
    (2, {"tp": 2, "sp": True, "dp_shard": 1},  # norm biases, wo/w2 biases, learned positions
     {"bias": True, "norm": "layernorm", "pos": "learned", "mlp": "gelu"}),
    (4, {"tp": 2, "dp_shard": 2, "zero": 1},  # experts split over tp: the tokens enter in bf16,
     {"moe_experts": 4, "moe_topk": 2, "moe_shared_experts": 1}),  # the gates in bf16; shared experts
    (4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 1},  # MoE with sp: tokens (bf16), experts (int64),
     {"moe_experts": 4, "moe_topk": 2, "moe_shared_experts": 1}),  # gates (bf16) gathered; stats, router
], ids=["tp2xpp2xdp2-zero1", "tp2-sp-zero1", "tp2-sp-fsdp-qknorm-kv1", "tp2-sp-gpt2", "tp2-moe-zero1",
        "tp2-sp-moe-zero1"])
def test_tp_collectives_match_runtime_in_bfloat16(tmp_path, world, parallel, model):
    _compare(parallel, model=model, train={"dtype": "bfloat16"}, world=world, tmp_path=tmp_path)


@pytest.mark.parametrize("model", [
    {"preset": "llama3-405b"},  # 126 blocks, GQA 8 kv heads: 8 buckets a block at tp 1
    {"preset": "llama3-1b"},  # tied embeddings
    {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "mlp": "gelu"},
])
def test_planner_knows_the_parameter_list_the_grad_reducer_buckets(model):
    # The planner prices the gradient reducer's buckets (tp/pp with zero 0/1) from the
    # parameter sizes in registration order: they are the model's, in the same order.
    import torch

    from meshfold.config import ModelConfig
    from meshfold.models.llama import Transformer
    from meshfold.models.presets import preset
    from meshfold.planner.counts import chunk_param_sizes, reducer_buckets

    m = preset(model.pop("preset")) if "preset" in model else ModelConfig(**model)
    with torch.device("meta"):
        params = list(Transformer(m).parameters())
    sizes = chunk_param_sizes(m, 1, m.n_layers, True, True)
    assert sizes == [p.numel() for p in params]
    # greedy packing in reverse, a parameter larger than a bucket alone (parallel/dp/replicate.py)
    assert reducer_buckets([10, 10, 10], bucket_bytes=25) == 2
    assert reducer_buckets([30, 5, 30], bucket_bytes=25) == 3
