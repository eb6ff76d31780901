"""Hugging Face interop for Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and the MoE families Mixtral,
Qwen3-MoE and DeepSeek-V2/V3: ``meshfold convert``.

import  HF folder (``config.json`` + ``*.safetensors``, sharded or not, + tokenizer files) ->
        a meshfold checkpoint folder (DCP, ``model.<name>`` keys, ``meshfold.json`` manifest,
        the tokenizer files) that ``train.init_from`` starts from, plus ``config.toml`` with
        the matching ``[model]`` and ``data.tokenizer``.
export  a meshfold checkpoint (a training ``step-N`` or an imported one; the model shape
        comes from its manifest) -> HF folder that ``AutoModelForCausalLM`` loads.
check   transformers' logits against meshfold's import of the same folder (fp32).

Names map one to one (``model.layers.i.self_attn.q_proj`` <-> ``layers.i.attention.wq``,
``mlp.gate_proj/up_proj/down_proj`` <-> ``feed_forward.w1/w3/w2``, ...). The one change of
values: meshfold rotates *adjacent* pairs of each head's q/k features (Meta's layout),
Hugging Face rotates the two *halves* (``rotate_half``), so q_proj/k_proj rows (and biases)
are permuted per head: HF row ``h*d + j`` holds meshfold row ``h*d + 2j`` (j < d/2) or
``h*d + 2(j-d/2) + 1``; Qwen3's per-head q/k norm weights get the same permutation (one head).
MoE layers: the router is ``gate`` (``block_sparse_moe.gate`` in Mixtral), each expert's
gate/up/down (Mixtral: w1/w3/w2) joins meshfold's stacked experts [E, out, in], gate and up
fused as ``experts.w13`` (gate's rows, then up's) and down as ``experts.w2``
(transformers 5's fused ``experts.gate_up_proj``/``down_proj`` import too), DeepSeek's
``shared_experts`` are ``feed_forward.shared_experts`` and V3's ``e_score_correction_bias`` is
the balancing bias ``expert_bias``. DeepSeek's multi-head latent attention rotates adjacent
pairs like meshfold (``models/mla.py``): its weights need no permutation.
Features and refusals: docs/hf.md.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from meshfold.errors import ConfigError
from meshfold.models.config import ModelConfig

# meshfold name (per layer, after "layers.{i}.") <-> HF name (after "model.layers.{i}.")
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w1.bias": "mlp.gate_proj.bias",
    "feed_forward.w3.bias": "mlp.up_proj.bias",
    "feed_forward.w2.bias": "mlp.down_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # multi-head latent attention (DeepSeek-V2/V3)
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    # MoE blocks (Mixtral's "block_sparse_moe." is read and written as "mlp." here; see to_hf)
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# meshfold's stacked expert weights [E, out, in] <-> one HF tensor per expert (hub layout).
EXPERT_NAMES = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
                "feed_forward.experts.w2": "down_proj"}
MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
# DeepSeek-V3's multi-token prediction module k (models/mtp.py) is stored as decoder layer
# n_layers + k with these tensors beside the block's (meshfold: "mtp.{k}." + name; the block under
# "mtp.{k}.block."), and its own copies of the embedding and output head, which meshfold shares.
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "norm.weight": "shared_head.norm.weight"}
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}


# --------------------------------------------------------------------------- config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "dynamic": "dynamic", "yarn": "yarn"}


def _rope_parameters(hf: dict) -> dict:
    """One flat RoPE dict from either format: transformers 4's ``rope_theta`` + ``rope_scaling``
    or transformers 5's ``rope_parameters`` (which holds the theta too)."""
    params = dict(hf.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"convert: per-layer-type RoPE parameters {sorted(params)} are not supported")
    params.update(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return params


def _sliding_window(hf: dict, model_type: str) -> str | None:
    """Why the model attends through a sliding window, or None when it attends to everything."""
    if "sliding_attention" in (hf.get("layer_types") or ()):
        return "layer_types has sliding_attention layers"
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):  # the window only applies with use_sliding_window
        return "use_sliding_window = true" if hf.get("use_sliding_window") else None
    window, longest = hf.get("sliding_window"), hf.get("max_position_embeddings", 0)
    return f"sliding_window = {window}" if window and window < longest else None


