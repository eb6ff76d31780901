"""Hugging Face interop for Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3: ``meshfold convert``.

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
Features and refusals: docs/hf.md.
"""

from __future__ import annotations

import json
import math
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
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


# --------------------------------------------------------------------------- config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
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
    if model_type in ("qwen2", "qwen3"):  # the window only applies with use_sliding_window
        return "use_sliding_window = true" if hf.get("use_sliding_window") else None
    window, longest = hf.get("sliding_window"), hf.get("max_position_embeddings", 0)
    return f"sliding_window = {window}" if window and window < longest else None


def model_config_from_hf(hf: dict) -> ModelConfig:
    """meshfold's ``[model]`` for a HF ``config.json`` of the Llama / Mistral / Qwen2 / Qwen3
    families; ConfigError (one line) for what meshfold cannot represent exactly."""
    model_type = hf.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ConfigError(f"convert: model_type {model_type!r} is not supported; meshfold imports "
                          f"{', '.join(FAMILIES)} (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3)")
    window = _sliding_window(hf, model_type)
    if window:
        raise ConfigError(f"convert: {window}: sliding-window attention is not supported (meshfold attends "
                          f"to the whole causal context)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"convert: hidden_act {hf['hidden_act']!r}; meshfold's SwiGLU needs silu")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if model_type == "qwen3" and attn_bias:
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
        qk_norm=model_type == "qwen3", attn_head_dim=head_dim if head_dim != dim // heads else 0, **scaling,
    )


def hf_family(m: ModelConfig, arch: str | None = None) -> str:
    """The Hugging Face family a meshfold model exports to (``arch`` forces one), or a
    ConfigError naming the feature that family lacks."""
    if m.norm != "rmsnorm" or m.mlp != "swiglu" or m.pos != "rope" or m.moe_experts:
        raise ConfigError("convert export: only dense models with rmsnorm, swiglu and rope map to a Hugging Face "
                          "Llama/Mistral/Qwen model")
    family = arch or ("qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama")
    need = {"llama": dict(qk_norm=False, qkv_bias=False), "mistral": dict(qk_norm=False, qkv_bias=False, bias=False),
            "qwen2": dict(qk_norm=False, bias=False), "qwen3": dict(qkv_bias=False, bias=False)}[family]
    for key, value in need.items():
        if getattr(m, key) != value:
            raise ConfigError(f"convert export: model.{key} = {getattr(m, key)} has no equivalent in "
                              f"{ARCHITECTURES[family]}; choose another --arch")
    if family == "qwen2" and not m.qkv_bias:
        raise ConfigError("convert export: Qwen2ForCausalLM always has q/k/v biases; set --arch llama")
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
    if family == "qwen3":
        out["attention_bias"] = False
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
    if mine.startswith("attention.wq."):
        return m.n_heads
    if mine.startswith("attention.wk."):
        return m.kv_heads
    if mine.startswith(("attention.q_norm.", "attention.k_norm.")):
        return 1  # a weight over one head's features, applied before RoPE
    return None


def to_hf(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = value
            continue
        _, layer, rest = name.split(".", 2)
        if rest not in LAYER_NAMES:
            raise ConfigError(f"convert export: no Hugging Face name for {name}")
        heads = _rotated_heads(rest, m)
        if heads is not None:
            value = _to_hf_rope(value, heads)
        out[f"model.layers.{layer}.{LAYER_NAMES[rest]}"] = value
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    top = {v: k for k, v in TOP_NAMES.items()}
    per_layer = {v: k for k, v in LAYER_NAMES.items()}
    out = {}
    for name, value in state.items():
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
        if rest not in per_layer:
            raise ConfigError(f"convert import: unexpected tensor {name}")
        mine = per_layer[rest]
        heads = _rotated_heads(mine, m)
        if heads is not None:
            value = _from_hf_rope(value, heads)
        out[f"layers.{layer}.{mine}"] = value
    return {k: v.contiguous() for k, v in out.items()}


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
