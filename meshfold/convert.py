"""``meshfold convert``: Hugging Face folders <-> meshfold checkpoints, and ``convert check``.

The name and value mapping (and the HF config reading) is ``models/hf.py``; this module adds
what needs the checkpoint format (``train/checkpoint_files.py``) and the composed config, so it
sits in the tools layer (docs/architecture.md). Features and refusals: docs/hf.md.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch

from meshfold.config import Config, dump_toml, load_config
from meshfold.errors import ConfigError, did_you_mean
from meshfold.models.config import ModelConfig
from meshfold.models.hf import (ARCHITECTURES, FAMILIES, adapter_of_type, complete_from_weights, from_hf,
                               hf_config_from_model, hf_family, model_config_from_hf, read_safetensors, to_hf,
                               write_safetensors)
from meshfold.models.llama import Transformer, rope_buffers
from meshfold.train.checkpoint_files import (CheckpointError, SafeWriter, publish, read_dcp_metadata, safe_load,
                                             validate_checkpoint, write_manifest)
from meshfold.train.renamed_keys import join_whole
from meshfold.train.run_dir import describe_os_error


# --------------------------------------------------------------------------- meshfold side


def read_checkpoint_model(ckpt: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Full (unsharded) model tensors of a meshfold checkpoint, in one process, and the
    model shape from its manifest. The checkpoint is validated first."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest = validate_checkpoint(ckpt)
    m = ModelConfig(**manifest["model"])
    meta = read_dcp_metadata(ckpt).state_dict_metadata  # JSON, never the pickled .metadata
    model = {k[len("model."):]: torch.empty(tuple(v.size), dtype=v.properties.dtype, device="cpu")
             for k, v in meta.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    sd = {"model": model}
    safe_load(sd, ckpt, no_dist=True)
    return join_whole(sd["model"]), m  # (a checkpoint from before a rename: renamed_keys.py)


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
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_checkpoint_files(state, m, out, tmp, source, source_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed import leaves nothing behind
        raise
    return [n for n in TOKENIZER_FILES if (out / n).is_file()]


def _write_checkpoint_files(state, m: ModelConfig, out: Path, tmp: Path, source: str,
                            source_dir: Path | None) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": state}, storage_writer=SafeWriter(str(tmp)), no_dist=True)  # + dcp_metadata.json
    copied = copy_tokenizer(source_dir, tmp) if source_dir is not None else []
    if source_dir is not None and (source_dir / "config.json").is_file():
        shutil.copyfile(source_dir / "config.json", tmp / SOURCE_CONFIG)  # token ids etc. for export
    cfg = Config(model=m)
    cfg.train.init_from = str(out)
    cfg.train.run_dir = f"{out}-train"  # its own run directory, beside the weights (never runs/debug)
    if "tokenizer.json" in copied:
        cfg.data.tokenizer = str(out / "tokenizer.json")
    note = (f"# meshfold [model] of {source}; train with: meshfold train {out / 'config.toml'}\n"
            f"# model.seq_len is the source's longest context ({m.seq_len}); set the length to train at.\n")
    (tmp / "config.toml").write_text(note + dump_toml(cfg))
    write_manifest(tmp, {"step": 0, "world_size": 1, "model": dataclasses.asdict(m), "parallel": {},
                         "extras": [], "source": source})
    publish(tmp, out)


def _check_readable(hf_dir: Path) -> None:
    """Every safetensors file's header (and the shard index) parses: a corrupt file is one
    line naming it, not a traceback from deep inside the reader."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"convert: {index} is not a valid shard index ({type(err).__name__}: {err})") from None
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    for name in files:
        path = hf_dir / name
        if not path.is_file():
            raise ConfigError(f"convert: {path} is listed in {index.name} but missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as err:  # noqa: BLE001 - the reader raises several types for a damaged file
            raise ConfigError(f"convert: {path} is not a readable safetensors file "
                              f"({str(err).splitlines()[0][:160] if str(err) else type(err).__name__})") from None


def read_hf(hf_dir: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """meshfold-named tensors and model shape of a Hugging Face folder, checked against the
    names and shapes the config implies (every tensor)."""
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise ConfigError(f"convert: {config_path} does not exist (give a Hugging Face model folder)")
    try:
        hf_config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"convert: {config_path} is not valid JSON ({err})") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"convert: {config_path} holds a JSON {type(hf_config).__name__}, not an object")
    m = model_config_from_hf(hf_config)
    _check_readable(hf_dir)
    try:
        raw = read_safetensors(hf_dir)
        m = complete_from_weights(hf_config, m, raw)  # keys only the files tell (DeepSeek-V3's MTP depth)
        state = from_hf(raw, m)
    except (RuntimeError, ValueError, KeyError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"convert import: the weights in {hf_dir} do not fit {config_path} "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:160]})") from None
    expected = _expected_shapes(m)
    if set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise ConfigError(f"convert import: tensors do not match the config: missing {missing[:5]}, extra {extra[:5]}")
    wrong = [f"{k} {tuple(v.shape)} (config.json implies {expected[k]})" for k, v in sorted(state.items())
             if tuple(v.shape) != expected[k]]
    if wrong:
        raise ConfigError(f"convert import: {len(wrong)} tensor(s) do not have the shapes {config_path} implies: "
                          f"{'; '.join(wrong[:3])}; the config and the weights are from different models")
    return state, m