def model_config_from_hf(hf: dict) -> ModelConfig:
    """meshfold's ``[model]`` for a HF ``config.json`` of the Llama / Mistral / Qwen2 / Qwen3
    families; ConfigError (one line) for what meshfold cannot represent exactly."""
    model_type = hf.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ConfigError(f"convert: model_type {model_type!r} is not supported; meshfold imports "
                          f"{', '.join(FAMILIES)} (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE, "
                          f"DeepSeek-V2/V3)")
    window = _sliding_window(hf, model_type)
    if window:
        raise ConfigError(f"convert: {window}: sliding-window attention is not supported (meshfold attends "
                          f"to the whole causal context)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"convert: hidden_act {hf['hidden_act']!r}; meshfold's SwiGLU needs silu")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    deepseek = model_type.startswith("deepseek")
    head_dim = (None if deepseek else hf.get("head_dim")) or dim // heads  # DeepSeek's head_dim is the rope part
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if deepseek and (attn_bias or mlp_bias):
        raise ConfigError("convert: DeepSeek with attention_bias or mlp_bias = true is not supported")
    if model_type in ("qwen3", "qwen3_moe") and attn_bias:
        raise ConfigError("convert: Qwen3 with attention_bias = true (biases on q/k/v/o without MLP biases) "
                          "is not supported")
    if model_type in ("llama", "mistral") and attn_bias != mlp_bias:
        raise ConfigError("convert: attention_bias and mlp_bias differ; meshfold has one model.bias switch "
                          "for both (and model.qkv_bias for q/k/v only)")
    rope = _rope_parameters(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"convert: rope_type {rope_type!r} is not supported; meshfold has "
                          f"{', '.join(ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"convert: partial_rotary_factor {rope['partial_rotary_factor']} is not supported "
                          f"(meshfold rotates the whole head)")
    seq_len = hf.get("max_position_embeddings", 2048)
    scaling: dict = {"rope_scaling": ROPE_TYPES[rope_type]}
    if rope_type != "default":
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings")
        if rope_type == "dynamic":  # transformers stretches beyond max_position_embeddings
            original = seq_len
        if rope_type == "yarn":
            if rope.get("truncate", True) is False:
                raise ConfigError("convert: yarn with truncate = false is not supported")
            original = original or seq_len
            factor = factor or seq_len / original
            attention = rope.get("attention_factor")
            mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
            if attention is None and mscale and mscale_all:
                def m(scale, k):
                    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0
                attention = m(factor, mscale) / m(factor, mscale_all)
            scaling.update(rope_beta_fast=float(rope.get("beta_fast") or 32.0),
                           rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                           rope_attention_factor=float(attention or 0.0))
        if rope_type == "yarn" and deepseek:  # MLA's softmax scale takes mscale(factor, mscale_all_dim)^2
            scaling["rope_mscale_all_dim"] = float(rope.get("mscale_all_dim") or 0.0)
        if rope_type == "llama3":
            scaling.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                           rope_high_freq_factor=float(rope["high_freq_factor"]))
        scaling.update(rope_factor=float(factor), rope_original_seq_len=int(original or 0))
    return ModelConfig(
        dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_len=seq_len, max_position=seq_len, norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bias=attn_bias and model_type in ("llama", "mistral"), qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"), attn_head_dim=head_dim if head_dim != dim // heads else 0,
        **scaling, **_moe_from_hf(hf, model_type), **_mla_from_hf(hf, model_type),
    )


