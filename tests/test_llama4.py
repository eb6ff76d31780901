"""Llama 4 (``llama4_text``, ``meshfold/models/llama4/``) against transformers' Llama4ForCausalLM
on a random tiny model (4 layers: three chunked RoPE layers with the L2 q/k norm, one NoPE layer
with temperature tuning; dense and MoE layers alternating; chunks shorter than the input):
``convert check`` <= 1e-4, import gives transformers' logits, export round-trips the tensors
bit for bit; chunked attention equals its S x S reference over packed documents and shares one
plan across layers; it trains under tp 2 + sp x FSDP 2 and pp 2 x tp 2 + sp exactly as in one
process (float64, packed documents); the presets' parameter counts equal transformers';
context parallel with chunks (ring, Ulysses, hybrid): tests/test_cp_chunked.py."""

import dataclasses
import json

import pytest
import torch

from meshfold.cli import main
from meshfold.config import ConfigError, from_dict, validate
from meshfold.convert import load_model, read_checkpoint_model
from meshfold.models import attention_ops
from meshfold.models.config import ModelConfig
from meshfold.models.counts import attention_share, flops_per_token, param_count
from meshfold.models.llama import CoreAttention, Transformer
from meshfold.models.presets import PRESETS
from meshfold.testing import assert_runs_match, run_on, save_random_hf_model, tiny_config, train_collect

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, CHUNK = 320, 24, 6
# float64 weights both sides, but transformers' Llama 4 norms, RoPE and temperature compute in
# float32 (x.float()) whatever the dtype: ~6e-8 on the logits. A missed chunk, NoPE layer,
# temperature, L2 norm or input-side gate differs by 1e-4 or more (asserted below).
TOL = dict(rtol=1e-5, atol=1e-6)
HF = dict(hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=64,
          rms_norm_eps=1e-5, num_local_experts=4, interleave_moe_layer_step=2, attention_chunk_size=CHUNK,
          floor_scale=4, attn_scale=0.5, attn_implementation="eager",
          rope_parameters={"rope_type": "default", "rope_theta": 1e4})
# the same shape as meshfold [model] keys (for training)
MODEL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=40, vocab_size=VOCAB, seq_len=16, norm_eps=1e-5,
             moe_experts=4, moe_ffn_dim=24, moe_every=2, moe_topk=1, moe_shared_experts=1, moe_router="sigmoid",
             moe_norm_topk=False, moe_gate_input=True, attention_chunk_size=CHUNK, nope_interval=4,
             attn_temperature_tuning=True, attn_floor_scale=4.0, attn_scale=0.5, l2_qk_norm=True)


def hf_model(folder, dtype=torch.float64):
    return save_random_hf_model(folder, transformers.Llama4TextConfig(**HF), dtype)


def test_convert_check_json(tmp_path, capsys):
    hf_model(tmp_path / "hf", torch.float32)
    assert main(["convert", "check", str(tmp_path / "hf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model_type"] == "llama4_text" and result["tokens"][1] > CHUNK
    assert 0 <= result["max_abs_diff"] <= 1e-4 and result["ok"] is True


def test_import_then_export_matches_transformers(tmp_path):
    hf = hf_model(tmp_path / "hf")
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    _, m = read_checkpoint_model(tmp_path / "ours")
    assert (m.attention_chunk_size, m.nope_interval, m.l2_qk_norm, m.moe_every, m.ffn_dim, m.moe_ffn_dim) == (
        CHUNK, 4, True, 2, 40, 24)
    ours = load_model(tmp_path / "ours", torch.float64).eval()
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, **TOL)
        # the chunks, NoPE, the temperature, the L2 norm and the input-side gate all matter at this size
        for change in (dict(attention_chunk_size=0), dict(nope_interval=0), dict(attn_temperature_tuning=False),
                       dict(l2_qk_norm=False, attention_chunk_size=CHUNK), dict(moe_gate_input=False)):
            other = Transformer(dataclasses.replace(m, **change)).double().eval()
            other.load_state_dict(ours.state_dict())
            assert (other(x) - want).abs().max() > 1e-4, change
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "llama4_text" and config["layer_types"] == hf.config.layer_types
    assert config["no_rope_layers"] == hf.config.no_rope_layers and config["moe_layers"] == hf.config.moe_layers
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64,
                                                             attn_implementation="eager").eval()
    theirs = back.state_dict()
    assert theirs.keys() == hf.state_dict().keys()
    for name, value in hf.state_dict().items():
        assert torch.equal(theirs[name], value), name
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, rtol=0, atol=0)


def test_top2_routing_is_refused_in_one_line(tmp_path, capsys):
    hf_model(tmp_path / "hf", torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 2}))
    capsys.readouterr()
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "num_experts_per_tok = 2" in err and "\n" not in err


