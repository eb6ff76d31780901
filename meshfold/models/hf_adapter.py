"""The Hugging Face adapter protocol a family implements (``Family.hf``), with the defaults
of the plain Llama-style decoder, and the helpers adapters share. Torch-free.

``models/hf.py`` drives import, export and check; it asks the adapter of a ``model_type``
(import) or the one whose ``natural_type`` claims a ``ModelConfig`` (export) for what differs:
the family's ``[model]`` keys and refusals, its ``config.json`` entries, extra tensor names,
which tensors carry RoPE's pair layout, and tensors outside the decoder layers (MTP).
"""

from __future__ import annotations

from meshfold.errors import ConfigError

ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "dynamic": "dynamic", "yarn": "yarn"}


def rope_parameters(hf: dict) -> dict:
    """One flat RoPE dict from either format: transformers 4's ``rope_theta`` + ``rope_scaling``
    or transformers 5's ``rope_parameters`` (which holds the theta too)."""
    params = dict(hf.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"convert: per-layer-type RoPE parameters {sorted(params)} are not supported")
    params.update(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return params


def refuse_sliding_window(hf: dict, switched: bool = False) -> None:
    """Refuse a model attending through a sliding window (``switched``: the window applies only
    with ``use_sliding_window``, as in Qwen's configs)."""
    why = None
    if "sliding_attention" in (hf.get("layer_types") or ()):
        why = "layer_types has sliding_attention layers"
    elif switched:
        why = "use_sliding_window = true" if hf.get("use_sliding_window") else None
    else:
        window, longest = hf.get("sliding_window"), hf.get("max_position_embeddings", 0)
        why = f"sliding_window = {window}" if window and window < longest else None
    if why:
        raise ConfigError(f"convert: {why}: sliding-window attention is not supported (meshfold attends "
                          f"to the whole causal context)")


def check_keys(m, need: dict, architecture: str, hint: str = "") -> None:
    """ConfigError for the first ``[model]`` key whose value differs from what ``architecture`` has."""
    for key, value in need.items():
        if getattr(m, key) != value:
            raise ConfigError(f"convert export: model.{key} = {getattr(m, key)} has no equivalent in "
                              f"{architecture}{hint}")


class HFAdapter:
    """Defaults: a Llama-style decoder with grouped-query attention whose q/k rows Hugging Face
    keeps in RoPE's half-split layout. A family overrides what differs."""

    architectures: dict[str, str] = {}  # model_type -> architectures[0] (read and written)
    norm, mlp = "rmsnorm", "swiglu"  # the [model] norm and mlp of the family's Hugging Face models
    layer_names: dict[str, str] = {}  # per-layer meshfold name -> HF name, beyond models/hf.py's LAYER_NAMES
    partial_rope = False  # its HF models may turn only a head's leading features (partial_rotary_factor)

    def natural_type(self, m) -> str | None:
        """The ``model_type`` a model exports as when it is this family's, else None."""
        raise NotImplementedError

    def config_keys(self, hf: dict, model_type: str) -> dict:
        """The family's ``[model]`` keys of a ``config.json`` (beyond the shape every decoder
        has), or ConfigError (one line) for what meshfold cannot represent exactly."""
        return {}

    def rope_parameters(self, hf: dict) -> dict:
        """The model-wide RoPE keys of a ``config.json``, one flat dict (``rope_type``,
        ``rope_theta``, ``factor``, ...); a family with per-layer-type RoPE picks its default."""
        return rope_parameters(hf)

    def export_type(self, m, arch: str | None) -> str:
        """The ``model_type`` to write (``arch`` forces one), or ConfigError naming the key
        that type lacks."""
        raise NotImplementedError

    def write_config(self, m, model_type: str, out: dict) -> None:
        """Add the family's entries to the ``config.json`` dict ``out``."""

    def rotated_heads(self, mine: str, m) -> int | None:
        """How many heads a tensor's rows (or, for the per-head q/k norms, its one head) hold
        when RoPE's pair layout applies to it, or None when it does not."""
        if mine.startswith("attention.wq."):
            return m.n_heads
        if mine.startswith("attention.wk."):
            return m.kv_heads
        if mine.startswith(("attention.q_norm.", "attention.k_norm.")):
            return 1  # a weight over one head's features, applied before RoPE
        return None

    def hf_layer_name(self, hf_name: str, m) -> str:
        """The written name of a per-layer tensor (hub layout) given its ``mlp.`` name."""
        return hf_name

    def expert_name(self, j: int, kind: str, m) -> str:
        """Expert j's ``kind`` (gate_proj / up_proj / down_proj) weight, after ``model.layers.{i}.``."""
        return f"mlp.experts.{j}.{kind}.weight"

    def split_name(self, name: str, m) -> tuple[int, str]:
        """A meshfold per-layer tensor name -> (HF decoder layer, name inside the layer)."""
        _, layer, rest = name.split(".", 2)
        return int(layer), rest

    def own_to_hf(self, name: str, value, m) -> dict | None:
        """HF tensors for a meshfold tensor outside the shared maps, or None (not the family's)."""
        return None

    def extra_to_hf(self, state: dict, m) -> dict:
        """Tensors HF keeps beyond meshfold's (copies of shared ones)."""
        return {}

    def own_from_hf(self, name: str, layer: int, rest: str, value, state: dict, m) -> dict | None:
        """meshfold tensors for a HF per-layer tensor outside the shared maps ({} = skip it),
        or None (not the family's)."""
        return None

    def import_tensors(self, state: dict, m) -> dict:
        """The checkpoint's tensors before the shared name maps read them: a family whose files
        store a tensor in another layout or encoding (gpt-oss: MXFP4 experts, interleaved
        gate/up) turns it into one ``own_from_hf`` takes."""
        return state

    def transformers_kwargs(self, hf: dict) -> dict:
        """What ``convert check`` passes to transformers' ``from_pretrained`` for this folder's
        ``config.json`` (gpt-oss: MXFP4 experts dequantised, as on a machine without its kernels)."""
        return {}

    def block_prefix(self, layer: int, m) -> str:
        """meshfold's prefix of HF decoder layer ``layer``."""
        return f"layers.{layer}."

    def complete(self, m, names) -> object:
        """The model config once the weight names are known (keys the config.json leaves out)."""
        return m
