"""The model-family registry: what each family adds to the shared decoder, looked up by key.

A family (``models/<family>/``) is one ``Family`` record registered in ``models/families.py``:
its ``[model]`` key sections (dataclasses composed into ``ModelConfig``) and their checks, its
presets, its Hugging Face adapter (``model_type`` -> adapter), the attention kinds and extra
output heads it provides, and the norm variants it adds. Shared code (``ModelConfig``, the
``Transformer``, the counts, ``convert``) asks this module and never names a family.

Torch-free: the planner imports it. The torch modules of a family (its blocks) are named by
``"module:attribute"`` strings and loaded on first use (``load``), by the model builder.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from meshfold.models.config import ModelConfig


@dataclass(frozen=True)
class AttentionKind:
    """One attention block (``ModelConfig.attention`` names it; tp/cp plans and planner terms
    are keyed by the name). ``selects``: whether a config asks for this kind (the default kind,
    ``selects=None``, serves every config no other kind selects). ``build``: ``"module:fn"``,
    ``fn(cfg, layer_id, parts) -> nn.Module`` with ``parts`` the shared pieces
    (``BlockParts``: norm, core attention, rotary). ``params``: parameters of one block;
    ``widths``: a head's (q/k, v) widths; ``rope_dim``: features RoPE turns per head;
    ``check``: the kind's own ``[model]`` checks (raise ``ConfigError``)."""

    name: str
    build: str
    params: Callable[[ModelConfig], int]
    widths: Callable[[ModelConfig], tuple[int, int]]
    rope_dim: Callable[[ModelConfig], int]
    selects: Callable[[ModelConfig], bool] | None = None
    check: Callable[[ModelConfig], None] = lambda m: None


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's attention differs from the model-wide default (a family's
    ``layer_attention`` hook says, per layer index). ``window`` > 0: each query sees only its
    ``window`` latest keys, itself included (sliding-window attention; 0 = the whole causal
    context); ``rope``: the ``[model]`` RoPE keys this layer uses instead of the model's, as
    (key, value) pairs (its own base, its own scaling); ``scale``: the softmax scale (0 =
    1/sqrt(the q/k head width)); ``sinks``: a learned logit per query head joins the softmax's
    denominator (attention sinks: ``Attention.sinks``, gpt-oss); ``chunk`` > 0: chunked
    (block-local) attention, each query sees the earlier keys of its chunk of ``chunk``
    positions; ``nope``: no RoPE on this layer; ``l2_qk_norm``: q and k divided by their RMS
    over each head (no weight); ``temperature`` = (floor, strength): queries times 1 + strength
    * log(1 + floor((position + 1) / floor)) (Llama 4's attention temperature tuning; () = none)."""

    window: int = 0
    rope: tuple[tuple[str, Any], ...] = ()
    scale: float = 0.0
    sinks: bool = False
    chunk: int = 0
    nope: bool = False
    l2_qk_norm: bool = False
    temperature: tuple[float, float] = ()


PLAIN_LAYER = LayerAttention()


@dataclass(frozen=True)
class Head:
    """Extra output heads after the last layer (multi-token prediction), a submodule of the
    ``Transformer`` named ``name`` (None when ``active`` is false). ``build``: ``"module:fn"``,
    ``fn(cfg, make_norm, make_block) -> nn.Module`` with a ``predict(model, h, logits, ids,
    rope, positions, doc_ids)`` method returning what the model returns. ``params(cfg,
    active)``: its parameters; ``training_flops(cfg, seq_len, causal)``: forward FLOPs per token it
    adds in training (``causal``: attention counted half, as ``flops_per_token``)."""

    name: str
    active: Callable[[ModelConfig], bool]
    build: str
    params: Callable[[ModelConfig, bool], int]
    training_flops: Callable[[ModelConfig, int, bool], float]


@dataclass(frozen=True)
class Family:
    """Everything a family adds. ``sections``: dataclasses of its own ``[model]`` keys (flat
    TOML keys, ``model.<key>``), composed into ``ModelConfig``; ``checks``: functions raising
    ``ConfigError`` for those keys; ``presets``: name -> ``[model]`` values; ``hf``: its Hugging
    Face adapter (``models/hf_adapter.py``'s protocol) or None; ``attention`` / ``heads``: the
    blocks it provides; ``norms``: norm name (``model.norm``) -> ``"module:Class"``
    (``Class(dim, eps)``); ``embedding_scale``: a factor on the token embeddings (1 = none);
    ``layer_attention(cfg, layer)``: a ``LayerAttention`` for the layers of its configs (None
    for configs not its own); ``post_norms(cfg)``: whether blocks also normalise the attention
    and feed-forward outputs before the residual add (four norms per block); ``mlps``: gated
    activation name (``model.mlp``) -> ``"module:fn"``, ``fn(cfg) -> glu(gate, up)`` (its
    routed experts' activation in place of silu(gate) * up); ``mlp_elements``: such an
    activation's eager forward, in compute-dtype elements read and written per hidden element
    (silu(gate) * up: 5; the planner's memory-bound bytes)."""

    name: str
    sections: tuple[type, ...] = ()
    checks: tuple[Callable[[ModelConfig], None], ...] = ()
    presets: Mapping[str, dict] = field(default_factory=dict)
    hf: Any = None
    attention: tuple[AttentionKind, ...] = ()
    heads: tuple[Head, ...] = ()
    norms: Mapping[str, str] = field(default_factory=dict)
    embedding_scale: Callable[[ModelConfig], float] | None = None
    layer_attention: Callable[[ModelConfig, int], LayerAttention | None] | None = None
    post_norms: Callable[[ModelConfig], bool] | None = None
    mlps: Mapping[str, str] = field(default_factory=dict)
    mlp_elements: Mapping[str, int] = field(default_factory=dict)


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (``models/families.py`` calls this once per family)."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    clash = set(family.presets) & set(presets())
    if clash:
        raise ValueError(f"model family {family.name!r} ships presets already shipped: {sorted(clash)}")
    _FAMILIES[family.name] = family
    return family


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def sections() -> tuple[type, ...]:
    return tuple(s for f in _FAMILIES.values() for s in f.sections)


def checks() -> tuple[Callable, ...]:
    return tuple(c for f in _FAMILIES.values() for c in f.checks)


def presets() -> dict[str, dict]:
    return {name: values for f in _FAMILIES.values() for name, values in f.presets.items()}


def attention_kinds() -> tuple[AttentionKind, ...]:
    return tuple(k for f in _FAMILIES.values() for k in f.attention)


def attention_of(cfg: ModelConfig) -> AttentionKind:
    """The attention kind a config asks for: the one whose ``selects`` holds, else the default."""
    kinds = attention_kinds()
    chosen = [k for k in kinds if k.selects is not None and k.selects(cfg)]
    if len(chosen) > 1:
        raise ValueError(f"attention kinds {[k.name for k in chosen]} all claim the config")
    return chosen[0] if chosen else next(k for k in kinds if k.selects is None)


def attention(name: str) -> AttentionKind:
    return next(k for k in attention_kinds() if k.name == name)


def heads() -> tuple[Head, ...]:
    return tuple(h for f in _FAMILIES.values() for h in f.heads)


def norms() -> dict[str, str]:
    return {name: path for f in _FAMILIES.values() for name, path in f.norms.items()}


def mlps() -> dict[str, str]:
    return {name: path for f in _FAMILIES.values() for name, path in f.mlps.items()}


def mlp_elements(name: str) -> int | None:
    """A registered gated activation's eager elements per hidden element (None: not registered)."""
    return next((f.mlp_elements[name] for f in _FAMILIES.values() if name in f.mlp_elements), None)


def embedding_scale(cfg: ModelConfig) -> float:
    scale = 1.0
    for f in _FAMILIES.values():
        if f.embedding_scale is not None:
            scale *= f.embedding_scale(cfg)
    return scale


def layer_attention(cfg: ModelConfig, layer: int) -> LayerAttention:
    """Layer ``layer``'s attention (window, RoPE, softmax scale): the first family's that
    claims the config, else the plain causal one."""
    for f in _FAMILIES.values():
        if f.layer_attention is not None:
            spec = f.layer_attention(cfg, layer)
            if spec is not None:
                return spec
    return PLAIN_LAYER


def post_norms(cfg: ModelConfig) -> bool:
    return any(f.post_norms(cfg) for f in _FAMILIES.values() if f.post_norms is not None)


def hf_adapters() -> tuple[Any, ...]:
    return tuple(f.hf for f in _FAMILIES.values() if f.hf is not None)


def hf_model_types() -> dict[str, str]:
    """Every Hugging Face ``model_type`` a family reads and writes -> its architecture name."""
    return {t: arch for a in hf_adapters() for t, arch in a.architectures.items()}


def hf_adapter(model_type: str) -> Any | None:
    return next((a for a in hf_adapters() if model_type in a.architectures), None)


def load(path: str) -> Any:
    """``"package.module:attribute"`` -> the attribute (imports the module on first use)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
