"""``[lowcomm]``: the dataclass of training over slow links and its checks (docs/lowcomm.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshfold.errors import ConfigError

if TYPE_CHECKING:  # the composed config is handed in; its module sits above this layer
    from meshfold.config import Config


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


    @property
    def n_workers(self) -> int:
        """Workers the world splits into: ``workers`` with a low-communication method, else 1."""
        return self.workers if self.method != "none" else 1

CHOICES: dict[str, tuple] = {
    "method": ("none", "diloco", "streaming", "noloco", "co2"),
    "compression": ("none", "powersgd", "topk", "onebit", "lgreco"),
    "quant_coding": ("fixed", "deflate"),
}


def worker_count(lc: LowCommConfig, world_size: int) -> int:
    """The number of workers the world size splits into (1 without a low-communication method)."""
    workers = lc.n_workers
    if workers < 1 or world_size % workers:
        raise ConfigError(
            f"lowcomm.workers = {lc.workers} does not divide the world size {world_size}"
        )
    return workers


def validate(cfg: Config) -> None:
    """``[lowcomm]`` checks for ``config.validate`` (after the layout is resolved)."""
    lc, p, m = cfg.lowcomm, cfg.parallel, cfg.model
    if lc.method != "none":
        if lc.workers < 1:
            raise ConfigError(f"lowcomm.workers must be >= 1, got {lc.workers}")
        if lc.inner_steps < 1:
            raise ConfigError(f"lowcomm.inner_steps must be >= 1 with lowcomm.method = {lc.method} (e.g. 50)")
        if lc.outer_lr <= 0 or not 0 <= lc.outer_momentum < 1:
            raise ConfigError("lowcomm.outer_lr must be > 0 and lowcomm.outer_momentum in [0, 1)")
    if lc.method == "streaming":
        if not 1 <= lc.fragments <= m.n_layers:
            raise ConfigError(f"lowcomm.fragments = {lc.fragments} must be between 1 and model.n_layers = {m.n_layers}")
        if not 0 <= lc.overlap_steps < lc.inner_steps:
            raise ConfigError(f"lowcomm.overlap_steps = {lc.overlap_steps} must be in [0, lowcomm.inner_steps = "
                              f"{lc.inner_steps})")
        if lc.quant_bits not in (4, 32):
            raise ConfigError(f"lowcomm.quant_bits = {lc.quant_bits}; choose 4 (FP4 E3M0) or 32")
        if lc.quant_coding == "deflate" and lc.quant_bits != 4:
            raise ConfigError("lowcomm.quant_coding = deflate codes the 4-bit exchange; set lowcomm.quant_bits = 4")
        if not 0 <= lc.mixing <= 1:
            raise ConfigError(f"lowcomm.mixing = {lc.mixing} must be in [0, 1]")
    if lc.method != "none" and lc.workers > 1 and cfg.data.balance != "none":
        raise ConfigError("data.balance with lowcomm.workers > 1 is not supported (workers take slices of one "
                          "sampled batch); set data.balance = none")
    if lc.method == "co2":
        if p.tp > 1 or p.pp > 1:
            raise ConfigError("lowcomm.method = co2 clips the outer momentum by its norm over data-parallel shards "
                              "only; use parallel.tp = 1 and parallel.pp = 1 inside workers")
        if not 0 <= lc.co2_staleness_penalty <= 1:
            raise ConfigError(f"lowcomm.co2_staleness_penalty = {lc.co2_staleness_penalty} must be in [0, 1]")
        if lc.co2_clip < 0:
            raise ConfigError(f"lowcomm.co2_clip must be >= 0 (0 = off), got {lc.co2_clip}")
    if lc.compression != "none":
        if p.zero >= 2 and p.dp_shard * p.cp > 1:
            raise ConfigError(
                f"lowcomm.compression = {lc.compression} works on the DDP path only; set parallel.zero to 0 or 1 "
                f"(or parallel.dp_shard = 1), FSDP's reduce-scatter is not compressed")
        if lc.compression in ("powersgd", "lgreco") and lc.powersgd_rank < 1:
            raise ConfigError(f"lowcomm.powersgd_rank must be >= 1, got {lc.powersgd_rank}")
        if lc.compression == "topk" and not (0 < lc.topk_ratio <= 1 and 0 <= lc.dgc_momentum < 1):
            raise ConfigError("lowcomm.topk_ratio must be in (0, 1] and lowcomm.dgc_momentum in [0, 1)")
        if lc.compression == "lgreco" and (lc.lgreco_error_budget <= 0 or lc.lgreco_every < 1):
            raise ConfigError("lowcomm.lgreco_error_budget must be > 0 and lowcomm.lgreco_every >= 1")
    if lc.onebit_adam and lc.compression != "onebit":
        raise ConfigError("lowcomm.onebit_adam needs lowcomm.compression = onebit")
