"""The composed configuration: the five sections, TOML files, ``--set section.key=value``
overrides, dumping, and ``validate``.

Each section's dataclass and its own checks live with the feature: ``[model]`` in
``models/config.py``, ``[parallel]`` in ``layout.py`` (core, the mesh builds on it) with its
checks against the model in ``parallel/config.py``, ``[data]`` in ``data/config.py``,
``[lowcomm]`` in ``lowcomm/config.py``; ``[train]`` lives here. This module composes them and
runs the checks that span sections. It sits above every feature package in the import
layers (docs/architecture.md); the features below import their section from its owner and
take the composed ``Config`` as an argument.

Every check runs before any process group starts, so a bad layout costs the user one
line, not a hang across N ranks. ``ConfigError`` (``meshfold.errors``) messages are single
lines naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w

from meshfold import layout, live_config
from meshfold.data import config as data_config
from meshfold.data.config import DataConfig
from meshfold.data.micro import micro_batch_count
from meshfold.schedules import get_schedule
from meshfold.errors import ConfigError, divisors
from meshfold.layout import ParallelConfig
from meshfold.lowcomm import config as lowcomm_config
from meshfold.lowcomm.config import LowCommConfig
from meshfold.models import config as model_config
from meshfold.models.config import ModelConfig
from meshfold.models.presets import preset_values
from meshfold.parallel import config as parallel_config
from meshfold.parallel.fp8 import config as fp8_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Config", "ConfigError", "DataConfig", "LowCommConfig", "ModelConfig", "ParallelConfig",
           "TrainConfig", "dump_toml", "from_dict", "load_config", "model_keys", "parse_override", "validate"]


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
    recompute: str = "none"  # none | selective | op | full (parallel/recompute.py)
    recompute_every: int = 1  # full recompute on every k-th block
    compile: bool = False
    fp8: str = "none"  # none | tensorwise | rowwise | rowwise_with_gw_hp | mxfp8 (parallel/fp8/, docs/fp8.md)
    fp8_all_gather: bool = False  # FSDP2 gathers weights in fp8 (tensorwise only)
    fused_optimizer: str = "auto"  # auto | fused | foreach | none
    optimizer: str = "adamw"  # adamw | muon (optim/registry.py; docs/optimizers.md)
    muon_lr: float = 0.0  # Muon's matrices; 0 = train.lr (the default scale matches AdamW's update RMS)
    muon_weight_decay: float = -1.0  # -1 = train.weight_decay
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    muon_ns_coefficients: list = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    muon_dtype: str = "auto"  # Newton-Schulz compute dtype: auto (float64 when the run is, else bfloat16)
    muon_scale: str = "match_rms_adamw"  # match_rms_adamw (0.2 sqrt(max(a, b))) | shape | none
    muon_qk_clip: float = 0.0  # QK-clip threshold tau on attention logits (Kimi K2: 100); 0 = off
    muon_qk_clip_alpha: float = 0.5  # the share of each clip on W_q (the rest on W_k)
    offload: str = "none"  # none | optimizer (Adam state on host) | params (FSDP2 CPU offload)
    reduce_dtype: str = "float32"  # gradient reduction dtype under bf16: float32 | bfloat16
    peak_tflops: float = 0.0  # one device's dense peak for MFU; 0 = the table by device name (train/metrics.py)
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
    live_recovery: bool = False  # replica groups drop out and rejoin without stopping the job (docs/resilience.md)
    live_rejoin_wait_s: float = 0.0  # at a step boundary, wait this long for a replica being restarted
    live_heartbeat_timeout_s: float = 5.0  # a replica silent this long is dropped (hung, stopped, lost)
    live_join_timeout_s: float = 30.0  # the lighthouse waits this long for heartbeating stragglers
    live_replay_phase: bool = False  # DiLoCo workers: a restarted worker replays its lost phase (train/live_outer.py)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "lowcomm": LowCommConfig,
}

TRAIN_CHOICES: dict[str, tuple] = {
    "dtype": ("auto", "float32", "float64", "bfloat16"),
    "device": ("auto", "cpu", "cuda"),
    "recompute": ("none", "selective", "op", "full"),
    "resume": ("auto", "never"),
    "fused_optimizer": ("auto", "fused", "foreach", "none"),
    "optimizer": ("adamw", "muon", "auto"),  # auto: `meshfold plan` picks one (docs/optimizers.md)
    "muon_dtype": ("auto", "bfloat16", "float32", "float64"),
    "muon_scale": ("match_rms_adamw", "shape", "none"),
    "offload": ("none", "optimizer", "params"),
    "reduce_dtype": ("float32", "bfloat16"),
    "fp8": fp8_config.RECIPES + (fp8_config.AUTO,),
}

# (section, key) -> allowed values; each section owns its own table.
CHOICES: dict[tuple[str, str], tuple] = {
    (section, key): allowed
    for section, table in (("model", model_config.CHOICES), ("parallel", layout.CHOICES),
                           ("train", TRAIN_CHOICES), ("data", data_config.CHOICES),
                           ("lowcomm", lowcomm_config.CHOICES))
    for key, allowed in table.items()
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lowcomm: LowCommConfig = field(default_factory=LowCommConfig)
    # How [model] was resolved from a preset (``load_config``), for the command line to print;
    # not a section: never dumped.
    model_note: str = field(default="", compare=False, repr=False)

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
    """A TOML file, then ``--set`` overrides. ``model.preset`` is a whole shape (README,
    "Using it"): the preset's values, then only the model keys set on purpose next to it or
    after it. A preset in the file takes the file's own [model] keys on top; a preset given
    with ``--set`` replaces the file's [model] (its keys describe another shape and are
    dropped, said in ``Config.model_note``) and takes only the ``--set`` model keys on top."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
    file_model = dict(data.get("model", {})) if isinstance(data.get("model"), dict) else {}
    set_model: dict[str, Any] = {}
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
        if section == "model":
            set_model[key] = value
    dropped: list[str] = []
    if set_model.get("preset") and isinstance(data.get("model"), dict):
        dropped = sorted(k for k in file_model if k != "preset")
        data["model"] = dict(set_model)  # the --set preset, then the --set keys only
    cfg = from_dict(data)
    cfg.model_note = _model_note(data.get("model", {}), path, dropped)
    return cfg


