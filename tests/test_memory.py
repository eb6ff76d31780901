"""Recomputation, offload and mixed precision change memory and speed, never the maths."""

import pytest
import torch

from meshfold.config import ModelConfig, TrainConfig
from meshfold.models.llama import Transformer, init_weights
from meshfold.parallel.recompute import apply_recompute
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect
from meshfold.memory import count_saved_activations


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("ref"))))


@pytest.mark.parametrize("train", [
    {"recompute": "selective"},
    {"recompute": "op"},
    {"recompute": "full"},
    {"recompute": "full", "recompute_every": 2},
    {"offload": "optimizer"},
], ids=["selective", "op", "full", "full-every-2", "offload-optimizer"])
def test_one_process_matches_plain_training(train, reference, tmp_path):
    got = train_collect(tiny_config(str(tmp_path), train=train))
    assert_runs_match(reference, got)


@pytest.mark.parametrize("train", [
    {"recompute": "full"},
    {"recompute": "selective", "offload": "params"},
    {"offload": "optimizer"},
], ids=["fsdp-full", "fsdp-selective-offload-params", "fsdp-offload-optimizer"])
def test_composes_with_fsdp(train, reference, tmp_path):
    cfg = tiny_config(str(tmp_path), parallel={"dp_shard": 2, "zero": 3}, train=train)
    assert_runs_match(reference, run_on(2, train_collect, cfg)[0])


def _train_each(cfgs: list) -> list:
    return [train_collect(cfg) for cfg in cfgs]


def test_op_recompute_composes_with_fsdp_tensor_and_context_parallel(reference, tmp_path):
    # torchtitan's op policy under FSDP2 (ZeRO-3), under tp 2 with and without sequence
    # parallel (its in-place all-reduce / reduce-scatter re-run in the recompute) and under
    # ring context parallel (the ring re-run, its attention kernels cached), float64,
    # against plain one-process training; the four layouts share one pooled call.
    layouts = [{"dp_shard": 2, "zero": 3}, {"tp": 2, "dp_shard": 1}, {"tp": 2, "sp": True, "dp_shard": 1},
               {"cp": 2, "dp_shard": 1}]
    cfgs = [tiny_config(str(tmp_path / str(i)), parallel=p, train={"recompute": "op"}) for i, p in enumerate(layouts)]
    for layout, got in zip(layouts, run_on(2, _train_each, cfgs)[0]):
        assert_runs_match(reference, got), layout


def _block_saved_bytes(mode: str, every: int = 1, layer: str = "1"):
    cfg = ModelConfig(dim=64, n_layers=4, n_heads=4, vocab_size=256, seq_len=64)
    model = Transformer(cfg).double()
    init_weights(model, cfg, seed=0)
    apply_recompute(model, TrainConfig(recompute=mode, recompute_every=every))
    tokens = torch.randint(0, 256, (2, 64))
    h = model.tok_embeddings(tokens)
    rope = model._rope(None, 64, None)
    with count_saved_activations(model) as counter:
        model.layers[layer](h, rope)
    return counter.bytes, h.numel() * h.element_size(), model


def test_full_recompute_keeps_only_the_block_input():
    none, block_input, _ = _block_saved_bytes("none")
    full, _, _ = _block_saved_bytes("full")
    assert full == block_input
    # A Llama block with SwiGLU keeps ~21 input-sized tensors without recomputation.
    assert none / full > 15
    # every-2: block 1 is not recomputed, block 2 is.
    assert _block_saved_bytes("full", every=2, layer="1")[0] == none
    assert _block_saved_bytes("full", every=2, layer="2")[0] == block_input


def test_selective_recompute_drops_exactly_the_core_attention_state():
    none, _, model = _block_saved_bytes("none")
    selective, _, _ = _block_saved_bytes("selective")
    # Selective frees what the core attention saves beyond its inputs (q, k, v, which the
    # checkpoint keeps) and its output (which the output projection saves anyway): the
    # softmax statistics of the fused kernel, and the s x s scores of an unfused one.
    q = torch.randn(2, 64, 4, 16, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn_like(q, requires_grad=True), torch.randn_like(q, requires_grad=True)
    with count_saved_activations() as counter:
        out = model.layers["0"].attention.core.__class__()(q, k, v)
    inputs_and_output = 3 * q.numel() * q.element_size() + out.numel() * out.element_size()
    assert none - selective == counter.bytes - inputs_and_output > 0


def test_op_recompute_keeps_every_other_matmul_and_the_attention_kernel():
    none, block_input, model = _block_saved_bytes("none")
    selective, _, _ = _block_saved_bytes("selective")
    op, _, _ = _block_saved_bytes("op")
    full, _, _ = _block_saved_bytes("full")
    assert full < op < selective < none
    # Exactly: the block input, the outputs of wq, wv, w1 and w2 (the 1st, 3rd, 5th and 7th
    # matmul), and the fused attention kernel's output and log-sum-exp ([b, heads, s]).
    b, s, d = 2, 64, 64
    hidden = model.layers["1"].feed_forward.w1.out_features
    lse = b * 4 * s * 8
    assert op == block_input + 8 * b * s * (d + d + hidden + d) + 8 * b * s * d + lse
    # as the planner prices it (float64: 8 bytes; the fused kernel keeps its lse)
    from meshfold.planner.counts import layer_activation_bytes

    assert layer_activation_bytes(model.cfg, s, b, 1, False, "op", 8, flash=True, dropout=False) == op


def test_bf16_fsdp_trains_close_to_fp32(tmp_path):
    fp32 = tiny_config(str(tmp_path / "a"), parallel={"dp_shard": 2}, train={"dtype": "float32"})
    bf16 = tiny_config(str(tmp_path / "b"), parallel={"dp_shard": 2}, train={"dtype": "bfloat16"})
    a = run_on(2, train_collect, fp32)[0]["losses"]
    b = run_on(2, train_collect, bf16)[0]["losses"]
    assert all(abs(x - y) / x < 0.02 for x, y in zip(a, b)), (a, b)


def test_offload_params_needs_fsdp():
    from meshfold.config import ConfigError, from_dict, validate

    with pytest.raises(ConfigError, match="train.offload = params"):
        validate(from_dict(tiny_config("/tmp/x", train={"offload": "params"})), 1)


def test_compiled_blocks_match_eager(reference, tmp_path):
    got = train_collect(tiny_config(str(tmp_path), train={"compile": True}))
    # Inductor fuses and reorders float64 arithmetic: equal to rounding, not bitwise.
    assert_runs_match(reference, got, rtol=1e-7, atol=1e-9)
    names = set(got["params"])
    assert not any("_orig_mod" in n for n in names)  # names unchanged by compilation