# --------------------------------------------------------------------------- never destroy

WRITTEN_BY = ".meshfold-export"  # marks a Hugging Face folder meshfold wrote (so --overwrite may replace it)


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _meshfold_wrote(out: Path) -> bool:
    return (out / WRITTEN_BY).is_file() or (out / "meshfold.json").is_file()


def check_output(out: Path, inputs: list[Path], overwrite: bool, command: str) -> None:
    """Refuse an output that is (or is inside) an input, or a non-empty folder unless it is
    one meshfold wrote and ``overwrite`` is given. Nothing is written before this passes."""
    for src in inputs:
        if src.exists() and (_inside(out, src) or _inside(src, out)):
            raise ConfigError(f"convert {command}: the output {out} is (or holds, or is inside) the input {src}; "
                              f"write to a new folder (nothing was changed)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"convert {command}: the output {out} is a file; give a new folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"convert {command}: the output folder {out} is not empty; give a new folder"
                              + (" (or --overwrite: meshfold wrote it)" if _meshfold_wrote(out) else "")
                              + " (nothing was changed)")
        if not _meshfold_wrote(out):
            raise ConfigError(f"convert {command}: --overwrite replaces only a folder meshfold wrote, and {out} is "
                              f"not one; give a new folder (nothing was changed)")