def _moe_from_hf(hf: dict, model_type: str) -> dict:
    """The ``[model]`` MoE keys of a Mixtral / Qwen3-MoE / DeepSeek config ({} for dense)."""
    if model_type == "mixtral":
        return dict(moe_experts=hf["num_local_experts"], moe_topk=hf["num_experts_per_tok"], moe_norm_topk=True,
                    moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)))
    if model_type == "qwen3_moe":
        experts = hf.get("num_experts", hf.get("num_local_experts", 0))
        if not experts:
            return {}
        return dict(moe_experts=experts, moe_topk=hf["num_experts_per_tok"], moe_ffn_dim=hf["moe_intermediate_size"],
                    moe_every=hf.get("decoder_sparse_step", 1), moe_dense_layers=list(hf.get("mlp_only_layers") or []),
                    moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
                    moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)))
    if not model_type.startswith("deepseek"):
        return {}
    if hf.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"convert: moe_layer_freq = {hf['moe_layer_freq']} is not supported (transformers "
                          f"makes every layer from first_k_dense_replace on a MoE layer)")
    scoring = hf.get("scoring_func", "softmax" if model_type == "deepseek_v2" else "sigmoid")
    if (model_type, scoring) not in (("deepseek_v2", "softmax"), ("deepseek_v3", "sigmoid")):
        raise ConfigError(f"convert: {model_type} with scoring_func = {scoring!r} is not supported")
    groups, topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
    out = dict(moe_experts=hf["n_routed_experts"], moe_topk=hf["num_experts_per_tok"],
               moe_ffn_dim=hf["moe_intermediate_size"], moe_shared_experts=hf.get("n_shared_experts") or 0,
               moe_first_dense=hf.get("first_k_dense_replace") or 0,
               moe_routed_scale=float(hf.get("routed_scaling_factor", 1.0)))
    if model_type == "deepseek_v2":  # transformers' V2 never renormalises the k gates
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"convert: deepseek_v2 topk_method {method!r} is not supported")
        limited = method == "group_limited_greedy" and groups > 1
        return dict(out, moe_norm_topk=False, moe_groups=groups if limited else 0,
                    moe_topk_groups=topk_groups if limited else 0)
    if not hf.get("norm_topk_prob", True):
        raise ConfigError("convert: deepseek_v3 with norm_topk_prob = false is not supported (meshfold's sigmoid "
                          "router always renormalises the k gates)")
    if hf.get("rope_interleave", True) is False:
        raise ConfigError("convert: deepseek_v3 with rope_interleave = false is not supported")
    # V3 balances without an auxiliary loss: the correction bias (moe_bias_balance) does.
    return dict(out, moe_router="sigmoid", moe_bias_balance=True, moe_aux_loss_coef=0.0,
                moe_groups=groups if groups > 1 else 0, moe_topk_groups=topk_groups if groups > 1 else 0)


def _mla_from_hf(hf: dict, model_type: str) -> dict:
    """Multi-head latent attention keys of a DeepSeek config ({} otherwise)."""
    if not model_type.startswith("deepseek"):
        return {}
    return dict(mla_kv_rank=hf["kv_lora_rank"], mla_q_rank=hf.get("q_lora_rank") or 0,
                mla_rope_dim=hf["qk_rope_head_dim"], mla_nope_dim=hf["qk_nope_head_dim"], mla_v_dim=hf["v_head_dim"])


def hf_family(m: ModelConfig, arch: str | None = None) -> str:
    """The Hugging Face family a meshfold model exports to (``arch`` forces one), or a
    ConfigError naming the feature that family lacks."""
    if m.norm != "rmsnorm" or m.mlp != "swiglu" or m.pos != "rope":
        raise ConfigError("convert export: only models with rmsnorm, swiglu and rope map to a Hugging Face "
                          "Llama/Mistral/Qwen/Mixtral/DeepSeek model")
    if m.moe_experts or m.mla:
        return _moe_family(m, arch)
    family = arch or ("qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama")
    if family in MOE_FAMILIES:
        raise ConfigError(f"convert export: {ARCHITECTURES[family]} needs a MoE model (model.moe_experts > 0)")
    need = {"llama": dict(qk_norm=False, qkv_bias=False), "mistral": dict(qk_norm=False, qkv_bias=False, bias=False),
            "qwen2": dict(qk_norm=False, bias=False), "qwen3": dict(qkv_bias=False, bias=False)}[family]
    for key, value in need.items():
        if getattr(m, key) != value:
            raise ConfigError(f"convert export: model.{key} = {getattr(m, key)} has no equivalent in "
                              f"{ARCHITECTURES[family]}; choose another --arch")
    if family == "qwen2" and not m.qkv_bias:
        raise ConfigError("convert export: Qwen2ForCausalLM always has q/k/v biases; set --arch llama")
    return family


