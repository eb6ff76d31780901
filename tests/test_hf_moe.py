"""Hugging Face MoE families (Mixtral, Qwen3-MoE, DeepSeek-V2/V3) against the real
``transformers`` models (random weights, saved locally, no hub): imported logits equal
transformers', exports load back bit for bit, ``convert check`` passes, the presets have
transformers' exact parameter counts, DeepSeek's pieces (latent attention, group-limited
routing, the sequence-wise balance loss) do what their references do, and a DeepSeek-style
model trains under ep x pp exactly as in one process."""

import dataclasses
import json

import pytest
import torch

from meshfold.cli import main
from meshfold.config import ConfigError, from_dict, validate
from meshfold.convert import check_hf, load_model, read_checkpoint_model
from meshfold.models.config import ModelConfig
from meshfold.models.hf import model_config_from_hf
from meshfold.models.llama import Transformer
from meshfold.models.moe import MoE
from meshfold.models.counts import param_count
from meshfold.models.presets import preset
from meshfold.testing import assert_runs_match, run_on, save_random_hf_model, tiny_config, train_collect

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 320, 24
# transformers computes RMSNorm statistics and RoPE in float32: ~1e-7 on logits of std ~0.1.
TOL = dict(rtol=1e-6, atol=2e-6)
BASE = dict(hidden_size=32, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
            vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="eager",
            experts_implementation="eager")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}
# 8 experts in 4 groups, 2 groups kept, 3 experts per token: the group limit changes choices.
DEEPSEEK = dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                first_k_dense_replace=1, moe_intermediate_size=16, kv_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=12)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)),
    # layer 1 dense (mlp_only_layers), q/k norms, head_dim 16 != 32 / 4
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                         mlp_only_layers=[1], norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", dict(DEEPSEEK, n_shared_experts=1, q_lora_rank=24, routed_scaling_factor=2.5,
                                             rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
    "deepseek_v2": ("DeepseekV2Config", dict(DEEPSEEK, n_shared_experts=2, q_lora_rank=None, routed_scaling_factor=1.5,
                                             topk_method="group_limited_greedy",
                                             rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0.707))),
}


def hf_model(folder, family: str, dtype=torch.float64, seed: int = 0):
    cls, extra = FAMILIES[family]
    return save_random_hf_model(folder, getattr(transformers, cls)(**{**BASE, **extra}), dtype, seed)


def tokens(seed: int, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_family_import_export_check(family, tmp_path):
    hf = hf_model(tmp_path / "hf", family)
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours = load_model(tmp_path / "ours", torch.float64).eval()
    x = tokens(1)
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, **TOL)
    # convert check (both sides in float32) within its 1e-4
    result = check_hf(tmp_path / "hf", seq=SEQ)
    assert result["ok"] and result["max_abs_diff"] < 1e-4 and result["model_type"] == family
    # Back to Hugging Face (sharded): the same family, the same tensors, the same logits.
    assert main(["convert", "export", str(tmp_path / "ours"), str(tmp_path / "back"), "--max-shard-gb", "0.0001"]) == 0
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == family
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64,
                                                             attn_implementation="eager",
                                                             experts_implementation="eager").eval()
    theirs = back.state_dict()
    for name, value in hf.state_dict().items():  # (transformers keeps DeepSeek's router in float32)
        assert torch.equal(theirs[name].to(value.dtype), value) or theirs[name].dtype == torch.float32, name
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, want, **TOL)
    if family.startswith("deepseek"):
        # the group limit matters here: without it the routing (and the logits) differ
        state, m = read_checkpoint_model(tmp_path / "ours")
        free = Transformer(dataclasses.replace(m, moe_groups=0, moe_topk_groups=0)).double().eval()
        free.load_state_dict(state)
        with torch.no_grad():
            assert (free(x) - want).abs().max() > 1e-3


# --------------------------------------------------------------------------- refusals

DS3 = dict(model_type="deepseek_v3", hidden_size=32, intermediate_size=88, num_attention_heads=4, num_hidden_layers=2,
           vocab_size=VOCAB, max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8)


