"""What multi-token prediction (``models/deepseek/mtp.py``) asks of a layout, torch-free: its depths
shift whole sequences by k tokens. ``parallel/config.py`` runs ``check`` with the other
model parts' layout checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.errors import ConfigError
from meshfold.schedules import all_schedules, get_schedule

if TYPE_CHECKING:  # the composed config is handed in; its module sits above this layer
    from meshfold.config import Config


def check(cfg: Config) -> None:
    m, p = cfg.model, cfg.parallel
    if not m.mtp_depth:
        return
    if p.cp > 1:
        raise ConfigError("model.mtp_depth > 0 (multi-token prediction) shifts each sequence by k tokens, "
                          "which context parallel splits over ranks; set parallel.cp = 1 or model.mtp_depth = 0")
    if p.tp > 1 and p.sp:
        raise ConfigError("model.mtp_depth > 0 (multi-token prediction) shifts each sequence by k tokens, "
                          "which sequence parallel splits over tp ranks; set parallel.sp = false")
    if p.pp > 1 and not get_schedule(p.pp_schedule).runs_stage_weight_copies:  # (the embedding's copy)
        able = [s.name for s in all_schedules() if s.runs_stage_weight_copies]
        raise ConfigError(f"model.mtp_depth > 0 is not supported with parallel.pp_schedule = {p.pp_schedule}; "
                          f"use {', '.join(able[:-1])} or {able[-1]}")