def _moe_family(m: ModelConfig, arch: str | None) -> str:
    """Mixtral (softmax, no shared experts), Qwen3-MoE (q/k norms) or DeepSeek-V2/V3 (latent
    attention; V3 = sigmoid router), checked key by key."""
    natural = ("deepseek_v3" if m.moe_router == "sigmoid" else "deepseek_v2") if m.mla else (
        "qwen3_moe" if m.qk_norm else "mixtral")
    family = arch or natural
    if family != natural:
        raise ConfigError(f"convert export: this model exports as {ARCHITECTURES[natural]}, not {ARCHITECTURES[family]}")
    if not m.moe_experts:
        raise ConfigError(f"convert export: {ARCHITECTURES[family]} needs model.moe_experts > 0")
    deepseek = family.startswith("deepseek")
    need = dict(bias=False, qkv_bias=False, moe_capacity_factor=0.0)
    if family == "mixtral":
        need.update(moe_shared_experts=0, moe_first_dense=0, moe_dense_layers=[], moe_every=1, moe_router="softmax",
                    moe_norm_topk=True, moe_groups=0, moe_routed_scale=1.0, moe_bias_balance=False)
    elif family == "qwen3_moe":
        need.update(moe_shared_experts=0, moe_router="softmax", moe_groups=0, moe_routed_scale=1.0,
                    moe_bias_balance=False)
    elif deepseek:
        need.update(moe_every=1, moe_dense_layers=[], qk_norm=False, attn_head_dim=0)
        if family == "deepseek_v2":
            need.update(moe_norm_topk=False, moe_bias_balance=False)
        else:
            need.update(moe_bias_balance=True)
    for key, value in need.items():
        if getattr(m, key) != value:
            raise ConfigError(f"convert export: model.{key} = {getattr(m, key)} has no equivalent in "
                              f"{ARCHITECTURES[family]}")
    return family


def _hf_rope(m: ModelConfig) -> tuple[dict, int]:
    """transformers' ``rope_scaling`` dict (None for plain RoPE) and max_position_embeddings."""
    kind = m.rope_scaling
    longest = max(m.max_position, m.seq_len)  # a run at a shorter seq_len keeps the published context
    if kind == "none":
        return None, longest
    scaling = {"rope_type": kind, "factor": m.rope_factor}
    if kind == "dynamic":  # transformers reads the original context from max_position_embeddings
        return scaling, m.rope_original_seq_len
    if kind in ("llama3", "yarn"):
        scaling["original_max_position_embeddings"] = m.rope_original_seq_len
    if kind == "llama3":
        scaling.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor)
    if kind == "yarn":
        scaling.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow)
        if m.rope_attention_factor:
            scaling["attention_factor"] = m.rope_attention_factor
    return scaling, longest


def hf_config_from_model(m: ModelConfig, dtype: torch.dtype, arch: str | None = None) -> dict:
    family = hf_family(m, arch)
    rope_scaling, max_pos = _hf_rope(m)
    out = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "hidden_size": m.dim, "intermediate_size": m.hidden_dim, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
        "vocab_size": m.vocab_size, "max_position_embeddings": max_pos, "rms_norm_eps": m.norm_eps,
        # transformers 4 names (rope_theta + rope_scaling); transformers 5 reads them too.
        "rope_theta": m.rope_theta, "rope_scaling": rope_scaling, "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family in ("llama", "mistral"):
        out.update(attention_bias=m.bias, mlp_bias=m.bias)
    if family == "mistral":
        out["sliding_window"] = None
    if family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layers)
    if family in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if family == "mixtral":
        out.update(num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_topk, sliding_window=None,
                   router_aux_loss_coef=m.moe_aux_loss_coef, intermediate_size=m.expert_dim)
    if family == "qwen3_moe":
        out.update(num_experts=m.moe_experts, num_experts_per_tok=m.moe_topk, moe_intermediate_size=m.expert_dim,
                   decoder_sparse_step=m.moe_every, norm_topk_prob=m.moe_norm_topk,
                   mlp_only_layers=sorted(set(m.moe_dense_layers) | set(range(m.moe_first_dense))),
                   router_aux_loss_coef=m.moe_aux_loss_coef)
    if family.startswith("deepseek"):
        out.update(n_routed_experts=m.moe_experts, num_experts_per_tok=m.moe_topk, moe_intermediate_size=m.expert_dim,
                   n_shared_experts=m.moe_shared_experts, first_k_dense_replace=m.moe_first_dense, moe_layer_freq=1,
                   n_group=m.moe_groups or 1, topk_group=m.moe_topk_groups or 1,
                   routed_scaling_factor=m.moe_routed_scale, norm_topk_prob=family == "deepseek_v3",
                   q_lora_rank=m.mla_q_rank or None, kv_lora_rank=m.mla_kv_rank, qk_rope_head_dim=m.mla_rope_dim,
                   qk_nope_head_dim=m.mla_nope_dim, v_head_dim=m.mla_v_dim, head_dim=m.mla_rope_dim,
                   attention_bias=False, mlp_bias=False, num_nextn_predict_layers=m.mtp_depth)
        if family == "deepseek_v2":
            out.update(topk_method="group_limited_greedy" if m.moe_groups else "greedy", scoring_func="softmax")
        else:
            out.update(topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True)
        if rope_scaling and m.rope_scaling == "yarn" and m.rope_mscale_all_dim:
            rope_scaling["mscale_all_dim"] = m.rope_mscale_all_dim
    return out


