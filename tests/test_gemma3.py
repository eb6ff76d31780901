"""Gemma 3 (``gemma3_text``, ``meshfold/models/gemma3/``) against transformers' Gemma3ForCausalLM
on a random tiny model (6 layers: five local, one global; a window shorter than the input):
``convert check`` <= 1e-4, import gives transformers' logits, export round-trips the tensors
bit for bit; it trains under tp 2 x FSDP 2 exactly as in one process; the presets' parameter
counts equal transformers'; windowed attention equals its S x S reference and builds its
mask once per shape, not per layer; context parallel refuses it in one line."""

import dataclasses
import json

import pytest
import torch

from meshfold.cli import main
from meshfold.config import from_dict, validate
from meshfold.convert import load_model, read_checkpoint_model
from meshfold.models import attention_ops
from meshfold.models.config import ModelConfig
from meshfold.models.counts import attention_share, flops_per_token, param_count
from meshfold.models.llama import CoreAttention, Transformer, init_weights
from meshfold.models.presets import PRESETS
from meshfold.testing import assert_runs_match, run_on, save_random_hf_model, tiny_config, train_collect

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, WINDOW = 320, 24, 5
# float64 weights both sides, but transformers' Gemma RMSNorm normalises in float32 (x.float(),
# w.float()) whatever the dtype: ~3e-6 on logits of max ~1 over 6 layers' 36 norms. A missed
# window, RoPE base, scale or permutation differs by 1e-3 or more (asserted below).
TOL = dict(rtol=1e-5, atol=2e-5)
HF = dict(hidden_size=32, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
          num_hidden_layers=6, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6,
          sliding_window=WINDOW, query_pre_attn_scalar=12, attn_implementation="eager",
          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})
# the same shape as meshfold [model] keys (for training)
MODEL = dict(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, attn_head_dim=8, ffn_dim=88, vocab_size=VOCAB, seq_len=16,
             norm="gemma_rmsnorm", mlp="geglu", qk_norm=True, sandwich_norm=True, embed_scale=True,
             tie_embeddings=True, sliding_window=WINDOW, query_pre_attn_scalar=12.0, rope_local_theta=1e3,
             rope_theta=1e5, norm_eps=1e-6)


def hf_model(folder, dtype=torch.float64):
    return save_random_hf_model(folder, transformers.Gemma3TextConfig(**HF), dtype)


def test_convert_check_json(tmp_path, capsys):
    hf_model(tmp_path / "hf", torch.float32)
    assert main(["convert", "check", str(tmp_path / "hf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model_type"] == "gemma3_text" and result["tokens"][1] > WINDOW
    assert 0 <= result["max_abs_diff"] <= 1e-4 and result["ok"] is True


def test_import_then_export_matches_transformers(tmp_path):
    hf = hf_model(tmp_path / "hf")
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    _, m = read_checkpoint_model(tmp_path / "ours")
    assert (m.sliding_window, m.sliding_pattern, m.rope_local_theta, m.rope_scaling) == (WINDOW, 6, 1e3, "linear")
    ours = load_model(tmp_path / "ours", torch.float64).eval()
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, **TOL)
        # the window, the local RoPE base and the scale all matter at this size
        for change in (dict(sliding_window=0), dict(rope_local_theta=1e5), dict(query_pre_attn_scalar=8.0)):
            other = Transformer(dataclasses.replace(m, **change)).double().eval()
            other.load_state_dict(ours.state_dict())
            assert (other(x) - want).abs().max() > 1e-3, change
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["layer_types"] == hf.config.layer_types
    back, loaded = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.float64,
                                                                      attn_implementation="eager").eval()
                    for folder in ("back", "hf"))
    theirs = back.state_dict()
    for name, value in hf.state_dict().items():
        assert torch.equal(theirs[name], value), name
    with torch.no_grad():  # (loaded, not `hf`: loading makes the embedding scale a float64 buffer)
        torch.testing.assert_close(back(x).logits, loaded(x).logits, rtol=0, atol=0)


