"""Typed configuration: TOML files, ``--set section.key=value`` overrides, and validation.

Every check here runs before any process group starts, so a bad layout costs the user one
line, not a hang across N ranks. ``ConfigError`` messages are single lines naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem, phrased as one line that names the key to change."""


@dataclass
class ModelConfig:
    preset: str = ""
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = same as n_heads (plain multi-head attention)
    ffn_dim: int = 0  # 0 = Llama's rule from dim
    vocab_size: int = 512
    seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    # Architecture switches so published non-Llama shapes (GPT-3) have exact counts.
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    mlp: str = "swiglu"  # swiglu | gelu
    bias: bool = False
    pos: str = "rope"  # rope | learned
    # Hugging Face families (Llama 3.x, Qwen 2/2.5/3, Mistral): docs/hf.md.
    max_position: int = 0  # the context the model is published for (HF max_position_embeddings); 0 = seq_len
    attn_head_dim: int = 0  # per-head width; 0 = dim / n_heads (Qwen3 sets it explicitly)
    qkv_bias: bool = False  # biases on the q/k/v projections only (Qwen2/2.5); `bias` puts them everywhere
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    rope_scaling: str = "none"  # none | linear | llama3 | dynamic | yarn
    rope_factor: float = 1.0
    rope_original_seq_len: int = 0  # the pre-training context the scaling stretches (original_max_position_embeddings)
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float = 0.0  # yarn: cos/sin scale; 0 = 0.1 ln(factor) + 1
    # Mixture of experts (0 experts = dense).
    moe_experts: int = 0
    moe_topk: int = 2
    moe_every: int = 1  # every k-th layer is MoE (1 = all)
    moe_ffn_dim: int = 0  # per-expert hidden size, 0 = ffn_dim
    moe_shared_experts: int = 0
    moe_router: str = "softmax"  # softmax | sigmoid
    moe_capacity_factor: float = 0.0  # 0 = dropless
    moe_aux_loss_coef: float = 0.01
    moe_z_loss_coef: float = 0.0
    moe_bias_balance: bool = False  # aux-loss-free balancing via router bias
    moe_bias_update_rate: float = 1e-3
    moe_norm_topk: bool = True  # softmax router: renormalise the k gates to sum 1 (Mixtral); sigmoid always does
    moe_first_dense: int = 0  # leading dense layers before the first MoE layer (DeepSeek-MoE: 1)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.mlp == "gelu":
            return 4 * self.dim
        # Llama: 2/3 * 4d rounded up to a multiple of 256 (or 8 for tiny models).
        multiple = 256 if self.dim >= 1024 else 8
        hidden = int(2 * 4 * self.dim / 3)
        return multiple * math.ceil(hidden / multiple)

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_dim or self.hidden_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_experts > 0 and layer >= self.moe_first_dense and (layer + 1) % self.moe_every == 0


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1 = whatever the world size leaves after the other degrees
    zero: int = 3
    tp: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zbv
    pp_microbatches: int = 0  # 0 = pp (or the local micro-batch count)
    pp_virtual_stages: int = 1
    pp_split: list = field(default_factory=list)  # layers per stage, overrides the balancer
    cp: int = 1
    cp_mode: str = "ring"  # ring | ulysses | hybrid
    cp_ulysses: int = 0  # hybrid: Ulysses degree inside a ring group (0 = largest that fits)
    cp_balance: bool = True  # causal load-balanced chunking for ring attention
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    def resolved(self, world_size: int) -> "ParallelConfig":
        """Fill ``dp_shard = -1`` from the world size."""
        if self.dp_shard != -1:
            return self
        rest = self.dp_replicate * self.tp * self.pp * self.cp
        if rest <= 0 or world_size % rest:
            raise ConfigError(
                f"parallel: dp_replicate*tp*pp*cp = {rest} does not divide the world size "
                f"{world_size}; change parallel.tp/pp/cp/dp_replicate or the process count"
            )
        return dataclasses.replace(self, dp_shard=world_size // rest)


@dataclass
class TrainConfig:
    steps: int = 20
    seed: int = 0
    global_batch: int = 8  # sequences per optimizer step, whatever the layout
    micro_batch: int = 0  # sequences per forward on one data-parallel rank; 0 = no accumulation
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = -1  # -1 = 10% of steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    run_dir: str = "runs/debug"
    dtype: str = "auto"  # auto | float32 | float64 | bfloat16 (autocast, fp32 master weights)
    device: str = "auto"  # auto | cpu | cuda
    recompute: str = "none"  # none | selective | full
    recompute_every: int = 1  # full recompute on every k-th block
    compile: bool = False
    fused_optimizer: str = "auto"  # auto | fused | foreach | none
    offload: str = "none"  # none | optimizer (Adam state on host) | params (FSDP2 CPU offload)
    reduce_dtype: str = "float32"  # gradient reduction dtype under bf16 FSDP: float32 | bfloat16
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    async_checkpoint: bool = False
    resume: str = "auto"  # auto | never
    init_from: str = ""  # a checkpoint dir (e.g. converted from Hugging Face) to start from
    log_every: int = 1
    progress: bool = True
    tensorboard: bool = True
    nan_guard_rollback: int = 3  # roll back after this many non-finite steps in a row
    straggler_every: int = 10  # gather per-rank timings every k steps (0 = off)
    straggler_margin: float = 0.2
    collective_timeout_s: float = 600.0
    eval_every: int = 0
    eval_batches: int = 4


@dataclass
class DataConfig:
    source: str = "default"  # default | a prepared dataset (meshfold prepare) | file/folder/.jsonl/.parquet/HF dataset dir
    mix_sources: list = field(default_factory=list)  # prepared datasets mixed by mix_weights (overrides source)
    mix_weights: list = field(default_factory=list)  # one positive weight per mix_sources entry
    prefetch: int = 2  # batches prepared ahead in a background thread (0 = in the step)
    tokenizer: str = ""  # "" = train a byte-level BPE on the corpus and cache it
    pack: bool = True
    doc_mask: bool = True  # with pack: attention never crosses a document boundary
    skip_masked_blocks: bool = False  # cp = 1: tiled attention skipping fully masked blocks (cp > 1 always does)
    balance: str = "none"  # none | greedy | exact
    text_field: str = "text"
    cache_dir: str = ""  # "" = ~/.cache/meshfold
    max_docs: int = 0  # 0 = all documents
    val_docs: int = 16  # held-out documents for validation loss
    # Variable-length balancing (data.balance != none; docs/balancing.md).
    max_tokens: int = 0  # tokens one rank holds in one micro-batch (memory limit); 0 = 2*micro_batch*seq_len
    cost_a: float = 0.0  # W(l) = cost_a*l^2 + cost_b*l per document; both 0 = measure at start (cached)
    cost_b: float = 0.0
    balance_tolerance: float = 1.02  # exact: run the MILP when the greedy imbalance is above this
    balance_time_limit_s: float = 1.0  # exact: MILP time limit per step
    seq_cp_max: int = 1  # per-sequence context parallel: spread long/costly documents over up to this many dp ranks


@dataclass
class LowCommConfig:
    method: str = "none"  # none | diloco | streaming | noloco | co2
    workers: int = 1
    inner_steps: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: str = "none"  # none | powersgd | topk | onebit | lgreco
    # Method parameters (documented in docs/lowcomm.md).
    fragments: int = 4
    overlap_steps: int = 1
    quant_bits: int = 4
    quant_coding: str = "fixed"  # streaming 4-bit: fixed | deflate (lossless zlib of the codes, variable length)
    mixing: float = 0.5
    noloco_gamma: float = 0.5
    co2_staleness_penalty: float = 0.5
    co2_clip: float = 1.0
    powersgd_rank: int = 4
    topk_ratio: float = 0.01
    dgc_warmup_steps: int = 0
    onebit_warmup_steps: int = 10
    lgreco_error_budget: float = 0.1
    lgreco_every: int = 50  # steps between L-GreCo's re-selection of per-layer ranks
    dgc_momentum: float = 0.0  # top-k: DGC momentum correction factor (0 = plain error feedback)
    onebit_adam: bool = False  # with compression = onebit: 1-bit Adam (warm-up, then frozen variance)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "lowcomm": LowCommConfig,
}

