"""Tensor + sequence parallel against a one-process reference, float64.

Every multi-process run below trains 5 steps of the tiny model (dim 32, 2 layers, 4 heads,
2 kv heads, seq 16, global batch 8, grad clip on) and must match the one-process run
computed in this module: losses at every step, then every parameter and every last-step
gradient, to rtol 1e-9 / atol 1e-11 (float64; only the summation order differs).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshfold.config import ConfigError, from_dict, validate
from meshfold.testing import assert_runs_match, run_on, tiny_config, train_collect

RTOL, ATOL = 1e-9, 1e-11


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("ref"))))


# n_kv_heads = 2: tp 2 splits the kv heads, tp 4 replicates them (one kv head per rank).
LAYOUTS = [
    pytest.param(2, {"tp": 2, "dp_shard": 1}, id="tp2"),
    pytest.param(2, {"tp": 2, "sp": True, "dp_shard": 1}, id="tp2-sp"),
    pytest.param(4, {"tp": 4, "dp_shard": 1}, id="tp4-kv-replicated"),
    pytest.param(4, {"tp": 4, "sp": True, "dp_shard": 1}, id="tp4-sp-kv-replicated"),
    pytest.param(4, {"tp": 2, "dp_shard": 2, "zero": 3}, id="tp2xfsdp2"),
    pytest.param(4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 2}, id="tp2xfsdp2-sp-zero2"),
    pytest.param(8, {"tp": 2, "sp": True, "dp_replicate": 2, "dp_shard": 2, "zero": 3}, id="hsdp2x2xtp2-sp"),
]


@pytest.mark.parametrize("world,parallel", LAYOUTS)
def test_matches_one_process(world, parallel, reference, tmp_path):
    got = run_on(world, train_collect, tiny_config(str(tmp_path), parallel=parallel))[0]
    assert_runs_match(reference, got, rtol=RTOL, atol=ATOL)


def test_uneven_vocabulary_and_tied_embeddings(tmp_path):
    # 321 = 3 * 107: tp 2 holds 161 + 160 rows, tp 4 holds 81 + 81 + 81 + 78; the padded
    # logit columns must not change the loss. Tied input/output embeddings share the shard.
    model = {"vocab_size": 321, "tie_embeddings": True}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=model))
    assert "output.weight" not in ref["params"]
    for world, parallel in [(4, {"tp": 4, "sp": True, "dp_shard": 1}), (4, {"tp": 2, "dp_shard": 2})]:
        got = run_on(world, train_collect, tiny_config(str(tmp_path / str(parallel)), model=model,
                                                        parallel=parallel))[0]
        assert got["params"]["tok_embeddings.weight"].shape == (321, 32)  # unpadded names and shapes
        assert_runs_match(ref, got, rtol=RTOL, atol=ATOL)


def test_gpt_style_block(tmp_path):
    # LayerNorm with bias, GELU MLP, biases everywhere, learned positions, MHA (kv = heads):
    # row-parallel biases and positional rows are replicated and summed over tp under sp.
    model = {"norm": "layernorm", "mlp": "gelu", "bias": True, "pos": "learned", "n_kv_heads": 0}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=model))
    got = run_on(2, train_collect, tiny_config(str(tmp_path / "tp"), model=model,
                                                parallel={"tp": 2, "sp": True, "dp_shard": 1}))[0]
    assert_runs_match(ref, got, rtol=RTOL, atol=ATOL)


# Qwen2/Qwen3/Llama 3.1 features together: q/k/v biases (split with their rows, or
# replicated with the kv heads), per-head q/k RMSNorm (replicated, applied to local heads),
# head_dim 16 != dim / n_heads = 8, scaled RoPE (yarn: frequencies and a cos/sin temperature).
HF_FEATURES = {"qkv_bias": True, "qk_norm": True, "attn_head_dim": 16, "rope_scaling": "yarn", "rope_factor": 4.0,
               "rope_original_seq_len": 8}


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    return train_collect(tiny_config(str(tmp_path_factory.mktemp("hfref")), model=HF_FEATURES))


@pytest.mark.parametrize("world,parallel", [
    pytest.param(2, {"tp": 2, "sp": True, "dp_shard": 1}, id="tp2-sp"),
    pytest.param(4, {"tp": 4, "dp_shard": 1}, id="tp4-kv-replicated"),
    pytest.param(4, {"tp": 2, "cp": 2, "dp_shard": 1}, id="tp2xcp2"),
    pytest.param(4, {"tp": 2, "sp": True, "dp_shard": 2, "zero": 3}, id="tp2xfsdp2-sp"),
])
def test_hf_family_features(world, parallel, hf_reference, tmp_path):
    assert "layers.0.attention.q_norm.weight" in hf_reference["grads"]
    got = run_on(world, train_collect, tiny_config(str(tmp_path), model=HF_FEATURES, parallel=parallel))[0]
    assert_runs_match(hf_reference, got, rtol=RTOL, atol=ATOL)


# DeepSeek's multi-head latent attention (models/deepseek/mla.py): heads split over tp, the latent
# (low-rank q's with the kv's, or the kv's alone beside a full-rank q) gathered or entered.
MLA = {"mla_kv_rank": 16, "mla_rope_dim": 8, "mla_nope_dim": 8, "mla_v_dim": 12, "n_kv_heads": 0}


@pytest.mark.parametrize("world,model,parallel", [
    pytest.param(2, {**MLA, "mla_q_rank": 24}, {"tp": 2, "sp": True, "dp_shard": 1}, id="low-rank-q-tp2-sp"),
    pytest.param(4, {**MLA, "mla_q_rank": 24}, {"tp": 2, "dp_shard": 2, "zero": 3}, id="low-rank-q-tp2xfsdp2"),
    pytest.param(4, MLA, {"tp": 4, "sp": True, "dp_shard": 1}, id="full-q-tp4-sp"),
])
def test_latent_attention(world, model, parallel, tmp_path):
    ref = train_collect(tiny_config(str(tmp_path / "ref"), model=model))
    assert "layers.0.attention.wkv_b.weight" in ref["grads"]
    got = run_on(world, train_collect, tiny_config(str(tmp_path / "tp"), model=model, parallel=parallel))[0]
    assert_runs_match(ref, got, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- sizes


def measure_sizes(cfg_dict: dict) -> dict:
    """Per-rank bytes of the live parameter shards and of the tensors autograd saves for
    backward during one forward of the first micro-batch (counted by storage)."""
    import torch

    from meshfold.memory import count_saved_activations
    from meshfold.train.trainer import Trainer

    trainer = Trainer(from_dict(cfg_dict))
    params = 0
    for p in trainer.model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        params += t.numel() * t.element_size()
    mb = trainer.micro_batches(trainer.local_batch())[0]
    with count_saved_activations(trainer.model) as counted:
        loss = trainer.forward_loss(mb)
    loss.backward()
    hidden = {}
    block = trainer.model.layers["0"]
    def keep_shape(_module, _args, out):
        hidden["residual"] = tuple(out.shape)

    block.register_forward_hook(keep_shape)
    with torch.no_grad():
        trainer.forward_loss(mb)
    return {"params": params, "activations": counted.bytes, "residual": hidden["residual"]}


def test_per_rank_sizes_shrink(tmp_path):
    cfg = lambda name, **par: tiny_config(str(tmp_path / name), model={"n_kv_heads": 4},  # noqa: E731
                                          parallel={"dp_shard": 1, **par})
    one = measure_sizes(cfg("one"))
    tp = run_on(2, measure_sizes, cfg("tp", tp=2))[0]
    sp = run_on(2, measure_sizes, cfg("sp", tp=2, sp=True))[0]
    # Parameters: everything but the 5 norm weights (5 * 32 float64) is split in two.
    replicated = 5 * 32 * 8
    assert tp["params"] == sp["params"] == (one["params"] - replicated) // 2 + replicated
    # The residual stream between blocks: full sequence without sp, half of it with sp.
    assert one["residual"] == tp["residual"] == (8, 16, 32)
    assert sp["residual"] == (8, 8, 32)
    # Saved activations: tp alone keeps the replicated block inputs; with sp everything a block
    # saves is split, leaving only token ids, masks and rotary tables (< 5% of the total) whole.
    ratio_tp, ratio_sp = tp["activations"] / one["activations"], sp["activations"] / one["activations"]
    print(f"saved activations per rank / one process: tp2 {ratio_tp:.3f}, tp2+sp {ratio_sp:.3f}")
    assert ratio_sp < ratio_tp
    assert 0.5 <= ratio_sp <= 0.5 * 1.05


# --------------------------------------------------------------------------- comm bytes


def expected_tp_bytes(b: int, s: int, d: int, n_layers: int, tp: int, sp: bool, elt: int = 8) -> int:
    """Bytes rank 0 sends over tp in one training step (one micro-batch, MHA, RMSNorm,
    untied output), ring convention: all-reduce 2(n-1)/n, all-gather / reduce-scatter (n-1)/n
    of the full tensor. A = one [b, s, d] activation."""
    a, ring = b * s * d * elt, (tp - 1) / tp
    loss = 2 * ring * (b * s * elt + 2 * b * s * elt)  # max, then (sum exp, target logit)
    if not sp:
        # Per block: g forward (attention, MLP) + f backward (attention, MLP): 4 all-reduces.
        # Embedding: g forward; output layer: f backward.
        return round(n_layers * 4 * 2 * ring * a + 2 * 2 * ring * a + loss)
    # Per block and region: all-gather in, reduce-scatter out (forward); backward gathers the
    # input again, reduce-scatters its gradient and all-gathers the output gradient: 5 per region.
    # Plus the two norm-weight gradient all-reduces.
    blocks = n_layers * (2 * 5 * ring * a + 2 * 2 * ring * d * elt)
    # Embedding: reduce-scatter + its backward all-gather; output layer: all-gather, backward
    # all-gather + reduce-scatter; final norm weight gradient all-reduce.
    ends = 2 * ring * a + 3 * ring * a + 2 * ring * d * elt
    return round(blocks + ends + loss)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_comm_bytes_in_metrics(sp, tmp_path):
    cfg = tiny_config(str(tmp_path), model={"n_kv_heads": 4}, parallel={"tp": 2, "sp": sp, "dp_shard": 1},
                      train={"steps": 2})
    run_on(2, train_collect, cfg)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    want = expected_tp_bytes(b=8, s=16, d=32, n_layers=2, tp=2, sp=sp)
    assert [r["comm_bytes"]["tp"] for r in records] == [want, want]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("model,parallel,world,needle", [
    ({"n_heads": 4}, {"tp": 8}, 8, "parallel.tp = 8 is larger than model.n_heads = 4"),
    ({"n_heads": 6, "dim": 48, "n_kv_heads": 0}, {"tp": 4}, 4, "model.n_heads = 6 is not divisible by parallel.tp"),
    ({"n_heads": 12, "n_kv_heads": 4, "dim": 96}, {"tp": 6}, 6, "model.n_kv_heads = 4 and parallel.tp = 6"),
    ({"seq_len": 18}, {"tp": 4, "sp": True}, 4, "parallel.sp needs model.seq_len = 18"),
])
def test_impossible_layouts_fail_in_one_line(model, parallel, world, needle, tmp_path):
    cfg = from_dict(tiny_config(str(tmp_path), model=model, parallel=parallel))
    with pytest.raises(ConfigError) as err:
        validate(cfg, world)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_cli_rejects_layout_before_starting_processes(tmp_path):
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "meshfold", "train", str(root / "configs" / "debug.toml"), "--nproc", "3",
         "--set", "parallel.tp=3", "--set", f"train.run_dir='{tmp_path}'"],
        capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_heads = 4 is not divisible by parallel.tp = 3" in lines[0], out.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bf16_autocast_sequence_parallel(tmp_path):
    # The fused gather + column-linear op casts under autocast itself: bf16 compute, fp32
    # master weights. bf16 rounding differs with the split, so only losses, to 2%.
    import torch

    train = {"dtype": "bfloat16"}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), train=train))
    got = run_on(2, train_collect, tiny_config(str(tmp_path / "tp"), train=train,
                                                parallel={"tp": 2, "sp": True, "dp_shard": 1}))[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=0)
    assert all(g.dtype == torch.float32 for g in got["grads"].values())


def test_bf16_autocast_tensor_parallel_without_sp(tmp_path):
    # Without sp the fp32 residual stream's tp collectives (the embedding's all-reduce, the
    # column-parallel input's gradient all-reduce) travel in bf16 and come back as fp32
    # (tensor.py's wire_dtype): losses within 2% of one process, gradients fp32.
    import torch

    train = {"dtype": "bfloat16"}
    ref = train_collect(tiny_config(str(tmp_path / "ref"), train=train))
    got = run_on(2, train_collect, tiny_config(str(tmp_path / "tp"), train=train,
                                                parallel={"tp": 2, "dp_shard": 1}))[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=0)
    assert all(g.dtype == torch.float32 for g in got["grads"].values())


def test_micro_batches_and_recompute(reference, tmp_path):
    # Gradient accumulation over 2 micro-batches per rank, every block recomputed in backward
    # (its all-gathers / reduce-scatters run again inside the checkpoint).
    got = run_on(4, train_collect, tiny_config(str(tmp_path), parallel={"tp": 2, "sp": True, "dp_shard": 2},
                                               train={"micro_batch": 2, "recompute": "full"}))[0]
    assert_runs_match(reference, got, rtol=RTOL, atol=ATOL)
