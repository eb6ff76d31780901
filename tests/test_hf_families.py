"""Hugging Face families (Llama 3.x with RoPE scaling, Mistral, Qwen2/2.5, Qwen3) against the
real ``transformers`` models (random weights from config classes, saved locally, no hub):
imported logits equal transformers', exports load back with the same logits, the RoPE
scalings equal transformers' tables, unsupported models are refused in one line, the
tokenizer travels with the model, ``convert check`` reports the logit difference, and an
imported model trains under tp 2 x pp 2 exactly as in one process."""

import dataclasses
import json

import pytest
import torch

from meshfold.cli import main
from meshfold.config import ModelConfig
from meshfold.convert import check_hf, load_model, read_checkpoint_model
from meshfold.models.llama import Transformer, rope_frequencies
from meshfold.testing import assert_runs_match, run_on, save_random_hf_model, tiny_config, train_collect

transformers = pytest.importorskip("transformers")

# float64 weights on both sides; transformers computes RMSNorm statistics and the RoPE
# frequencies in float32, which leaves ~1e-7 on logits of std ~0.1. A missing q/k (or q/k
# norm, or bias) permutation or a wrong RoPE scaling differs by 1e-3 or more.
TOL = dict(rtol=1e-6, atol=2e-6)
VOCAB, SEQ = 320, 24

BASE = dict(hidden_size=32, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="eager")
# Small original contexts so the scalings change the frequencies a 24-token input uses.
FAMILIES = {
    "llama3.1": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                     rope_theta=500000.0)),
    "llama-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-yarn": ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 16})),
    "llama-dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                          max_position_embeddings=16)),
    "llama3.2-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(sliding_window=None, rope_theta=1e6)),
    "qwen2.5-tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, rope_theta=1e6)),  # head_dim 16 != 32 / 4
    "qwen3-tied": ("Qwen3Config", dict(head_dim=8, tie_word_embeddings=True)),
}


def hf_model(folder, family: str, dtype=torch.float64, seed: int = 0):
    cls, extra = FAMILIES[family]
    return save_random_hf_model(folder, getattr(transformers, cls)(**{**BASE, **extra}), dtype, seed)


def tokens(seed: int, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_then_export_matches_transformers(family, tmp_path):
    hf = hf_model(tmp_path / "hf", family)
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours = load_model(tmp_path / "ours", torch.float64).eval()
    if family == "llama-dynamic":
        # Trained longer than the original 16 positions: transformers stretches the base for
        # the 24 positions it sees, meshfold for model.seq_len = 24.
        state, m = read_checkpoint_model(tmp_path / "ours")
        ours = Transformer(dataclasses.replace(m, seq_len=SEQ)).double().eval()
        ours.load_state_dict(state)
    x = tokens(1)
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, **TOL)
    # Back to Hugging Face: the same family, the same tensors bit for bit, the same logits.
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type or (family == "mistral" and config["model_type"] == "llama")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64,
                                                             attn_implementation="eager").eval()
    theirs = back.state_dict()
    for name, value in hf.state_dict().items():
        assert torch.equal(theirs[name], value), name
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, rtol=0, atol=0)


def test_mistral_exports_as_mistral_when_asked(tmp_path):
    hf_model(tmp_path / "hf", "mistral")
    main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")])
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back"), "--arch", "mistral"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back).__name__ == "MistralForCausalLM"


@pytest.mark.parametrize("family", ["llama3.1", "llama-linear", "llama-yarn", "llama-dynamic", "qwen3"])
def test_rope_frequencies_equal_transformers(family, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from meshfold.models.hf import model_config_from_hf

    cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**BASE, **extra})
    cfg.save_pretrained(tmp_path)
    m = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":
        theta = cfg.rope_parameters["rope_theta"]
        want = 1.0 / theta ** (torch.arange(0, m.head_dim, 2, dtype=torch.float64) / m.head_dim)
        scale = 1.0
    else:
        want, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    got, got_scale = rope_frequencies(m)
    assert m.rope_scaling == {"default": "none"}.get(kind, kind)
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(scale, rel=1e-12)
    if kind not in ("default", "dynamic"):  # the scaling does something here (dynamic: beyond the context)
        assert not torch.allclose(got, rope_frequencies(dataclasses.replace(m, rope_scaling="none"))[0])


