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

import dataclasses
import json
import math
import shutil
import sys
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


# --------------------------------------------------------------------------- meshfold side


def read_checkpoint_model(ckpt: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Full (unsharded) model tensors of a meshfold checkpoint, in one process, and the
    model shape from its manifest. The checkpoint is validated first."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from meshfold.train.checkpoint import read_dcp_metadata, safe_load, validate_checkpoint

    manifest = validate_checkpoint(ckpt)
    m = ModelConfig(**manifest["model"])
    meta = read_dcp_metadata(ckpt).state_dict_metadata  # JSON, never the pickled .metadata
    model = {k[len("model."):]: torch.empty(tuple(v.size), dtype=v.properties.dtype, device="cpu")
             for k, v in meta.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    sd = {"model": model}
    safe_load(sd, ckpt, no_dist=True)
    return sd["model"], m


# Files of a Hugging Face model folder that describe its tokenizer (copied both ways).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
SOURCE_CONFIG = "hf_config.json"  # the imported model's config.json, kept in the import
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # copied back into an export's config.json


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files of ``src`` into ``dst``; returns the names copied. ``src`` is
    a folder, a ``tokenizer.json`` (its folder's other tokenizer files come along) or any
    other tokenizer.json-format file (a cached BPE), which lands as ``tokenizer.json``."""
    if src.is_file():
        if src.name == "tokenizer.json":
            return copy_tokenizer(src.parent, dst)
        shutil.copyfile(src, dst / "tokenizer.json")
        return ["tokenizer.json"]
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def write_checkpoint_model(state: dict[str, torch.Tensor], m: ModelConfig, out: Path, source: str,
                           source_dir: Path | None = None) -> list[str]:
    """A meshfold checkpoint folder holding only the model (what ``train.init_from`` reads)
    and the source's tokenizer files and config.json (``source_dir``), published atomically
    like training checkpoints.
    Returns the tokenizer files copied."""
    import torch.distributed.checkpoint as dcp

    from meshfold.config import Config, dump_toml
    from meshfold.train.checkpoint import SafeWriter, publish, write_manifest

    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dcp.save({"model": state}, storage_writer=SafeWriter(str(tmp)), no_dist=True)  # + dcp_metadata.json
    copied = copy_tokenizer(source_dir, tmp) if source_dir is not None else []
    if source_dir is not None and (source_dir / "config.json").is_file():
        shutil.copyfile(source_dir / "config.json", tmp / SOURCE_CONFIG)  # token ids etc. for export
    cfg = Config(model=m)
    cfg.train.init_from = str(out)
    if "tokenizer.json" in copied:
        cfg.data.tokenizer = str(out / "tokenizer.json")
    note = (f"# meshfold [model] of {source}; train with: meshfold train {out / 'config.toml'}\n"
            f"# model.seq_len is the source's longest context ({m.seq_len}); set the length to train at.\n")
    (tmp / "config.toml").write_text(note + dump_toml(cfg))
    write_manifest(tmp, {"step": 0, "world_size": 1, "model": dataclasses.asdict(m), "parallel": {},
                         "extras": [], "source": source})
    publish(tmp, out)
    return copied


def read_hf(hf_dir: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """meshfold-named tensors and model shape of a Hugging Face folder, checked against the
    names the shape implies."""
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise ConfigError(f"convert: {config_path} does not exist (give a Hugging Face model folder)")
    m = model_config_from_hf(json.loads(config_path.read_text()))
    state = from_hf(read_safetensors(hf_dir), m)
    expected = _expected_names(m)
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ConfigError(f"convert import: tensors do not match the config: missing {missing[:5]}, extra {extra[:5]}")
    return state, m


def import_hf(hf_dir: Path, out: Path, untie: bool = False) -> ModelConfig:
    """``untie``: give a tied model its own output projection (a copy of the embedding, so
    the logits are unchanged), which pipeline parallel needs; the two then train apart."""
    hf_dir, out = Path(hf_dir), Path(out)
    state, m = read_hf(hf_dir)
    if untie and m.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"].clone()
        m = dataclasses.replace(m, tie_embeddings=False)
    write_checkpoint_model(state, m, out, source=str(hf_dir), source_dir=hf_dir)
    return m


def _origins(ckpt: Path) -> tuple[list[Path], Path | None]:
    """Where a checkpoint came from: the folders that may hold its source's Hugging Face
    config (the checkpoint itself when it is an import, else its run's ``train.init_from``),
    and its tokenizer (its own files, else its run's ``data.tokenizer``)."""
    folders, tokenizer = [ckpt], None
    run_config = ckpt.parent.parent / "config.toml"  # RUN_DIR/checkpoints/step-N
    if run_config.is_file():
        from meshfold.config import load_config

        run = load_config(run_config)
        if run.train.init_from:
            folders.append(Path(run.train.init_from).expanduser())
        tok = Path(run.data.tokenizer).expanduser() if run.data.tokenizer else None
        tokenizer = tok if tok is not None and tok.exists() else None
    if (ckpt / "tokenizer.json").is_file():
        tokenizer = ckpt
    return folders, tokenizer


def export_hf(ckpt: Path, out: Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
              arch: str | None = None, tokenizer: Path | None = None) -> tuple[ModelConfig, str, list[str]]:
    """Returns the model shape, the family written and the tokenizer files copied. The
    source model's bos/eos/pad token ids (from an import, directly or through the run's
    ``train.init_from``) are written into ``config.json``."""
    ckpt = Path(ckpt)
    if tokenizer is not None and not tokenizer.exists():
        raise ConfigError(f"convert export: --tokenizer {tokenizer} does not exist")
    state, m = read_checkpoint_model(ckpt)
    family = hf_family(m, arch)  # refuse before writing anything
    folders, found_tokenizer = _origins(ckpt)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    hf_state = to_hf(state, m)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(hf_state, out, max_shard_bytes)
    dt = next(iter(state.values())).dtype
    config = hf_config_from_model(m, dt, family)
    for folder in folders:
        if (folder / SOURCE_CONFIG).is_file():
            source = json.loads((folder / SOURCE_CONFIG).read_text())
            config.update({k: source[k] for k in TOKEN_IDS if source.get(k) is not None})
            break
    (out / "config.json").write_text(json.dumps(config, indent=1))
    source = tokenizer if tokenizer is not None else found_tokenizer
    copied = copy_tokenizer(source, out) if source is not None else []
    return m, family, copied


def _expected_names(m: ModelConfig) -> set[str]:
    from meshfold.models.llama import Transformer

    with torch.device("meta"):
        return {name for name, _ in Transformer(m).named_parameters()}


def load_model(ckpt: Path, dtype: torch.dtype | None = None):
    """A parallelism-free ``Transformer`` with the weights of a meshfold checkpoint."""
    from meshfold.models.llama import Transformer

    state, m = read_checkpoint_model(Path(ckpt))
    model = Transformer(m)
    if dtype is not None:
        model.to(dtype)
    model.load_state_dict({k: v.to(dtype) if dtype else v for k, v in state.items()})
    return model


# --------------------------------------------------------------------------- check

CHECK_TOLERANCE = 1e-4


def check_hf(hf_dir: Path, batch: int = 2, seq: int = 64, seed: int = 0) -> dict:
    """Largest absolute logit difference between ``transformers`` and meshfold's import of
    ``hf_dir`` on the same random tokens, both in float32."""
    from meshfold.models.llama import Transformer, rope_tables

    try:
        import transformers
    except ImportError:
        raise ConfigError("convert check needs transformers: pip install transformers") from None
    hf_dir = Path(hf_dir)
    state, m = read_hf(hf_dir)
    with torch.device("meta"):  # no random init of billions of weights about to be replaced
        ours = Transformer(m)
    ours.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
    ours.rope_cos, ours.rope_sin = rope_tables(m)  # non-persistent buffers: not in the state dict
    ours.eval()
    del state
    fp32 = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **fp32).eval()
    seq = min(seq, m.seq_len)
    tokens = torch.randint(0, m.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    return {"max_abs_diff": diff, "tolerance": CHECK_TOLERANCE, "ok": diff <= CHECK_TOLERANCE,
            "model_type": theirs.config.model_type, "tokens": [batch, seq], "dtype": "float32"}


# --------------------------------------------------------------------------- CLI

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="Hugging Face (Llama 3.x, Mistral, Qwen2/2.5/3) <-> meshfold checkpoints")
    direction = p.add_subparsers(dest="direction", required=True)
    imp = direction.add_parser("import",
                               help="HF folder (config.json + safetensors + tokenizer) -> meshfold checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out", help="checkpoint folder to create (use it as train.init_from)")
    imp.add_argument("--untie", action="store_true",
                     help="tied embeddings: give the output projection its own copy (for parallel.pp > 1)")
    exp = direction.add_parser("export", help="meshfold checkpoint (e.g. RUN_DIR/checkpoints/step-N) -> HF folder")
    exp.add_argument("checkpoint")
    exp.add_argument("out")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: as saved)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file")
    exp.add_argument("--arch", choices=FAMILIES, default=None,
                     help="Hugging Face family to write (default: qwen3 with q/k norms, qwen2 with q/k/v biases, "
                          "else llama)")
    exp.add_argument("--tokenizer", default=None,
                     help="tokenizer folder or tokenizer.json to copy (default: the checkpoint's own, or its "
                          "run's data.tokenizer)")
    chk = direction.add_parser("check", help="logits of transformers vs meshfold's import, fp32, same tokens")
    chk.add_argument("hf_dir")
    chk.add_argument("--json", action="store_true", help="print one JSON object (key max_abs_diff)")
    chk.add_argument("--batch", type=int, default=2)
    chk.add_argument("--seq", type=int, default=64, help="tokens per sequence (at most model.seq_len)")
    chk.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from meshfold.train.checkpoint import CheckpointError

    try:
        if args.direction == "import":
            m = import_hf(Path(args.hf_dir), Path(args.out), args.untie)
            tok = Path(args.out) / "tokenizer.json"
            print(f"meshfold: imported {args.hf_dir} ({m.n_layers} layers, dim {m.dim}) into {args.out}; "
                  f"train from it with train.init_from = {args.out!r} and its [model] (see {args.out}/config.toml)"
                  + ("" if tok.exists() else "; no tokenizer.json in the source: set data.tokenizer yourself"))
        elif args.direction == "export":
            m, family, copied = export_hf(Path(args.checkpoint), Path(args.out), DTYPES.get(args.dtype),
                                          int(args.max_shard_gb * 2**30), args.arch,
                                          Path(args.tokenizer) if args.tokenizer else None)
            print(f"meshfold: exported {args.checkpoint} to {args.out} ({ARCHITECTURES[family]}, {m.n_layers} "
                  f"layers" + (f", tokenizer: {', '.join(copied)})" if copied else ", no tokenizer found)"))
        else:
            result = check_hf(Path(args.hf_dir), args.batch, args.seq, args.seed)
            if args.json:
                print(json.dumps(result))
            else:
                verdict = "ok" if result["ok"] else f"FAILED (above {CHECK_TOLERANCE:g})"
                print(f"meshfold: {args.hf_dir} ({result['model_type']}): max |logit difference| against "
                      f"transformers = {result['max_abs_diff']:.3g} on {args.batch}x{result['tokens'][1]} tokens, "
                      f"float32: {verdict}")
            return 0 if result["ok"] else 1
    except CheckpointError as err:
        print(f"meshfold: error: {err}", file=sys.stderr)
        return 2
    return 0