@pytest.mark.parametrize("config,needle", [
    (dict(DS3, norm_topk_prob=False), "norm_topk_prob = false"),
    (dict(DS3, rope_interleave=False), "rope_interleave = false"),
    (dict(DS3, moe_layer_freq=2), "moe_layer_freq = 2"),
    (dict(DS3, attention_bias=True), "attention_bias"),
    (dict(DS3, model_type="deepseek_v2", topk_method="noaux_tc", scoring_func="softmax"), "topk_method 'noaux_tc'"),
    (dict(DS3, model_type="jamba"), "model_type 'jamba' is not supported"),
])
def test_unsupported_moe_models_are_refused_in_one_line(config, needle, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_mla_layouts_not_yet_supported_are_refused():
    m = dict(dataclasses.asdict(preset("deepseek-v2-lite", n_layers=2, dim=64, n_heads=4, n_kv_heads=4, vocab_size=320,
                                       moe_experts=4, moe_topk=2, moe_ffn_dim=16, seq_len=16)))
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        validate(from_dict(tiny_config("/tmp/x", model=m, parallel={"tp": 2, "cp": 2, "dp_shard": 1})), 4)
    with pytest.raises(ConfigError, match="moe_seq_aux_loss_coef"):
        validate(from_dict(tiny_config("/tmp/x", model={**m, "mla_kv_rank": 0, "moe_seq_aux_loss_coef": 1e-3},
                                       parallel={"cp": 2})), 2)


# --------------------------------------------------------------------------- presets

# config.json values of the published checkpoints (the keys that matter).
_MIXTRAL = dict(model_type="mixtral", num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
                tie_word_embeddings=False, router_aux_loss_coef=0.02)
_QWEN3_MOE = dict(model_type="qwen3_moe", num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                  tie_word_embeddings=False, router_aux_loss_coef=0.001, attention_bias=False)
_DEEPSEEK = dict(num_key_value_heads=None, rms_norm_eps=1e-6, rope_theta=10000, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, max_position_embeddings=163840,
                 tie_word_embeddings=False, moe_layer_freq=1)
PUBLISHED = {
    "mixtral-8x7b": ("MixtralConfig", dict(_MIXTRAL, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                           vocab_size=32000, max_position_embeddings=32768)),
    "mixtral-8x22b": ("MixtralConfig", dict(_MIXTRAL, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                                            num_attention_heads=48, vocab_size=32768, max_position_embeddings=65536)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144,
                                             moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288,
                                               moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64)),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        _DEEPSEEK, model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, q_lora_rank=None, vocab_size=102400, topk_method="greedy", n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, scoring_func="softmax",
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 4096, "type": "yarn"})),
    "deepseek-v3": ("DeepseekV3Config", dict(
        _DEEPSEEK, model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=3, q_lora_rank=1536, vocab_size=129280, topk_method="noaux_tc", n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", num_nextn_predict_layers=1,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"})),
}


def test_moe_presets_are_the_published_models():
    for name, (cls, config) in PUBLISHED.items():
        imported, shipped = model_config_from_hf(config), preset(name)
        assert dataclasses.replace(imported, seq_len=shipped.seq_len, preset=name) == shipped, name
        if name.startswith("deepseek"):  # latent attention: its count against transformers (the rest: as dense)
            # transformers' own model of that config, built on the meta device: the same parameters
            hf_config = getattr(transformers, cls)(**{k: v for k, v in config.items() if k != "model_type"})
            with torch.device("meta"):
                theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_config).parameters())
            assert param_count(shipped) == theirs, name
    # the published totals (billions) and DeepSeek-V3's 37B active
    published = {"mixtral-8x7b": 46.7, "mixtral-8x22b": 140.6, "qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1,
                 "deepseek-v2-lite": 15.7, "deepseek-v3": 671.0}
    for name, total in published.items():
        assert round(param_count(preset(name)) / 1e9, 1) == total, name
    assert param_count(preset("mixtral-8x7b")) == 46_702_792_704
    assert round(param_count(preset("deepseek-v3"), active=True) / 1e9) == 38  # 37.55 B (published "37B")


# --------------------------------------------------------------------------- DeepSeek pieces


def test_sequence_wise_balance_loss_equals_its_formula():
    m = ModelConfig(dim=16, moe_experts=8, moe_topk=2, moe_router="sigmoid", moe_aux_loss_coef=0.0,
                    moe_seq_aux_loss_coef=0.3, moe_groups=4, moe_topk_groups=2)
    torch.manual_seed(0)
    moe = MoE(m).double().train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    moe(x)
    got = moe.pop_aux()
    scores = (x.reshape(-1, 16) @ moe.router.weight.T).sigmoid()
    idx = moe.route(x.reshape(-1, 16) @ moe.router.weight.T)[1]
    want = 0.0
    for b in range(3):  # per sequence: sum_i f_i P_i, averaged over sequences
        rows = slice(b * 10, (b + 1) * 10)
        f = torch.bincount(idx[rows].flatten(), minlength=8).double() * 8 / (2 * 10)
        P = (scores[rows] / scores[rows].sum(-1, keepdim=True)).mean(0)
        want += 0.3 * (f * P).sum() / 3
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    got.backward()
    assert moe.router.weight.grad.abs().sum() > 0


DEEPSEEK_TINY = dict(dim=32, n_layers=4, n_heads=4, vocab_size=320, seq_len=16, moe_experts=8, moe_topk=3,
                     moe_ffn_dim=16, moe_shared_experts=1, moe_first_dense=1, moe_router="sigmoid",
                     moe_bias_balance=True, moe_bias_update_rate=1e-2, moe_aux_loss_coef=0.0,
                     moe_seq_aux_loss_coef=0.05, moe_groups=4, moe_topk_groups=2, moe_routed_scale=2.5,
                     mla_kv_rank=16, mla_q_rank=24, mla_rope_dim=8, mla_nope_dim=8, mla_v_dim=12)


def test_deepseek_style_model_trains_under_ep2_pp2_as_one_process(tmp_path):
    # stage 0: the dense first layer and a MoE layer, stage 1: two MoE layers; experts over ep 2
    ref = train_collect(tiny_config(str(tmp_path / "one"), model=DEEPSEEK_TINY, train={"steps": 3}))
    got = run_on(4, train_collect, tiny_config(str(tmp_path / "ep2pp2"), model=DEEPSEEK_TINY, train={"steps": 3},
                                               parallel={"dp_shard": 2, "ep": 2, "pp": 2, "pp_microbatches": 2}),
                 timeout=600)[0]
    assert len(ref["losses"]) == 3
    assert_runs_match(ref, got, rtol=1e-9, atol=1e-11)