def test_dynamic_rope_stretches_beyond_the_original_context():
    m = ModelConfig(dim=32, n_heads=4, seq_len=64, rope_scaling="dynamic", rope_factor=2.0, rope_original_seq_len=16)
    plain = rope_frequencies(dataclasses.replace(m, rope_scaling="none"))[0]
    # NTK-aware: base * (f * s / s0 - (f - 1)) ** (d / (d - 2)), here (2*64/16 - 1) ** (8/6).
    theta = 10000.0 * 7.0 ** (8 / 6)
    torch.testing.assert_close(rope_frequencies(m)[0], 1.0 / theta ** (torch.arange(0, 8, 2) / 8).double())
    assert torch.equal(rope_frequencies(dataclasses.replace(m, seq_len=16))[0], plain)


def test_bf16_import_and_sharded_export(tmp_path):
    hf = hf_model(tmp_path / "hf", "qwen3", dtype=torch.bfloat16)
    result = check_hf(tmp_path / "hf", seq=SEQ)
    assert result["max_abs_diff"] < 1e-4 and result["ok"]
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    state, _ = read_checkpoint_model(tmp_path / "ours")
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    out = tmp_path / "back"
    assert main(["convert", "export", str(tmp_path / "ours"), str(out), "--max-shard-gb", "0.00005",
                 "--dtype", "float32"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    back = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, value in hf.state_dict().items():
        assert back[name].dtype == torch.float32 and torch.equal(back[name], value.float()), name


# --------------------------------------------------------------------------- check


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5-tied", "qwen3"])
def test_convert_check_json(family, tmp_path, capsys):
    hf_model(tmp_path / "hf", family, dtype=torch.float32)
    assert main(["convert", "check", str(tmp_path / "hf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 <= result["max_abs_diff"] < 1e-4 and result["ok"] is True


def test_convert_check_fails_on_a_wrong_conversion(tmp_path, capsys, monkeypatch):
    import meshfold.models.hf as hf

    hf_model(tmp_path / "hf", "llama3.1", dtype=torch.float32)
    monkeypatch.setattr(hf, "_from_hf_rope", lambda w, heads, turned: w)  # forget the q/k row permutation
    assert main(["convert", "check", str(tmp_path / "hf"), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["max_abs_diff"] > 1e-3 and result["ok"] is False
    assert main(["convert", "check", str(tmp_path / "hf")]) == 1
    assert "FAILED" in capsys.readouterr().out


# --------------------------------------------------------------------------- refusals


def _config(**changes) -> dict:
    return {"model_type": "llama", "hidden_size": 32, "intermediate_size": 88, "num_attention_heads": 4,
            "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, **changes}


@pytest.mark.parametrize("config,needle", [
    (_config(model_type="mistral", sliding_window=16), "sliding_window = 16: sliding-window attention"),
    (_config(model_type="qwen2", use_sliding_window=True, sliding_window=16), "use_sliding_window = true"),
    (_config(model_type="qwen3", layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
    (_config(model_type="gemma2"), "model_type 'gemma2' is not supported"),
    (_config(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope_type 'longrope' is not supported"),
    (_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (_config(attention_bias=True), "attention_bias and mlp_bias differ"),
    (_config(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_models_are_refused_in_one_line(config, needle, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    for command in (["import", str(tmp_path / "hf"), str(tmp_path / "out")], ["check", str(tmp_path / "hf")]):
        assert main(["convert", *command]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_qwen2_with_an_unused_window_imports(tmp_path):
    # Qwen2.5 checkpoints carry sliding_window = 131072 with use_sliding_window = false.
    from meshfold.models.hf import model_config_from_hf

    m = model_config_from_hf(_config(model_type="qwen2", sliding_window=131072, use_sliding_window=False,
                                     rope_theta=1e6))
    assert m.qkv_bias and not m.bias and m.rope_theta == 1e6


# --------------------------------------------------------------------------- tokenizer


def _tokenizer_json(folder) -> int:
    from meshfold.data.tokenizer import train_bpe

    tok = train_bpe(["the quick brown fox jumps over the lazy dog " * 20, "pack my box with five dozen jugs"], 300)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tok.get_vocab_size()


def test_tokenizer_travels_with_the_model(tmp_path):
    from meshfold.config import load_config
    from meshfold.train.trainer import Trainer

    hf_model(tmp_path / "hf", "qwen3")
    _tokenizer_json(tmp_path / "hf")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**source, "bos_token_id": 6, "eos_token_id": 7}))
    imported = tmp_path / "ours"
    assert main(["convert", "import", str(tmp_path / "hf"), str(imported)]) == 0
    assert (imported / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    cfg = load_config(imported / "config.toml", [
        f"train.run_dir='{tmp_path / 'run'}'", "train.steps=2", "train.checkpoint_every=2", "model.seq_len=16",
        "train.global_batch=2", "train.dtype='float64'", "train.progress=false", "train.tensorboard=false",
        "data.max_docs=20", "data.val_docs=0"])
    assert cfg.data.tokenizer == str(imported / "tokenizer.json") and cfg.model.qk_norm
    Trainer(cfg).fit()
    # A training checkpoint exports with its run's tokenizer.
    out = tmp_path / "back"
    assert main(["convert", "export", str(tmp_path / "run" / "checkpoints" / "step-2"), str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (imported / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").exists()
    # Trained at 16 positions, published for 64: the export keeps the published context,
    # and the source's special token ids.
    exported = json.loads((out / "config.json").read_text())
    assert exported["max_position_embeddings"] == 64
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (6, 7)


# --------------------------------------------------------------------------- continued pre-training


def _imported_run(tmp_path, family: str, name: str, parallel: dict) -> dict:
    hf_model(tmp_path / "hf", family)
    imported = tmp_path / "ours"
    if not imported.exists():
        assert main(["convert", "import", str(tmp_path / "hf"), str(imported)]) == 0
    _, m = read_checkpoint_model(imported)
    cfg = tiny_config(str(tmp_path / name), model={**dataclasses.asdict(m), "seq_len": 16},
                      parallel=parallel, train={"steps": 3, "init_from": str(imported)})
    return cfg


@pytest.mark.parametrize("family", ["llama3.1", "qwen3"])
def test_imported_model_trains_under_tp2_pp2_as_one_process(family, tmp_path):
    ref = train_collect(_imported_run(tmp_path, family, "one", {}))
    got = run_on(4, train_collect, _imported_run(tmp_path, family, "tp2pp2",
                                                 {"tp": 2, "pp": 2, "dp_shard": 1, "pp_microbatches": 2}))[0]
    assert len(ref["losses"]) == 3
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


# --------------------------------------------------------------------------- presets and configs

# config.json values of the published checkpoints (Hugging Face hub, the keys that matter).
PUBLISHED_CONFIGS = {
    "llama3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, head_dim=128,
                        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                        num_key_value_heads=8, num_hidden_layers=16, vocab_size=128256, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, head_dim=64,
                        rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2, num_hidden_layers=24, vocab_size=151936, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=32768, use_sliding_window=False,
                         max_window_layers=21, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, num_hidden_layers=28, vocab_size=151936,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000, attention_bias=False,
                       sliding_window=None, use_sliding_window=False, tie_word_embeddings=True),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, num_hidden_layers=32, vocab_size=32768, max_position_embeddings=32768,
                       rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_presets_are_what_import_reads_from_the_published_configs(name):
    from meshfold.models.hf import model_config_from_hf
    from meshfold.models.counts import param_count
    from meshfold.models.presets import preset

    imported, shipped = model_config_from_hf(PUBLISHED_CONFIGS[name]), preset(name)
    assert imported.head_dim == shipped.head_dim
    same = dict(seq_len=shipped.seq_len, preset=name, attn_head_dim=shipped.attn_head_dim)
    assert dataclasses.replace(imported, **same) == shipped
    assert param_count(imported) == param_count(shipped)


def test_continued_pretraining_config_is_valid():
    from pathlib import Path

    from meshfold.config import load_config, validate

    path = Path(__file__).resolve().parent.parent / "configs" / "llama3.1-8b-continue.toml"
    cfg = load_config(path)
    assert cfg.model.rope_scaling == "llama3" and cfg.train.init_from in cfg.data.tokenizer
    # The import and the prepared corpus are the user's: validate the rest on 16 processes.
    validate(load_config(path, ["data.source='default'", "data.tokenizer=''", "train.init_from=''"]), 16)


def test_untie_lets_a_tied_import_run_pipeline_parallel(tmp_path):
    from meshfold.config import ConfigError, from_dict, validate

    hf = hf_model(tmp_path / "hf", "qwen2.5-tied")
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "tied")]) == 0
    _, m = read_checkpoint_model(tmp_path / "tied")
    with pytest.raises(ConfigError, match="convert import --untie"):
        validate(from_dict(tiny_config(str(tmp_path), model=dataclasses.asdict(m), parallel={"pp": 2})), 2)
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "untied"), "--untie"]) == 0
    state, m = read_checkpoint_model(tmp_path / "untied")
    assert not m.tie_embeddings and torch.equal(state["output.weight"], state["tok_embeddings.weight"])
    validate(from_dict(tiny_config(str(tmp_path), model=dataclasses.asdict(m), parallel={"pp": 2})), 2)
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "untied", torch.float64)(tokens(4)), hf(tokens(4)).logits,
                                   **TOL)