def import_hf(hf_dir: Path, out: Path, untie: bool = False, overwrite: bool = False) -> ModelConfig:
    """``untie``: give a tied model its own output projection (a copy of the embedding, so
    the logits are unchanged), which pipeline parallel needs; the two then train apart."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_output(out, [hf_dir], overwrite, "import")
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

        run = load_config(run_config)
        if run.train.init_from:
            folders.append(Path(run.train.init_from).expanduser())
        tok = Path(run.data.tokenizer).expanduser() if run.data.tokenizer else None
        tokenizer = tok if tok is not None and tok.exists() else None
    if (ckpt / "tokenizer.json").is_file():
        tokenizer = ckpt
    return folders, tokenizer


def export_hf(ckpt: Path, out: Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
              arch: str | None = None, tokenizer: Path | None = None,
              overwrite: bool = False) -> tuple[ModelConfig, str, list[str]]:
    """Returns the model shape, the family written and the tokenizer files copied. The
    source model's bos/eos/pad token ids (from an import, directly or through the run's
    ``train.init_from``) are written into ``config.json``. Written into a temporary sibling
    folder and renamed into place: a failed export leaves nothing behind."""
    ckpt, out = Path(ckpt), Path(out)
    if tokenizer is not None and not tokenizer.exists():
        raise ConfigError(f"convert export: --tokenizer {tokenizer} does not exist")
    folders, found_tokenizer = _origins(ckpt)
    sources = [ckpt, *folders] + ([tokenizer] if tokenizer is not None else []) + \
        ([found_tokenizer] if found_tokenizer is not None else [])
    try:  # an import remembers the Hugging Face folder it came from: never written into either
        origin = json.loads((ckpt / "meshfold.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        origin = None
    if isinstance(origin, str) and origin:
        sources.append(Path(origin))
    check_output(out, sources, overwrite, "export")
    state, m = read_checkpoint_model(ckpt)
    family = hf_family(m, arch)  # refuse before writing anything
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    hf_state = to_hf(state, m)
    final, out = out, out.parent / f".tmp-{out.name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        _write_export(hf_state, m, next(iter(state.values())).dtype, family, folders, out, max_shard_bytes)
        source = tokenizer if tokenizer is not None else found_tokenizer
        copied = copy_tokenizer(source, out) if source is not None else []
        (out / WRITTEN_BY).write_text(f"written by meshfold convert export from {ckpt}\n")
        publish(out, final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return m, family, copied


def _write_export(hf_state, m, dt, family, folders, out: Path, max_shard_bytes: int) -> None:
    write_safetensors(hf_state, out, max_shard_bytes)
    config = hf_config_from_model(m, dt, family)
    for folder in folders:
        if (folder / SOURCE_CONFIG).is_file():
            source = json.loads((folder / SOURCE_CONFIG).read_text())
            config.update({k: source[k] for k in TOKEN_IDS if source.get(k) is not None})
            break
    (out / "config.json").write_text(json.dumps(config, indent=1))


def _expected_shapes(m: ModelConfig) -> dict[str, tuple]:

    with torch.device("meta"):  # parameters and persistent buffers (MoE balancing biases)
        return {name: tuple(t.shape) for name, t in Transformer(m).state_dict().items()}


def load_model(ckpt: Path, dtype: torch.dtype | None = None):
    """A parallelism-free ``Transformer`` with the weights of a meshfold checkpoint."""

    state, m = read_checkpoint_model(Path(ckpt))
    model = Transformer(m)
    if dtype is not None:
        model.to(dtype)
    model.load_state_dict({k: v.to(dtype) if dtype else v for k, v in state.items()})
    return model


# --------------------------------------------------------------------------- check

CHECK_TOLERANCE = 1e-4


def _transformers_model(transformers, hf_dir: Path, **kwargs):
    """transformers' model of a folder: by its auto class, or for a ``model_type`` transformers
    does not know (Kimi K2's ``kimi_k2``, DeepSeek-V3's architecture) by the architecture class
    the family's adapter names, its config read as that class's own type (transformers picks
    its weight-name conversions by ``model_type``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type", "llama")
    if model_type in CONFIG_MAPPING:
        return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    cls = getattr(transformers, ARCHITECTURES[model_type])
    config = cls.config_class.from_pretrained(hf_dir)
    config.model_type = cls.config_class.model_type
    return cls.from_pretrained(hf_dir, config=config, **kwargs)


def check_hf(hf_dir: Path, batch: int = 2, seq: int = 64, seed: int = 0) -> dict:
    """Largest absolute logit difference between ``transformers`` and meshfold's import of
    ``hf_dir`` on the same random tokens, both in float32."""

    try:
        import transformers
    except ImportError:
        raise ConfigError("convert check needs transformers: pip install transformers") from None
    hf_dir = Path(hf_dir)
    state, m = read_hf(hf_dir)
    with torch.device("meta"):  # no random init of billions of weights about to be replaced
        ours = Transformer(m)
    ours.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
    for name, table in rope_buffers(m).items():  # non-persistent buffers: not in the state dict
        setattr(ours, name, table)
    ours.eval()
    del state
    fp32 = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    hf = json.loads((hf_dir / "config.json").read_text())
    extra = adapter_of_type(hf.get("model_type", "llama")).transformers_kwargs(hf)  # (MXFP4: dequantised)
    theirs = _transformers_model(transformers, hf_dir, **fp32, **extra).eval()
    seq = min(seq, m.seq_len)
    tokens = torch.randint(0, m.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    return {"max_abs_diff": diff, "tolerance": CHECK_TOLERANCE, "ok": diff <= CHECK_TOLERANCE,
            "model_type": json.loads((hf_dir / "config.json").read_text()).get("model_type", "llama"), "tokens": [batch, seq], "dtype": "float32"}


# --------------------------------------------------------------------------- CLI

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run(args) -> int:
    if getattr(args, "arch", None) and args.arch not in FAMILIES:
        print(f"meshfold: error: convert export: --arch {args.arch!r} is not a family meshfold writes"
              f"{did_you_mean(args.arch, FAMILIES)}; one of {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    try:
        if args.direction == "import":
            m = import_hf(Path(args.hf_dir), Path(args.out), args.untie, args.overwrite)
            tok = Path(args.out) / "tokenizer.json"
            print(f"meshfold: imported {args.hf_dir} ({m.n_layers} layers, dim {m.dim}) into {args.out}; "
                  f"train from it with train.init_from = {args.out!r} and its [model] (see {args.out}/config.toml)"
                  + ("" if tok.exists() else "; no tokenizer.json in the source: set data.tokenizer yourself"))
        elif args.direction == "export":
            m, family, copied = export_hf(Path(args.checkpoint), Path(args.out), DTYPES.get(args.dtype),
                                          int(args.max_shard_gb * 2**30), args.arch,
                                          Path(args.tokenizer) if args.tokenizer else None, args.overwrite)
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
    except OSError as err:  # a full disk, a read-only folder: one line naming the path
        print(f"meshfold: error: convert {args.direction}: {describe_os_error(err)}", file=sys.stderr)
        return 1
    return 0
