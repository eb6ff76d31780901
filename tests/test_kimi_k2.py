"""Kimi K2 (``kimi_k2``: DeepSeek-V3's architecture under its own ``model_type``, read and written
by the DeepSeek family's adapter) against transformers' DeepseekV3ForCausalLM on a random tiny
model whose config.json says ``kimi_k2`` (transformers has no class of that name): ``convert
check`` <= 1e-4, import gives transformers' logits, export as ``kimi_k2`` round-trips every
tensor bit for bit; the ``kimi-k2`` preset has transformers' count (1.03 T, 32.9 B active).
(Training: DeepSeek-V3's shape under ep x pp is tests/test_hf_moe.py's.)"""

import json

import pytest
import torch

from meshfold.cli import main
from meshfold.convert import load_model, read_checkpoint_model
from meshfold.models.counts import param_count
from meshfold.models.hf import model_config_from_hf
from meshfold.models.presets import preset
from meshfold.testing import save_random_hf_model

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 320, 24
TOL = dict(rtol=1e-6, atol=2e-6)
HF = dict(hidden_size=32, intermediate_size=88, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
          vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, n_routed_experts=8, num_experts_per_tok=3,
          n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=16, kv_lora_rank=16,
          q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_shared_experts=1,
          routed_scaling_factor=2.827, attn_implementation="eager", experts_implementation="eager",
          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def kimi_model(folder, dtype=torch.float64):
    model = save_random_hf_model(folder, transformers.DeepseekV3Config(**HF), dtype)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    return model


def test_convert_check_json(tmp_path, capsys):
    kimi_model(tmp_path / "hf", torch.float32)
    assert main(["convert", "check", str(tmp_path / "hf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model_type"] == "kimi_k2" and 0 <= result["max_abs_diff"] <= 1e-4 and result["ok"] is True


def test_import_then_export_round_trips(tmp_path):
    hf = kimi_model(tmp_path / "hf")
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    _, m = read_checkpoint_model(tmp_path / "ours")
    assert (m.attention, m.moe_router, m.moe_experts, m.moe_routed_scale) == ("mla", "sigmoid", 8, 2.827)
    ours = load_model(tmp_path / "ours", torch.float64).eval()
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, **TOL)
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back"), "--arch", "kimi_k2"]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    # (read as deepseek_v3: transformers picks its per-expert weight conversion by model_type)
    read_as_v3 = transformers.DeepseekV3Config.from_pretrained(tmp_path / "back", model_type="deepseek_v3")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back", config=read_as_v3, dtype=torch.float64,
                                                              attn_implementation="eager",
                                                              experts_implementation="eager").eval()
    theirs = back.state_dict()
    for name, value in hf.state_dict().items():  # (transformers keeps the router in float32)
        assert torch.equal(theirs[name].to(value.dtype), value) or theirs[name].dtype == torch.float32, name
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, **TOL)


KIMI_K2 = dict(  # moonshotai/Kimi-K2-Instruct's config.json
    model_type="kimi_k2", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, vocab_size=163840, topk_method="noaux_tc", n_group=1, topk_group=1, routed_scaling_factor=2.827,
    norm_topk_prob=True, scoring_func="sigmoid", num_nextn_predict_layers=0, rms_norm_eps=1e-6, rope_theta=50000.0,
    max_position_embeddings=131072, tie_word_embeddings=False, moe_layer_freq=1,
    rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"})


def test_preset_is_the_published_model():
    shipped = preset("kimi-k2")
    imported = model_config_from_hf(KIMI_K2)
    assert imported.__class__(**{**imported.__dict__, "seq_len": shipped.seq_len, "preset": "kimi-k2"}) == shipped
    hf = transformers.DeepseekV3Config(**{k: v for k, v in KIMI_K2.items() if k != "model_type"})
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf).parameters())
    assert param_count(shipped) == theirs == 1_026_408_209_408
    assert round(param_count(shipped, active=True) / 1e9, 1) == 32.9  # published: 32 B activated