# --------------------------------------------------------------------------- weights


def _to_hf_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q/k from adjacent-pair rotation (meshfold) to half-split rotation (HF)."""
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(rows, *w.shape[1:])


def _from_hf_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(rows, *w.shape[1:])


def _rotated_heads(mine: str, m: ModelConfig) -> int | None:
    """How many heads a tensor's rows (or, for the per-head q/k norms, its one head) hold
    when RoPE's pair layout applies to it, or None when it does not."""
    if m.mla:  # latent attention rotates adjacent pairs on both sides
        return None
    if mine.startswith("attention.wq."):
        return m.n_heads
    if mine.startswith("attention.wk."):
        return m.kv_heads
    if mine.startswith(("attention.q_norm.", "attention.k_norm.")):
        return 1  # a weight over one head's features, applied before RoPE
    return None


FUSED_EXPERTS = ("feed_forward.experts.w13", "feed_forward.experts.w1", "feed_forward.experts.w3")


def _unfuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """meshfold's fused ``experts.w13`` [E, 2F, D] as its two halves ``experts.w1`` / ``w3``."""
    fused, w1, w3 = FUSED_EXPERTS
    out = {}
    for name, value in state.items():
        if name.endswith("." + fused):
            stem = name[: -len(fused)]
            out[stem + w1], out[stem + w3] = value.chunk(2, dim=1)
        else:
            out[name] = value
    return out


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``experts.w1`` and ``w3`` joined as meshfold's ``experts.w13`` (``_unfuse_experts``'s inverse)."""
    fused, w1, w3 = FUSED_EXPERTS
    out = {}
    for name, value in state.items():
        stem = name[: -len(w1)]
        if name.endswith("." + w1) and stem + w3 in state:
            out[stem + fused] = torch.cat([value, state[stem + w3]], dim=1)
        elif not name.endswith("." + w3):
            out[name] = value
    return out


def to_hf(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names and values (hub layout: one tensor per expert; Mixtral's block_sparse_moe)."""
    mixtral = bool(m.moe_experts) and not (m.qk_norm or m.mla)
    out = {}
    for name, value in _unfuse_experts(state).items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = value
            continue
        _, layer, rest = name.split(".", 2)
        if name.startswith("mtp."):  # depth k: HF decoder layer n_layers + k
            layer = str(m.n_layers + int(layer))
            if rest in MTP_NAMES:
                out[f"model.layers.{layer}.{MTP_NAMES[rest]}"] = value
                continue
            rest = rest.removeprefix("block.")
        prefix = f"model.layers.{layer}."
        if rest in EXPERT_NAMES:
            kind = EXPERT_NAMES[rest]
            for j in range(value.shape[0]):
                if mixtral:
                    out[f"{prefix}block_sparse_moe.experts.{j}.{MIXTRAL_EXPERT_NAMES[kind]}.weight"] = value[j]
                else:
                    out[f"{prefix}mlp.experts.{j}.{kind}.weight"] = value[j]
            continue
        if rest not in LAYER_NAMES:
            raise ConfigError(f"convert export: no Hugging Face name for {name}")
        heads = _rotated_heads(rest, m)
        if heads is not None:
            value = _to_hf_rope(value, heads)
        hf_name = LAYER_NAMES[rest]
        if mixtral and rest.startswith("feed_forward.router."):
            hf_name = hf_name.replace("mlp.", "block_sparse_moe.", 1)
        out[prefix + hf_name] = value
    for k in range(m.mtp_depth):  # the module's own copies of the shared embedding and head
        for hf_name, mine in MTP_COPIES.items():
            mine = "tok_embeddings.weight" if (m.tie_embeddings and mine == "output.weight") else mine
            out[f"model.layers.{m.n_layers + k}.{hf_name}"] = state[mine].clone()  # (safetensors: no shared storage)
    return {k: v.contiguous() for k, v in out.items()}