def test_softcapping_is_refused_in_one_line(tmp_path, capsys):
    hf_model(tmp_path / "hf", torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    capsys.readouterr()
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "final_logit_softcapping" in err and "\n" not in err


def test_trains_under_tp2_fsdp2_as_one_process(tmp_path):
    ref = train_collect(tiny_config(str(tmp_path / "one"), model=MODEL, train={"steps": 3}))
    got = run_on(4, train_collect, tiny_config(str(tmp_path / "tp2fsdp2"), model=MODEL, train={"steps": 3},
                                               parallel={"tp": 2, "dp_shard": 2}))[0]
    assert len(ref["losses"]) == 3 and "layers.0.post_ffn_norm.weight" in ref["params"]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


def test_context_parallel_takes_windows_in_every_mode(tmp_path):
    # (their equality with one process: tests/test_gpt_oss.py, tests/test_cp_windows_sinks.py, tests/test_cp_chunked.py)
    for mode in ("ring", "ulysses"):
        validate(from_dict(tiny_config(str(tmp_path), model=MODEL, parallel={"cp": 2, "cp_mode": mode})))
    validate(from_dict(tiny_config(str(tmp_path), model=MODEL, parallel={"cp": 4, "cp_mode": "hybrid", "cp_ulysses": 2})),
             4)


@pytest.mark.parametrize("preset", ["gemma-3-1b", "gemma-3-4b"])
def test_preset_counts_equal_transformers(preset):
    m = ModelConfig(**PRESETS[preset])
    published = {"gemma-3-1b": 999_885_952}  # google/gemma-3-1b-pt's safetensors
    hf = dict(hidden_size=m.dim, intermediate_size=m.hidden_dim, num_attention_heads=m.n_heads,
              num_key_value_heads=m.kv_heads, head_dim=m.head_dim, num_hidden_layers=m.n_layers,
              vocab_size=m.vocab_size, sliding_window=m.sliding_window)
    with torch.device("meta"):
        theirs = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**hf))
        ours = Transformer(m)
    want = sum(p.numel() for p in theirs.parameters())
    assert param_count(m) == sum(p.numel() for p in ours.parameters()) == want == published.get(preset, want)
    full = dataclasses.replace(m, sliding_window=0)  # local layers' attention priced by their band
    assert flops_per_token(m, causal=True) < flops_per_token(full, causal=True)


def test_window_attention_equals_the_dense_reference_and_shares_its_mask():
    torch.manual_seed(0)
    b, s, h, d = 2, 12, 4, 8
    q, k, v = (torch.randn(b, s, n, d, dtype=torch.float64) for n in (h, 2, 2))
    doc_ids = torch.tensor([[0] * 7 + [1] * 5, [0] * 12])
    pos = torch.arange(s)
    for docs in (None, doc_ids):
        got = CoreAttention(window=3, scale=0.3)(q, k, v, doc_ids=docs)
        keep = (pos[:, None] - pos[None, :] >= 0) & (pos[:, None] - pos[None, :] < 3)
        if docs is not None:
            keep = keep & (docs[:, :, None] == docs[:, None, :])
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 0.3
        want = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~keep.reshape(-1, 1, s, s), -torch.inf).softmax(-1),
                            v.repeat_interleave(2, 2))
        torch.testing.assert_close(got, want)
    m = ModelConfig(**{**MODEL, "seq_len": 32})
    model = Transformer(m)
    init_weights(model, m, 0)
    attention_ops._WINDOW_MASKS.clear()
    attention_ops._BANDS.clear()
    model(torch.randint(0, VOCAB, (2, 32)))
    model(torch.randint(0, VOCAB, (2, 32)))
    # five windowed layers, two steps, plain rows: the query tiles' one band mask, no [S, S] mask
    assert len(attention_ops._BANDS) == 1 and not attention_ops._WINDOW_MASKS
    model(torch.randint(0, VOCAB, (2, 32)), doc_ids=torch.zeros(2, 32, dtype=torch.long))
    assert len(attention_ops._WINDOW_MASKS) == 1  # packed documents: one mask for the micro-batch's layers


def test_planner_prices_the_band_and_offers_context_parallel():
    """The band's FLOPs priced; cp offered to the windowed model as to its full twin (the ring
    and Ulysses take windows and scales: tests/test_cp_windows_sinks.py)."""
    from meshfold.planner.cluster import load_cluster
    from meshfold.planner.cost import CostModel, Workload
    from meshfold.planner.search import structures

    m = ModelConfig(**PRESETS["gemma-3-4b"])
    cluster = load_cluster("h100", devices=16)
    windowed, full = (CostModel(Workload(model, 64), cluster).layer_terms(1, False, 1, "ring", 1, 1, "none")
                      for model in (m, dataclasses.replace(m, sliding_window=0, query_pre_attn_scalar=0.0)))
    # 29 of 34 layers score 1,024 of 8,192 keys (causal: the band's area w - w^2/2s per query)
    assert attention_share(m, 8192, True) == pytest.approx((5 * 4096 + 29 * (1024 - 1024 ** 2 / 16384)) / (34 * 4096))
    assert windowed.kinds[False].compute_fwd < 0.8 * full.kinds[False].compute_fwd
    assert any(st[3] > 1 for st in structures(Workload(m, 64), cluster.world_size))
    assert any(st[3] > 1 for st in structures(Workload(dataclasses.replace(m, sliding_window=0, query_pre_attn_scalar=0.0),
                                                        64), cluster.world_size))