def _reference(q, k, v, chunk, pos, doc):
    """Chunked attention by its definition: an S x S mask, every score, a softmax."""
    heads = q.shape[2]
    mask = (pos[:, :, None] >= pos[:, None, :]) & (pos[:, :, None] // chunk == pos[:, None, :] // chunk)
    if doc is not None:
        mask &= doc[:, :, None] == doc[:, None, :]
    kk, vv = (t.repeat_interleave(heads // t.shape[2], 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1), vv)


def test_chunked_attention_equals_its_definition():
    gen = torch.Generator().manual_seed(0)
    b, s = 2, 37
    q = torch.randn(b, s, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, s, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    rows = torch.arange(s).expand(b, -1)
    doc = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [3] * s])
    restart = torch.cat([torch.arange(10), torch.arange(20), torch.arange(7)])  # positions restart per document
    per_doc = torch.stack([restart, torch.arange(s)])
    cases = [(chunk, None, None) for chunk in (5, 8, 37, 64)]  # reshaped into chunks (padded: 37 % 5, 37 % 8)
    cases += [(6, rows, None), (4, per_doc, doc), (8, per_doc, doc)]  # chunk boundaries as document boundaries
    for chunk, pos, docs in cases:
        want = _reference(q, k, v, chunk, rows if pos is None else pos, docs)
        got = attention_ops.chunk_attention(q, k, v, chunk, pos, docs, tile=8)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        dense = CoreAttention(dense=True, chunk=chunk)(q, k, v, pos, docs)
        torch.testing.assert_close(dense, want, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    # every chunked layer of a micro-batch shares one id tensor, hence one document plan
    ids = attention_ops.chunk_ids(doc, per_doc, 4)
    assert attention_ops.chunk_ids(doc, per_doc, 4) is ids and attention_ops.chunk_ids(doc, per_doc, 8) is not ids
    # with the loader's host copies noted (doc run starts, positions), the chunk runs are found
    # on the host too (the flash varlen kernel's plan reads nothing back on a GPU)
    moved = doc.clone()
    attention_ops.note_run_starts(moved, attention_ops.run_starts(doc, per_doc), per_doc.clone())
    ids = attention_ops.chunk_ids(moved, per_doc, 4)
    assert torch.equal(attention_ops._noted_starts(ids), attention_ops.run_starts(ids, per_doc))


def train_layouts(configs: list) -> list:
    """Several layouts in one spawn: each config trained in turn on the same processes."""
    return [train_collect(c) for c in configs]


def test_trains_under_tp_sp_fsdp_and_pp_as_one_process(tmp_path):
    """Packed documents (the default data) cut by chunks of 6 within rows of 16: tp 2 + sp x
    FSDP 2 and pp 2 x tp 2 + sp on four processes, against one process, 5 steps, float64."""
    # (no balance loss: its f is the running total over a step's micro-batches, so the pipeline's
    # two micro-batches give another loss than one process's one: models/moe.py)
    model, steps = dict(MODEL, moe_aux_loss_coef=0.0), dict(steps=5)
    ref = train_collect(tiny_config(str(tmp_path / "one"), model=model, train=steps))
    layouts = [dict(tp=2, sp=True, dp_shard=2), dict(pp=2, tp=2, sp=True, dp_shard=1, pp_microbatches=2)]
    got = run_on(4, train_layouts, [tiny_config(str(tmp_path / f"l{i}"), model=model, train=steps, parallel=p)
                                    for i, p in enumerate(layouts)])[0]
    assert len(ref["losses"]) == 5 and "layers.1.feed_forward.shared_experts.w1.weight" in ref["params"]
    for run in got:
        assert_runs_match(ref, run, rtol=1e-9, atol=1e-11)


def test_gate_input_needs_top1(tmp_path):
    cfg = from_dict(tiny_config(str(tmp_path), model=dict(MODEL, moe_topk=2)))
    with pytest.raises(ConfigError, match="moe_gate_input needs model.moe_topk = 1"):
        validate(cfg)


@pytest.mark.parametrize("preset", ["llama4-scout", "llama4-maverick"])
def test_preset_counts_equal_transformers(preset):
    m = ModelConfig(**PRESETS[preset])
    hf = dict(hidden_size=m.dim, intermediate_size=m.expert_dim, intermediate_size_mlp=m.hidden_dim,
              num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
              num_hidden_layers=m.n_layers, vocab_size=m.vocab_size, num_local_experts=m.moe_experts,
              interleave_moe_layer_step=m.moe_every, use_qk_norm=m.l2_qk_norm)
    with torch.device("meta"):
        theirs = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**hf))
        ours = Transformer(m)
    want = sum(p.numel() for p in theirs.parameters())
    assert param_count(m) == sum(p.numel() for p in ours.parameters()) == want
    # chunked layers priced by their chunks: three of four layers see 8,192 of 32,768 keys
    whole = dataclasses.replace(m, attention_chunk_size=0)
    assert attention_share(m, 32768, causal=True) == pytest.approx((1 + 3 * 8192 / 32768) / 4)
    assert flops_per_token(m, 32768) < flops_per_token(whole, 32768)
