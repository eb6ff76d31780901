"""``[data]``: the data path's dataclass and its checks (sources, mixtures, balancing).

``validate`` reads the other sections it depends on (the layout for balancing, ``[lowcomm]``
for mixtures) from the composed config that ``config.validate`` hands in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from meshfold.errors import ConfigError

if TYPE_CHECKING:  # the composed config is handed in; its module sits above this layer
    from meshfold.config import Config


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


CHOICES: dict[str, tuple] = {
    "balance": ("none", "greedy", "exact"),
}


def validate(cfg: Config) -> None:
    """``[data]``: paths that must exist, the mixture, prefetch, and balancing."""
    d = cfg.data
    for key, value in (("data.source", d.source if d.source != "default" else ""),
                       ("data.tokenizer", d.tokenizer)):
        if value and not Path(value).expanduser().exists():
            raise ConfigError(f"{key} = {value!r} does not exist; give an existing path"
                              + (" or 'default'" if key == "data.source" else ""))
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
    if d.balance != "none":
        validate_balance(cfg)


def validate_world(cfg: Config) -> None:
    """Checks that need the resolved layout (``parallel.dp_shard`` known, batch checked)."""
    d, p, t = cfg.data, cfg.parallel, cfg.train
    if d.balance != "none" and d.seq_cp_max > 1:
        dp = p.dp
        local = t.global_batch // dp
        micro = t.micro_batch or local
        if dp % d.seq_cp_max or local // micro != 1:
            raise ConfigError(f"data.seq_cp_max = {d.seq_cp_max} needs it to divide the {dp} data-parallel ranks "
                              f"and one micro-batch per rank (train.micro_batch = 0)")


def validate_balance(cfg: Config) -> None:
    """One-line ``ConfigError`` for settings the balanced data path cannot serve."""
    d, p, m = cfg.data, cfg.parallel, cfg.model
    if not (d.pack and d.doc_mask):
        raise ConfigError(f"data.balance = {d.balance} feeds whole documents packed with per-document attention; "
                          f"set data.pack = true and data.doc_mask = true")
    if p.pp > 1:
        raise ConfigError(f"data.balance = {d.balance} gives micro-batches of varying length, which pipeline "
                          f"stages cannot take; use parallel.pp = 1 or data.balance = none")
    if p.tp > 1 and p.sp:
        raise ConfigError(f"data.balance = {d.balance} gives micro-batches of varying length that sequence "
                          f"parallel cannot split evenly; set parallel.sp = false or data.balance = none")
    if p.cp > 1:
        raise ConfigError(f"data.balance = {d.balance} with parallel.cp = {p.cp} is not supported yet "
                          f"(per-sequence context parallel is planned only); use parallel.cp = 1")
    if d.max_tokens and d.max_tokens < m.seq_len and d.seq_cp_max == 1:
        raise ConfigError(f"data.max_tokens = {d.max_tokens} is below model.seq_len = {m.seq_len} (the longest "
                          f"document piece); use 0 (= 2*micro_batch*seq_len) or at least {m.seq_len}")
    if d.cost_a < 0 or d.cost_b < 0:
        raise ConfigError(f"data.cost_a = {d.cost_a} and data.cost_b = {d.cost_b} must be >= 0 "
                          f"(both 0 = measure; see meshfold calibrate-cost)")
    if d.balance_tolerance < 1:
        raise ConfigError(f"data.balance_tolerance = {d.balance_tolerance} must be >= 1 (max/mean load)")
    if d.seq_cp_max < 1 or d.seq_cp_max & (d.seq_cp_max - 1):
        raise ConfigError(f"data.seq_cp_max = {d.seq_cp_max} must be a power of two (1 = off)")
    if d.seq_cp_max > 1 and (p.tp > 1 or d.balance == "exact"):
        raise ConfigError(f"data.seq_cp_max = {d.seq_cp_max} (per-sequence context parallel) needs parallel.tp = 1 "
                          f"and data.balance = greedy")
    if d.seq_cp_max > 1 and d.max_tokens and d.max_tokens * d.seq_cp_max < m.seq_len:
        raise ConfigError(f"data.max_tokens = {d.max_tokens} times data.seq_cp_max = {d.seq_cp_max} is below "
                          f"model.seq_len = {m.seq_len}: the longest piece could not be placed; raise one of them")
    if d.balance_time_limit_s <= 0:
        raise ConfigError(f"data.balance_time_limit_s must be > 0, got {d.balance_time_limit_s}")
