"""Hugging Face Llama interop: ``meshfold convert import|export``.

import  HF folder (``config.json`` + ``*.safetensors``, sharded or not) -> a meshfold
        checkpoint folder (DCP, ``model.<name>`` keys, ``meshfold.json`` manifest) that
        ``train.init_from`` starts from, plus ``config.toml`` with the matching ``[model]``.
export  a meshfold checkpoint (a training ``step-N`` or an imported one; the model shape
        comes from its manifest) -> HF folder loadable by ``LlamaForCausalLM.from_pretrained``.

Names map one to one (``model.layers.i.self_attn.q_proj`` <-> ``layers.i.attention.wq``,
``mlp.gate_proj/up_proj/down_proj`` <-> ``feed_forward.w1/w3/w2``, ...). The one change of
values: meshfold rotates *adjacent* pairs of each head's q/k features (Meta's layout),
Hugging Face rotates the two *halves* (``rotate_half``), so q_proj/k_proj rows are permuted
per head: HF row ``h*d + j`` holds meshfold row ``h*d + 2j`` (j < d/2) or ``h*d + 2(j-d/2) + 1``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from meshfold.config import ConfigError, ModelConfig

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
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


# --------------------------------------------------------------------------- config


def model_config_from_hf(hf: dict) -> ModelConfig:
    """meshfold's ``[model]`` for a HF Llama ``config.json``; ConfigError for what meshfold's
    Llama cannot represent exactly."""
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "mistral") or hf.get("sliding_window"):
        raise ConfigError(f"convert: model_type {model_type!r} is not a plain Llama; only Llama-style models import")
    if hf.get("rope_scaling"):
        raise ConfigError(f"convert: rope_scaling {hf['rope_scaling']} is not supported (plain RoPE only)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"convert: hidden_act {hf['hidden_act']!r}; meshfold's SwiGLU needs silu")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads):
        raise ConfigError(f"convert: head_dim {hf['head_dim']} != hidden_size/num_attention_heads = {dim // heads}")
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise ConfigError("convert: attention_bias and mlp_bias differ; meshfold has one model.bias switch")
    return ModelConfig(
        dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(hf.get("rope_theta", 10000.0)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bias=bool(hf.get("attention_bias", False)),
    )


def hf_config_from_model(m: ModelConfig, dtype: torch.dtype) -> dict:
    if m.norm != "rmsnorm" or m.mlp != "swiglu" or m.pos != "rope" or m.moe_experts:
        raise ConfigError("convert export: only dense Llama models (rmsnorm, swiglu, rope) map to LlamaForCausalLM")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": m.dim, "intermediate_size": m.hidden_dim, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
        "vocab_size": m.vocab_size, "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu",
        "attention_bias": m.bias, "mlp_bias": m.bias, "torch_dtype": str(dtype).removeprefix("torch."),
    }


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


def to_hf(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = value
            continue
        _, layer, rest = name.split(".", 2)
        if rest not in LAYER_NAMES:
            raise ConfigError(f"convert export: no Hugging Face name for {name}")
        if rest.startswith(("attention.wq.", "attention.wk.")):
            value = _to_hf_rope(value, m.n_heads if ".wq." in rest else m.kv_heads)
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
        if not name.startswith("model.layers.") or "rotary_emb" in name:
            if "rotary_emb" in name:
                continue
            raise ConfigError(f"convert import: unexpected tensor {name}")
        _, _, layer, rest = name.split(".", 3)
        if rest not in per_layer:
            raise ConfigError(f"convert import: unexpected tensor {name}")
        mine = per_layer[rest]
        if mine.startswith(("attention.wq.", "attention.wk.")):
            value = _from_hf_rope(value, m.n_heads if ".wq." in mine else m.kv_heads)
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


def write_checkpoint_model(state: dict[str, torch.Tensor], m: ModelConfig, out: Path, source: str) -> None:
    """A meshfold checkpoint folder holding only the model (what ``train.init_from`` reads),
    published atomically like training checkpoints."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from meshfold.config import dump_toml, Config
    from meshfold.train.checkpoint import SafeWriter, publish, write_manifest

    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dcp.save({"model": state}, storage_writer=SafeWriter(str(tmp)), no_dist=True)  # + dcp_metadata.json
    cfg = Config(model=m)
    cfg.train.init_from = str(out)
    (tmp / "config.toml").write_text(
        f"# meshfold [model] of {source}; train with: meshfold train {out / 'config.toml'}\n" + dump_toml(cfg))
    write_manifest(tmp, {"step": 0, "world_size": 1, "model": dataclasses.asdict(m), "parallel": {},
                         "extras": [], "source": source})
    publish(tmp, out)


def import_hf(hf_dir: Path, out: Path) -> ModelConfig:
    hf_dir, out = Path(hf_dir), Path(out)
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise ConfigError(f"convert import: {config_path} does not exist")
    m = model_config_from_hf(json.loads(config_path.read_text()))
    state = from_hf(read_safetensors(hf_dir), m)
    expected = _expected_names(m)
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ConfigError(f"convert import: tensors do not match the config: missing {missing[:5]}, extra {extra[:5]}")
    write_checkpoint_model(state, m, out, source=str(hf_dir))
    return m


def export_hf(ckpt: Path, out: Path, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 2**30) -> ModelConfig:
    state, m = read_checkpoint_model(Path(ckpt))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    hf_state = to_hf(state, m)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(hf_state, out, max_shard_bytes)
    dt = next(iter(state.values())).dtype
    (out / "config.json").write_text(json.dumps(hf_config_from_model(m, dt), indent=1))
    return m


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


# --------------------------------------------------------------------------- CLI

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="Hugging Face Llama <-> meshfold checkpoints")
    direction = p.add_subparsers(dest="direction", required=True)
    imp = direction.add_parser("import", help="HF folder (config.json + safetensors) -> meshfold checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out", help="checkpoint folder to create (use it as train.init_from)")
    exp = direction.add_parser("export", help="meshfold checkpoint (e.g. RUN_DIR/checkpoints/step-N) -> HF folder")
    exp.add_argument("checkpoint")
    exp.add_argument("out")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: as saved)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file")


def run(args) -> int:
    from meshfold.train.checkpoint import CheckpointError

    try:
        if args.direction == "import":
            m = import_hf(Path(args.hf_dir), Path(args.out))
            print(f"meshfold: imported {args.hf_dir} ({m.n_layers} layers, dim {m.dim}) into {args.out}; "
                  f"train from it with train.init_from = {args.out!r} and its [model] (see {args.out}/config.toml)")
        else:
            m = export_hf(Path(args.checkpoint), Path(args.out), DTYPES.get(args.dtype),
                          int(args.max_shard_gb * 2**30))
            print(f"meshfold: exported {args.checkpoint} to {args.out} (LlamaForCausalLM, {m.n_layers} layers)")
    except CheckpointError as err:
        print(f"meshfold: error: {err}", file=sys.stderr)
        return 2
    return 0
