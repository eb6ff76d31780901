"""GLM-4.5 (``glm4_moe``, ``meshfold/models/glm4_moe/``) against transformers' Glm4MoeForCausalLM on
a random tiny model (partial RoPE over half of each 16-wide head, q/k/v biases, q/k norms, 8
experts in 4 groups with 2 kept, a shared expert, a dense first layer): ``convert check`` <= 1e-4,
import gives transformers' logits, export round-trips every tensor bit for bit; it trains under
tp 2 x FSDP 2 exactly as in one process (float64); the presets' counts equal transformers'."""

import dataclasses
import json

import pytest
import torch

from meshfold.cli import main
from meshfold.convert import load_model, read_checkpoint_model
from meshfold.models.config import ModelConfig
from meshfold.models.counts import param_count
from meshfold.models.llama import Transformer
from meshfold.models.presets import PRESETS
from meshfold.testing import assert_runs_match, run_on, save_random_hf_model, tiny_config, train_collect

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 320, 24
TOL = dict(rtol=1e-6, atol=2e-6)  # transformers' RMSNorm and RoPE run in float32
HF = dict(hidden_size=32, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          num_hidden_layers=3, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5,
          n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
          moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True,
          use_qk_norm=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
          attn_implementation="eager", experts_implementation="eager")
MODEL = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, attn_head_dim=16, ffn_dim=88, vocab_size=VOCAB, seq_len=16,
             qkv_bias=True, qk_norm=True, rope_fraction=0.5, moe_experts=8, moe_topk=3, moe_ffn_dim=16,
             moe_shared_experts=1, moe_first_dense=1, moe_router="sigmoid", moe_bias_balance=True,
             moe_bias_update_rate=1e-2, moe_aux_loss_coef=0.0, moe_groups=4, moe_topk_groups=2, moe_routed_scale=2.5)


def hf_model(folder, dtype=torch.float64):
    model = save_random_hf_model(folder, transformers.Glm4MoeConfig(**HF), dtype)
    with torch.no_grad():  # experts and routers at transformers' std 0.02 would barely move the logits
        for name, t in model.named_parameters():
            if ".mlp." in name and "norm" not in name:
                t.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(folder)
    return model


def test_convert_check_json(tmp_path, capsys):
    hf_model(tmp_path / "hf", torch.float32)
    assert main(["convert", "check", str(tmp_path / "hf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model_type"] == "glm4_moe" and 0 <= result["max_abs_diff"] <= 1e-4 and result["ok"] is True


def test_import_then_export_matches_transformers(tmp_path):
    hf = hf_model(tmp_path / "hf")
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    _, m = read_checkpoint_model(tmp_path / "ours")
    assert (m.rope_fraction, m.rope_dim, m.qkv_bias, m.qk_norm, m.moe_router, m.moe_groups) == (
        0.5, 8, True, True, "sigmoid", 4)
    ours = load_model(tmp_path / "ours", torch.float64).eval()
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, **TOL)
        for change in (dict(rope_fraction=1.0), dict(moe_groups=0, moe_topk_groups=0)):  # both matter here
            other = Transformer(dataclasses.replace(m, **change)).double().eval()
            other.load_state_dict(ours.state_dict())
            assert (other(x) - want).abs().max() > 1e-3, change
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "glm4_moe" and config["partial_rotary_factor"] == 0.5
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64,
                                                             attn_implementation="eager",
                                                             experts_implementation="eager").eval()
    theirs = back.state_dict()
    for name, value in hf.state_dict().items():  # (transformers keeps the router in float32)
        assert torch.equal(theirs[name].to(value.dtype), value) or theirs[name].dtype == torch.float32, name
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, **TOL)


def test_trains_under_tp2_fsdp2_as_one_process(tmp_path):
    ref = train_collect(tiny_config(str(tmp_path / "one"), model=MODEL, train={"steps": 3}))
    got = run_on(4, train_collect, tiny_config(str(tmp_path / "tp2fsdp2"), model=MODEL, train={"steps": 3},
                                               parallel={"tp": 2, "dp_shard": 2}), timeout=600)[0]
    assert len(ref["losses"]) == 3 and "layers.1.attention.wq.bias" in ref["params"]
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)


GLM45 = dict(num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552, n_shared_experts=1,
             num_experts_per_tok=8, attention_bias=True, partial_rotary_factor=0.5, rope_theta=1e6,
             max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5)
# zai-org/GLM-4.5 and GLM-4.5-Air config.json; transformers' totals and active counts (published: "355B total,
# 32B active" and "106B, 12B", rounded; the 355B with its MTP layer, which transformers does not build)
PUBLISHED = {
    "glm-4.5": (dict(GLM45, hidden_size=5120, intermediate_size=12288, num_hidden_layers=92, n_routed_experts=160,
                     moe_intermediate_size=1536, first_k_dense_replace=3, routed_scaling_factor=2.5,
                     use_qk_norm=True), 352_797_814_784, 33_632_251_904),
    "glm-4.5-air": (dict(GLM45, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, n_routed_experts=128,
                         moe_intermediate_size=1408, first_k_dense_replace=1, routed_scaling_factor=1.0), 106_852_245_504, 13_424_123_904),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_equal_transformers(name):
    from meshfold.models.hf import model_config_from_hf

    config, total, active = PUBLISHED[name]
    shipped = ModelConfig(**PRESETS[name])
    imported = model_config_from_hf(dict(config, model_type="glm4_moe"))
    assert dataclasses.replace(imported, seq_len=shipped.seq_len) == shipped
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**config)).parameters())
    assert param_count(shipped) == theirs
    assert theirs == total and param_count(shipped, active=True) == active
