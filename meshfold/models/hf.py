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
the balancing bias ``expert_bias``.

What differs per family (its ``model_type`` names, its ``[model]`` keys and refusals, its
``config.json`` entries, extra tensor names, tensors outside the decoder layers) is the family's
adapter (``models/<family>/hf.py``, protocol in ``models/hf_adapter.py``), looked up through the
registry: by ``model_type`` on import, by the one whose ``natural_type`` claims the model on
export. Features and refusals: docs/hf.md; adding a family: docs/families.md.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from meshfold.errors import ConfigError
from meshfold.models import registry
from meshfold.models.config import ModelConfig
from meshfold.models.hf_adapter import ROPE_TYPES, HFAdapter

# meshfold name (per layer, after "layers.{i}.") <-> HF name (after "model.layers.{i}.");
# a family's adapter adds its own (``layer_names``: DeepSeek's latent attention).
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
    # MoE blocks (the hub names; an adapter may rename them on export: Mixtral's block_sparse_moe)
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# meshfold's stacked expert weights [E, out, in] <-> one HF tensor per expert (hub layout).
EXPERT_NAMES = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
                "feed_forward.experts.w2": "down_proj"}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


# --------------------------------------------------------------------------- config

ARCHITECTURES = registry.hf_model_types()  # model_type -> architecture, every family's
FAMILIES = tuple(ARCHITECTURES)


def adapter_of_type(model_type: str) -> HFAdapter:
    adapter = registry.hf_adapter(model_type)
    if adapter is None:
        raise ConfigError(f"convert: model_type {model_type!r} is not supported; meshfold imports "
                          f"{', '.join(FAMILIES)} (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE, "
                          f"DeepSeek-V2/V3)")
    return adapter


def adapter_of_model(m: ModelConfig) -> tuple[HFAdapter, str]:
    """The adapter whose family a model is, and the ``model_type`` it exports as by default."""
    for adapter in reversed(registry.hf_adapters()):  # a later family built on shared blocks claims first
        if (m.norm, m.mlp) != (adapter.norm, adapter.mlp):
            continue
        model_type = adapter.natural_type(m)
        if model_type is not None:
            return adapter, model_type
    raise ConfigError("convert export: no Hugging Face family has this model's blocks")


def model_config_from_hf(hf: dict) -> ModelConfig:
    """meshfold's ``[model]`` for a HF ``config.json`` of a registered family; ConfigError (one
    line) for what meshfold cannot represent exactly."""
    model_type = hf.get("model_type", "llama")
    adapter = adapter_of_type(model_type)
    family_keys = adapter.config_keys(hf, model_type)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"convert: hidden_act {hf['hidden_act']!r}; meshfold's SwiGLU needs silu")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    rope = adapter.rope_parameters(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"convert: rope_type {rope_type!r} is not supported; meshfold has "
                          f"{', '.join(ROPE_TYPES)}")
    fraction = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if fraction != 1.0 and not adapter.partial_rope:
        raise ConfigError(f"convert: partial_rotary_factor {fraction} is not supported for {model_type} "
                          f"(meshfold rotates the whole head)")
    seq_len = hf.get("max_position_embeddings", 2048)
    scaling: dict = {"rope_scaling": ROPE_TYPES[rope_type]}
    if rope_type != "default":
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings")
        if rope_type == "dynamic":  # transformers stretches beyond max_position_embeddings
            original = seq_len
        if rope_type == "yarn":
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
                           rope_attention_factor=float(attention or 0.0),
                           rope_truncate=bool(rope.get("truncate", True)))
        if rope_type == "llama3":
            scaling.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                           rope_high_freq_factor=float(rope["high_freq_factor"]))
        scaling.update(rope_factor=float(factor), rope_original_seq_len=int(original or 0))
    keys = dict(
        dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_len=seq_len, max_position=seq_len, norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attn_head_dim=head_dim if head_dim != dim // heads else 0, rope_fraction=fraction, **scaling,
    )
    return ModelConfig(**{**keys, **family_keys})


def complete_from_weights(hf: dict, m: ModelConfig, names) -> ModelConfig:
    """``m`` once the weight names are known: keys a family reads from the files, not the
    config (DeepSeek-V3's multi-token prediction depth)."""
    return adapter_of_type(hf.get("model_type", "llama")).complete(m, names)