CHOICES: dict[tuple[str, str], tuple] = {
    ("model", "norm"): ("rmsnorm", "layernorm"),
    ("model", "mlp"): ("swiglu", "gelu"),
    ("model", "pos"): ("rope", "learned"),
    ("model", "moe_router"): ("softmax", "sigmoid"),
    ("model", "rope_scaling"): ("none", "linear", "llama3", "dynamic", "yarn"),
    ("parallel", "pp_schedule"): ("gpipe", "1f1b", "interleaved", "zbv"),
    ("parallel", "cp_mode"): ("ring", "ulysses", "hybrid"),
    ("train", "dtype"): ("auto", "float32", "float64", "bfloat16"),
    ("train", "device"): ("auto", "cpu", "cuda"),
    ("train", "recompute"): ("none", "selective", "full"),
    ("train", "resume"): ("auto", "never"),
    ("train", "fused_optimizer"): ("auto", "fused", "foreach", "none"),
    ("train", "offload"): ("none", "optimizer", "params"),
    ("train", "reduce_dtype"): ("float32", "bfloat16"),
    ("data", "balance"): ("none", "greedy", "exact"),
    ("lowcomm", "method"): ("none", "diloco", "streaming", "noloco", "co2"),
    ("lowcomm", "compression"): ("none", "powersgd", "topk", "onebit", "lgreco"),
    ("lowcomm", "quant_coding"): ("fixed", "deflate"),
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lowcomm: LowCommConfig = field(default_factory=LowCommConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


# --------------------------------------------------------------------------- loading


def _coerce(section: str, key: str, value: Any, target: Any) -> Any:
    """Check a TOML value against the dataclass field's type (ints widen to floats)."""
    want = type(target)
    if isinstance(target, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(target, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(target, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(target, str):
        if isinstance(value, str):
            return value
    elif isinstance(target, list):
        if isinstance(value, list):
            return value
    else:  # pragma: no cover - every field has one of the types above
        return value
    raise ConfigError(
        f"{section}.{key} = {value!r} has the wrong type; expected {want.__name__}"
    )


def _apply_section(obj: Any, section: str, values: dict[str, Any]) -> None:
    names = {f.name for f in fields(obj)}
    for key, value in values.items():
        if key not in names:
            close = _closest(key, names)
            hint = f" (did you mean {section}.{close}?)" if close else ""
            raise ConfigError(f"unknown key {section}.{key}{hint}")
        setattr(obj, key, _coerce(section, key, value, getattr(obj, key)))


def _closest(key: str, names: set[str]) -> str | None:
    import difflib

    found = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
    return found[0] if found else None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` with ``value`` read as a TOML value, else as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.steps=10")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    preset_name = data.get("model", {}).get("preset", "")
    if preset_name:
        from meshfold.models.presets import preset_values

        cfg.model = ModelConfig(**preset_values(preset_name))
    for section, values in data.items():
        if section not in SECTIONS:
            close = _closest(section, set(SECTIONS))
            hint = f" (did you mean [{close}]?)" if close else ""
            raise ConfigError(f"unknown section [{section}]{hint}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of keys")
        _apply_section(getattr(cfg, section), section, values)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
    return from_dict(data)


def dump_toml(cfg: Config) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.to_dict())


# --------------------------------------------------------------------------- validation


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check the whole config (and, given a world size, the layout). Returns ``cfg`` with
    ``parallel.dp_shard`` resolved. Raises ``ConfigError`` with one line."""
    for (section, key), allowed in CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key} = {value!r}; choose one of {', '.join(allowed)}")

    m, p, t = cfg.model, cfg.parallel, cfg.train
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "seq_len"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key} must be positive, got {getattr(m, key)}")
    if m.max_position < 0:
        raise ConfigError(f"model.max_position must be >= 0 (0 = seq_len), got {m.max_position}")
    if m.attn_head_dim < 0:
        raise ConfigError(f"model.attn_head_dim must be >= 0 (0 = dim / n_heads), got {m.attn_head_dim}")
    if m.dim % m.n_heads and not m.attn_head_dim:
        fits = [h for h in _divisors(m.dim) if h <= 4 * m.n_heads][-3:]
        raise ConfigError(
            f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}; "
            f"n_heads could be one of {fits}"
        )
    if m.n_heads % m.kv_heads:
        raise ConfigError(
            f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.n_kv_heads}; "
            f"n_kv_heads could be one of {_divisors(m.n_heads)}"
        )
    if m.pos == "rope" and m.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head dim; model.dim/model.n_heads = {m.head_dim}")
    if m.rope_scaling != "none":
        if m.pos != "rope":
            raise ConfigError(f"model.rope_scaling = {m.rope_scaling!r} needs model.pos = 'rope'")
        if m.rope_factor < 1.0:
            raise ConfigError(f"model.rope_factor = {m.rope_factor} must be >= 1 with model.rope_scaling")
        if m.rope_scaling in ("llama3", "dynamic", "yarn") and m.rope_original_seq_len <= 0:
            raise ConfigError(f"model.rope_scaling = {m.rope_scaling!r} needs model.rope_original_seq_len "
                              f"(the pre-training context, e.g. 8192 for Llama 3.1)")
        if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor = {m.rope_low_freq_factor}")
    if m.moe_experts:
        if not 1 <= m.moe_topk <= m.moe_experts:
            raise ConfigError(
                f"model.moe_topk = {m.moe_topk} must be between 1 and model.moe_experts = {m.moe_experts}"
            )
        if m.moe_every < 1:
            raise ConfigError(f"model.moe_every must be >= 1, got {m.moe_every}")
        if m.moe_first_dense < 0 or m.moe_first_dense >= m.n_layers:
            raise ConfigError(f"model.moe_first_dense = {m.moe_first_dense} must be between 0 and "
                              f"model.n_layers - 1 = {m.n_layers - 1}")
        if m.moe_capacity_factor < 0:
            raise ConfigError(f"model.moe_capacity_factor must be >= 0 (0 = dropless), got {m.moe_capacity_factor}")
        if m.moe_capacity_factor > 0 and p.cp > 1:
            raise ConfigError("model.moe_capacity_factor > 0 (per-sequence capacity) needs whole sequences on a "
                              "rank; use parallel.cp = 1 or moe_capacity_factor = 0 (dropless)")

    for key in ("dp_replicate", "tp", "pp", "cp", "ep", "pp_virtual_stages"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallel.dp_shard must be >= 1 or -1 (fill from world size), got {p.dp_shard}")
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero = {p.zero}; choose 0, 1, 2 or 3")

    # Tensor parallel: heads split across tp ranks.
    if p.tp > 1:
        if p.tp > m.n_heads:
            raise ConfigError(
                f"parallel.tp = {p.tp} is larger than model.n_heads = {m.n_heads}; "
                f"tp could be one of {_divisors(m.n_heads)}"
            )
        if m.n_heads % p.tp:
            raise ConfigError(
                f"model.n_heads = {m.n_heads} is not divisible by parallel.tp = {p.tp}; "
                f"tp could be one of {_divisors(m.n_heads)}"
            )
        if m.kv_heads % p.tp and p.tp % m.kv_heads:
            raise ConfigError(
                f"model.n_kv_heads = {m.kv_heads} and parallel.tp = {p.tp}: one must divide the other "
                f"(kv heads are split when tp divides them, replicated when they divide tp)"
            )
        if p.sp and m.seq_len % (p.tp * p.cp):
            raise ConfigError(
                f"parallel.sp needs model.seq_len = {m.seq_len} divisible by parallel.tp*cp = {p.tp * p.cp} "
                f"(each rank keeps a 1/tp slice of its sequence); change model.seq_len or set parallel.sp = false"
            )
        if p.sp and m.moe_experts:
            raise ConfigError("parallel.sp with MoE blocks (model.moe_experts > 0) is not supported; "
                              "set parallel.sp = false")
    if p.cp > 1:
        chunks = 2 * p.cp if (p.cp_mode != "ulysses" and p.cp_balance) else p.cp
        if m.seq_len % chunks:
            raise ConfigError(
                f"model.seq_len = {m.seq_len} is not divisible by {chunks} "
                f"(parallel.cp = {p.cp}, cp_mode = {p.cp_mode}); choose a seq_len that is a multiple of {chunks}"
            )
        if p.cp_mode in ("ulysses",) and m.n_heads % (p.cp * p.tp):
            raise ConfigError(
                f"parallel.cp_mode = ulysses needs model.n_heads = {m.n_heads} divisible by cp*tp = {p.cp * p.tp}"
            )
    from meshfold.parallel.context import check_config  # Ulysses/hybrid head split, cp_ulysses

    check_config(cfg)
    # Pipeline stages: pp x chunks per rank (interleaved: pp_virtual_stages; zbv: 2, a V).
    pp_stages = p.pp * {"interleaved": p.pp_virtual_stages, "zbv": 2}.get(p.pp_schedule, 1)
    if p.pp > 1 and p.pp_schedule == "interleaved" and p.pp_virtual_stages < 2:
        raise ConfigError("parallel.pp_schedule = interleaved needs parallel.pp_virtual_stages >= 2 "
                          "(with 1 it is 1f1b)")
    if p.pp > 1 and m.tie_embeddings:
        raise ConfigError("model.tie_embeddings puts one weight on the first and last pipeline stage; "
                          "set it to false (meshfold convert import --untie for a Hugging Face model) "
                          "or parallel.pp = 1")
    if p.pp > 1 and pp_stages > m.n_layers:
        raise ConfigError(
            f"parallel.pp = {p.pp} with pp_schedule = {p.pp_schedule} needs {pp_stages} stages, more than "
            f"model.n_layers = {m.n_layers}; use fewer stages or more layers"
        )
    if p.pp_split:
        if (len(p.pp_split) != pp_stages or sum(p.pp_split) != m.n_layers
                or any(not isinstance(n, int) or n < 1 for n in p.pp_split)):
            raise ConfigError(
                f"parallel.pp_split = {p.pp_split} must list {pp_stages} layer counts (each >= 1) "
                f"summing to model.n_layers = {m.n_layers}"
            )
    if m.moe_experts and p.ep > 1 and m.moe_experts % p.ep:
        raise ConfigError(
            f"model.moe_experts = {m.moe_experts} is not divisible by parallel.ep = {p.ep}; "
            f"ep could be one of {_divisors(m.moe_experts)}"
        )
    if m.moe_experts and p.ep > 1 and p.tp > 1 and m.moe_experts % (p.ep * p.tp):
        raise ConfigError(
            f"model.moe_experts = {m.moe_experts} is not divisible by parallel.ep * parallel.tp = {p.ep * p.tp} "
            "(each ep rank's experts are split again over tp); change parallel.ep, parallel.tp or model.moe_experts"
        )
    if p.ep > 1 and not m.moe_experts:
        raise ConfigError("parallel.ep > 1 needs an MoE model; set model.moe_experts or parallel.ep = 1")
    if p.ep > 1 and p.zero < 2:
        raise ConfigError(f"parallel.ep = {p.ep} shards experts with FSDP over the remaining data-parallel ranks; "
                          f"set parallel.zero to 2 or 3 (got {p.zero})")

    for key, value in (("data.source", cfg.data.source if cfg.data.source != "default" else ""),
                       ("data.tokenizer", cfg.data.tokenizer), ("train.init_from", t.init_from)):
        if value and not Path(value).expanduser().exists():
            raise ConfigError(f"{key} = {value!r} does not exist; give an existing path"
                              + (" or 'default'" if key == "data.source" else ""))
    if t.steps < 0:
        raise ConfigError(f"train.steps must be >= 0, got {t.steps}")
    if t.global_batch < 1:
        raise ConfigError(f"train.global_batch must be >= 1, got {t.global_batch}")
    d = cfg.data
    if d.mix_sources:
        if len(d.mix_weights) != len(d.mix_sources):
            raise ConfigError(f"data.mix_weights has {len(d.mix_weights)} entries but data.mix_sources has "
                              f"{len(d.mix_sources)}; give one weight per source")
        for w in d.mix_weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w > 0 and math.isfinite(w)):
                raise ConfigError(f"data.mix_weights = {d.mix_weights}: every weight must be a positive number")
        for src in d.mix_sources:
            if not (Path(str(src)).expanduser() / "manifest.json").is_file():
                raise ConfigError(f"data.mix_sources: {src!r} is not a prepared dataset; make it with "
                                  f"`meshfold prepare SOURCE --tokenizer TOK --out {src}`")
        if d.balance != "none":
            raise ConfigError("data.mix_sources works with data.balance = none only; drop one of them")
        if cfg.lowcomm.method != "none" and cfg.lowcomm.workers > 1:
            raise ConfigError("data.mix_sources does not support lowcomm.workers > 1 yet; use one worker")
    if d.prefetch < 0:
        raise ConfigError(f"data.prefetch must be >= 0, got {d.prefetch}")
    if cfg.data.balance != "none":
        from meshfold.data.balanced_loader import validate_balance

        validate_balance(cfg)

    if world_size is not None:
        lc = cfg.lowcomm
        workers = lc.workers if lc.method != "none" else 1
        if workers < 1 or world_size % workers:
            raise ConfigError(
                f"lowcomm.workers = {lc.workers} does not divide the world size {world_size}"
            )
        per_worker = world_size // workers
        p = p.resolved(per_worker)
        cfg.parallel = p
        if p.world_size() != per_worker:
            what = "the world size" if workers == 1 else f"the ranks per worker ({per_worker})"
            raise ConfigError(
                f"parallel: dp_replicate*dp_shard*tp*pp*cp = {p.dp_replicate}*{p.dp_shard}*{p.tp}*{p.pp}*{p.cp} "
                f"= {p.world_size()} but {what} is {per_worker}; change parallel.dp_shard to "
                f"{_fit_dp_shard(p, per_worker)} or the process count to {p.world_size() * workers}"
            )
        from meshfold.lowcomm import check_lowcomm  # [lowcomm] keys (docs/lowcomm.md)

        check_lowcomm(cfg)
        if p.ep > 1 and (p.dp * p.cp) % p.ep:
            raise ConfigError(
                f"parallel.ep = {p.ep} must divide dp_replicate*dp_shard*cp = {p.dp * p.cp} (ep folds onto them)"
            )
        if p.ep > 1 and (p.dp_shard * p.cp) % p.ep:
            raise ConfigError(
                f"parallel.ep = {p.ep} must divide dp_shard*cp = {p.dp_shard * p.cp} (ep folds onto the sharded "
                f"data x context ranks); change parallel.ep or parallel.dp_shard"
            )
        if p.dp_shard > 1 and p.zero == 0:
            raise ConfigError(
                f"parallel.zero = 0 replicates everything but parallel.dp_shard = {p.dp_shard}; "
                f"set parallel.zero to 1, 2 or 3, or use parallel.dp_replicate = {p.dp} with dp_shard = 1"
            )
        if p.tp > 1 and p.zero == 1 and p.dp_shard * p.cp > 1 and t.checkpoint_every:
            raise ConfigError(
                f"parallel.tp = {p.tp} with parallel.zero = 1 (the flat distributed optimizer) cannot save "
                "checkpoints yet; set train.checkpoint_every = 0, or parallel.zero to 0, 2 or 3"
            )
        if t.offload == "params" and (p.zero < 2 or p.dp_shard * p.cp == 1):
            raise ConfigError(
                "train.offload = params uses FSDP2's CPU offload: it needs parallel.zero >= 2 and "
                "parallel.dp_shard > 1; use train.offload = optimizer otherwise"
            )
        dp = p.dp
        if t.global_batch % dp:
            raise ConfigError(
                f"train.global_batch = {t.global_batch} is not divisible by the {dp} data-parallel ranks; "
                f"use a multiple of {dp}, e.g. {dp * max(1, round(t.global_batch / dp))}"
            )
        local = t.global_batch // dp
        micro = t.micro_batch or local
        if local % micro:
            raise ConfigError(
                f"train.global_batch = {t.global_batch} over {dp} data-parallel ranks gives {local} sequences "
                f"per rank, not divisible by train.micro_batch = {t.micro_batch}; micro_batch could be one of "
                f"{_divisors(local)}"
            )
        if p.pp > 1:
            n_micro = p.pp_microbatches or max(p.pp, local // micro)
            if local % n_micro:
                raise ConfigError(
                    f"parallel.pp_microbatches = {n_micro} does not divide the {local} sequences per "
                    f"data-parallel rank; choose one of {_divisors(local)}"
                )
            if p.pp_schedule == "interleaved" and n_micro % p.pp:
                raise ConfigError(
                    f"parallel.pp_microbatches = {n_micro}: pp_schedule = interleaved needs a multiple of "
                    f"parallel.pp = {p.pp} micro-batches"
                )
    return cfg


def _fit_dp_shard(p: ParallelConfig, world_size: int) -> str:
    rest = p.dp_replicate * p.tp * p.pp * p.cp
    if world_size % rest == 0:
        return str(world_size // rest)
    return "-1 after making dp_replicate*tp*pp*cp divide the world size"
