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
    {"recompute": "full"},
    {"recompute": "full", "recompute_every": 2},
    {"offload": "optimizer"},
], ids=["selective", "full", "full-every-2", "offload-optimizer"])
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