_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _hub_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One naming for every MoE layout: Mixtral's ``block_sparse_moe`` and w1/w3/w2 become
    ``mlp`` and gate/up/down; transformers 5's fused ``gate_up_proj`` [E, 2F, D] and
    ``down_proj`` [E, D, F] become one tensor per expert."""
    out = {}
    for name, value in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            if ".mlp.experts." in name and name.endswith(f".{old}.weight"):
                name = name[: -len(f"{old}.weight")] + f"{new}.weight"
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            for j in range(value.shape[0]):
                out[name.replace("gate_up_proj", f"{j}.gate_proj.weight")] = gate[j]
                out[name.replace("gate_up_proj", f"{j}.up_proj.weight")] = up[j]
            continue
        if name.endswith(".mlp.experts.down_proj"):
            for j in range(value.shape[0]):
                out[name.replace("down_proj", f"{j}.down_proj.weight")] = value[j]
            continue
        out[name] = value
    return out


def _block_prefix(layer: str, m: ModelConfig) -> str:
    """meshfold's prefix of HF decoder layer ``layer``: a main block, or a multi-token
    prediction depth's block past the main layers."""
    i = int(layer)
    return f"layers.{i}." if i < m.n_layers else f"mtp.{i - m.n_layers}.block."


def mtp_layers_in(names, m: ModelConfig) -> int:
    """How many multi-token prediction modules (decoder layers past ``m.n_layers``, DeepSeek-V3)
    tensors ``names`` hold: 0 unless they are the consecutive layers n_layers, n_layers + 1, ..."""
    extra = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.split(".")[2].isdigit()
             and int(n.split(".")[2]) >= m.n_layers}
    depth = 0
    while m.n_layers + depth in extra:
        depth += 1
    return depth


def from_hf(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    top = {v: k for k, v in TOP_NAMES.items()}
    per_layer = {v: k for k, v in LAYER_NAMES.items()}
    experts_of = {v: k for k, v in EXPERT_NAMES.items()}
    out, experts = {}, {}
    for name, value in _hub_names(state).items():
        if name in top:
            if name == "lm_head.weight" and m.tie_embeddings:
                continue  # tied: the embedding is the output projection
            out[top[name]] = value
            continue
        if "rotary_emb" in name:
            continue
        if not name.startswith("model.layers."):
            raise ConfigError(f"convert import: unexpected tensor {name}")
        _, _, layer, rest = name.split(".", 3)
        if m.mla and int(layer) >= m.n_layers:  # DeepSeek-V3's multi-token prediction modules
            depth = int(layer) - m.n_layers
            if depth >= m.mtp_depth:
                continue  # not imported (read_hf sets mtp_depth from the layers the files hold)
            if rest in MTP_COPIES:  # meshfold shares the main model's: they must be equal
                main = state.get("model.embed_tokens.weight" if rest == "embed_tokens.weight" else "lm_head.weight")
                if main is not None and not torch.equal(main, value):
                    raise ConfigError(f"convert import: {name} differs from the main model's "
                                      f"{'embedding' if rest == 'embed_tokens.weight' else 'output head'}; "
                                      f"meshfold's multi-token prediction shares them")
                continue
            mtp_names = {v: k for k, v in MTP_NAMES.items()}
            if rest in mtp_names:
                out[f"mtp.{depth}.{mtp_names[rest]}"] = value
                continue
        expert = _EXPERT.fullmatch(name)
        if expert:
            experts.setdefault((layer, experts_of[expert.group(3)]), {})[int(expert.group(2))] = value
            continue
        if rest not in per_layer:
            raise ConfigError(f"convert import: unexpected tensor {name}")
        mine = per_layer[rest]
        heads = _rotated_heads(mine, m)
        if heads is not None:
            value = _from_hf_rope(value, heads)
        out[_block_prefix(layer, m) + mine] = value
    for (layer, mine), per_expert in experts.items():
        if sorted(per_expert) != list(range(m.moe_experts)):
            raise ConfigError(f"convert import: layer {layer} has experts {sorted(per_expert)[:5]}..., the config "
                              f"says {m.moe_experts}")
        out[_block_prefix(layer, m) + mine] = torch.stack([per_expert[j] for j in range(m.moe_experts)])
    return {k: v.contiguous() for k, v in _fuse_experts(out).items()}


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"convert import: no .safetensors files in {folder}")
    state = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def write_safetensors(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> None:
    """One ``model.safetensors``, or shards plus ``model.safetensors.index.json`` (HF layout)."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in state.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