def _model_note(model: dict, path: Path | None, dropped: list[str]) -> str:
    """One line on how a preset was resolved: its overrides and the file keys it replaced."""
    name = model.get("preset", "") if isinstance(model, dict) else ""
    if not name:
        return ""
    overrides = [f"{k}={model[k]!r}" for k in model if k != "preset"]
    note = f"model.preset = {name!r}" + (f" with {', '.join(overrides)}" if overrides else " as published")
    if dropped:
        note += (f"; {path}'s own [model] keys ({', '.join(dropped)}) belong to another shape and are not used "
                 f"(set one with --set model.KEY=VALUE to override the preset)")
    return note

def model_keys(m: ModelConfig) -> dict[str, Any]:
    """The [model] keys that give ``m`` back under ``load_config``'s rule: its preset (if
    any) and the keys that differ from it (or from the defaults)."""
    base = ModelConfig(**preset_values(m.preset)) if m.preset else ModelConfig()
    keys = {k: v for k, v in dataclasses.asdict(m).items() if k != "preset" and v != getattr(base, k)}
    return {"preset": m.preset, **keys} if m.preset else keys


def dump_toml(cfg: Config) -> str:
    return tomli_w.dumps(cfg.to_dict())


# --------------------------------------------------------------------------- validation


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check the whole config (and, given a world size, the layout). Returns ``cfg`` with
    ``parallel.dp_shard`` resolved. Raises ``ConfigError`` with one line.

    Each section checks itself (``<section>/config.py``: ``validate``); what is left here
    relates sections that have no owner between them (the batch over the layout, the
    trainer's options over ZeRO). The runtime trusts a validated config."""
    validate_choices(cfg)
    model_config.validate(cfg.model)
    layout.validate(cfg.parallel)
    parallel_config.validate(cfg)
    data_config.validate(cfg)
    validate_train(cfg.train)
    fp8_config.validate(cfg)
    live_config.validate(cfg)
    if world_size is not None:
        validate_world(cfg, world_size)
    return cfg


def validate_choices(cfg: Config) -> None:
    """Every key with a fixed set of values holds one of them."""
    for (section, key), allowed in CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key} = {value!r}; choose one of {', '.join(allowed)}")