def hf_family(m: ModelConfig, arch: str | None = None) -> str:
    """The Hugging Face ``model_type`` a meshfold model exports to (``arch`` forces one), or a
    ConfigError naming the feature that family lacks."""
    if m.pos != "rope" or all((m.norm, m.mlp) != (a.norm, a.mlp) for a in registry.hf_adapters()):
        raise ConfigError("convert export: only models with rmsnorm, swiglu and rope map to a Hugging Face "
                          "Llama/Mistral/Qwen/Mixtral/DeepSeek model")
    adapter, _ = adapter_of_model(m)
    if m.rope_fraction != 1.0 and not adapter.partial_rope:
        raise ConfigError(f"convert export: model.rope_fraction = {m.rope_fraction} (partial RoPE) has no "
                          f"equivalent in this model's Hugging Face family")
    return adapter.export_type(m, arch)


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
        if not m.rope_truncate:
            scaling["truncate"] = False
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
    if m.rope_fraction != 1.0:  # (transformers 5 moves it into rope_parameters)
        out["partial_rotary_factor"] = m.rope_fraction
    adapter_of_type(family).write_config(m, family, out)
    return out


# --------------------------------------------------------------------------- weights


def _to_hf_rope(w: torch.Tensor, heads: int, turned: int) -> torch.Tensor:
    """Rows of q/k from adjacent-pair rotation (meshfold) to half-split rotation (HF), over the
    leading ``turned`` features of each head (partial RoPE: the rest stay in place)."""
    rows, rest = w.shape[0], w.shape[1:]
    per_head = w.reshape(heads, rows // heads, *rest)
    pairs = per_head[:, :turned].reshape(heads, turned // 2, 2, *rest).transpose(1, 2).reshape(heads, turned, *rest)
    return torch.cat([pairs, per_head[:, turned:]], dim=1).reshape(rows, *rest)


def _from_hf_rope(w: torch.Tensor, heads: int, turned: int) -> torch.Tensor:
    rows, rest = w.shape[0], w.shape[1:]
    per_head = w.reshape(heads, rows // heads, *rest)
    halves = per_head[:, :turned].reshape(heads, 2, turned // 2, *rest).transpose(1, 2).reshape(heads, turned, *rest)
    return torch.cat([halves, per_head[:, turned:]], dim=1).reshape(rows, *rest)


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
    """HF names and values (hub layout: one tensor per expert; the family's renames)."""
    adapter, _ = adapter_of_model(m)
    names = {**LAYER_NAMES, **adapter.layer_names}
    out = {}
    for name, value in _unfuse_experts(state).items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = value
            continue
        own = adapter.own_to_hf(name, value, m)
        if own is not None:
            out.update(own)
            continue
        layer, rest = adapter.split_name(name, m)
        prefix = f"model.layers.{layer}."
        if rest in EXPERT_NAMES:
            for j in range(value.shape[0]):
                out[prefix + adapter.expert_name(j, EXPERT_NAMES[rest], m)] = value[j]
            continue
        if rest not in names:
            raise ConfigError(f"convert export: no Hugging Face name for {name}")
        heads = adapter.rotated_heads(rest, m)
        if heads is not None:
            value = _to_hf_rope(value, heads, m.rope_dim)
        out[prefix + adapter.hf_layer_name(names[rest], m)] = value
    out.update(adapter.extra_to_hf(state, m))
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


def from_hf(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    adapter, _ = adapter_of_model(m)
    top = {v: k for k, v in TOP_NAMES.items()}
    per_layer = {v: k for k, v in {**LAYER_NAMES, **adapter.layer_names}.items()}
    experts_of = {v: k for k, v in EXPERT_NAMES.items()}
    out, experts = {}, {}
    for name, value in _hub_names(adapter.import_tensors(state, m)).items():
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
        own = adapter.own_from_hf(name, int(layer), rest, value, state, m)
        if own is not None:
            out.update(own)
            continue
        expert = _EXPERT.fullmatch(name)
        if expert:
            experts.setdefault((layer, experts_of[expert.group(3)]), {})[int(expert.group(2))] = value
            continue
        if rest not in per_layer:
            raise ConfigError(f"convert import: unexpected tensor {name}")
        mine = per_layer[rest]
        heads = adapter.rotated_heads(mine, m)
        if heads is not None:
            value = _from_hf_rope(value, heads, m.rope_dim)
        out[adapter.block_prefix(int(layer), m) + mine] = value
    for (layer, mine), per_expert in experts.items():
        if sorted(per_expert) != list(range(m.moe_experts)):
            raise ConfigError(f"convert import: layer {layer} has experts {sorted(per_expert)[:5]}..., the config "
                              f"says {m.moe_experts}")
        out[adapter.block_prefix(int(layer), m) + mine] = torch.stack([per_expert[j] for j in range(m.moe_experts)])
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