def validate_train(t: TrainConfig) -> None:
    """``[train]`` on its own."""
    if t.init_from and not Path(t.init_from).expanduser().exists():
        raise ConfigError(f"train.init_from = {t.init_from!r} does not exist; give an existing path")
    if t.steps < 0:
        raise ConfigError(f"train.steps must be >= 0, got {t.steps}")
    if t.peak_tflops < 0:
        raise ConfigError(f"train.peak_tflops must be >= 0 (0 = look the device up), got {t.peak_tflops}")
    if t.global_batch < 1:
        raise ConfigError(f"train.global_batch must be >= 1, got {t.global_batch}")
    if not (math.isfinite(t.lr) and t.lr > 0):
        raise ConfigError(f"train.lr must be a finite number > 0, got {t.lr}")
    if not math.isfinite(t.grad_clip) or t.grad_clip < 0:
        raise ConfigError(f"train.grad_clip must be a finite number >= 0 (0 = off), got {t.grad_clip}")
    for key in ("checkpoint_every", "keep_checkpoints", "log_every", "eval_every", "nan_guard_rollback"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if t.log_every < 1:
        raise ConfigError(f"train.log_every must be >= 1, got {t.log_every}")
    validate_muon(t)
    if t.init_from and Path(t.init_from).expanduser().resolve() == (Path(t.run_dir).expanduser().resolve()):
        raise ConfigError(f"train.init_from = {t.init_from!r} is train.run_dir itself; give a checkpoint folder "
                          f"(e.g. {t.init_from}/checkpoints/step-N)")


def validate_muon(t: TrainConfig) -> None:
    """Muon's keys (read whatever train.optimizer is: a typo should not wait for a switch)."""
    if not 0 <= t.muon_momentum < 1:
        raise ConfigError(f"train.muon_momentum must be in [0, 1), got {t.muon_momentum}")
    if t.muon_ns_steps < 1:
        raise ConfigError(f"train.muon_ns_steps must be >= 1, got {t.muon_ns_steps}")
    if t.muon_lr < 0:
        raise ConfigError(f"train.muon_lr must be >= 0 (0 = train.lr), got {t.muon_lr}")
    if not t.muon_qk_clip >= 0 or not 0 <= t.muon_qk_clip_alpha <= 1:
        raise ConfigError(f"train.muon_qk_clip must be >= 0 (0 = off) and train.muon_qk_clip_alpha in [0, 1], "
                          f"got {t.muon_qk_clip} and {t.muon_qk_clip_alpha}")
    coefficients = t.muon_ns_coefficients
    if len(coefficients) != 3 or not all(isinstance(c, (int, float)) and math.isfinite(c) for c in coefficients):
        raise ConfigError(f"train.muon_ns_coefficients must be three finite numbers (a, b, c), got {coefficients}")


def validate_world(cfg: Config, world_size: int) -> None:
    """The layout against the process count: workers, ``dp_shard`` resolved (written back
    into ``cfg.parallel``), then the checks that need the resolved degrees."""
    workers = lowcomm_config.worker_count(cfg.lowcomm, world_size)
    p = cfg.parallel = layout.validate_world(cfg.parallel, world_size // workers, workers)
    lowcomm_config.validate(cfg)
    layout.validate_resolved(p)
    validate_train_layout(cfg.train, p)
    validate_batch(cfg.train, p)
    data_config.validate_world(cfg)


def validate_train_layout(t: TrainConfig, p: ParallelConfig) -> None:
    """Trainer options that only some ZeRO stages and layouts support."""
    if p.pp > 1 and get_schedule(p.pp_schedule).splits_backward and t.recompute in ("full", "op"):
        # torch's checkpoint recomputes a block once per autograd pass that reaches it, and a
        # split backward runs the input-gradient pass and the weight-gradient pass(es) apart:
        # every block would be recomputed (with its collectives) in each
        raise ConfigError(
            f"parallel.pp_schedule = {p.pp_schedule} with train.recompute = {t.recompute} recomputes every block again "
            "in the weight-gradient pass (the input- and weight-gradient passes are separate autograd "
            "passes); use train.recompute = selective or none with zbv, or pp_schedule = interleaved"
        )
    if t.offload == "params" and (p.zero < 2 or p.dp_shard * p.cp == 1):
        raise ConfigError(
            "train.offload = params uses FSDP2's CPU offload: it needs parallel.zero >= 2 and "
            "parallel.dp_shard > 1; use train.offload = optimizer otherwise"
        )


def validate_batch(t: TrainConfig, p: ParallelConfig) -> None:
    """The global batch over the data-parallel ranks, micro-batches and pipeline micro-batches."""
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
            f"{divisors(local)}"
        )
    if p.pp > 1:
        n_micro = micro_batch_count(local, t.micro_batch, p.pp, p.pp_microbatches)
        if local % n_micro:
            raise ConfigError(
                f"parallel.pp_microbatches = {n_micro} does not divide the {local} sequences per "
                f"data-parallel rank; choose one of {divisors(local)}"
            )
        if get_schedule(p.pp_schedule).microbatch_problem(p.pp, n_micro):  # (interleaved: groups of pp)
            raise ConfigError(
                f"parallel.pp_microbatches = {n_micro}: pp_schedule = {p.pp_schedule} needs a multiple of "
                f"parallel.pp = {p.pp} micro-batches"
            )
