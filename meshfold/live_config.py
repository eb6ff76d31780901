"""``train.live_recovery``'s checks (docs/resilience.md), which ``config.validate`` runs
with the other sections' own: what a live-recovery run needs of the layout, ``[lowcomm]``
and the data."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from meshfold.errors import ConfigError

if TYPE_CHECKING:
    from meshfold.config import Config


def validate(cfg: Config) -> None:
    """``train.live_recovery``: replica groups as failure domains (train/live.py). A replica
    group's own processes run its inner layout (``dp_replicate = 1``, ``lowcomm.workers = 1``):
    ``replica_config`` marks that config with ``live_replica``."""
    t, p = cfg.train, cfg.parallel
    if t.live_recovery and p.ep > 1 and p.zero < 2:  # parallel/config.py::check_expert_data_parallel's split
        raise ConfigError(f"train.live_recovery with parallel.ep = {p.ep} with parallel.zero = {p.zero} is not "
                          "supported; set train.live_recovery = false or parallel.zero = 2")
    if not t.live_recovery or getattr(cfg, "live_replica", False):  # train/live.py::replica_config
        return
    if importlib.util.find_spec("torchft") is None:  # the membership runs on its Lighthouse (train/quorum.py)
        raise ConfigError("train.live_recovery needs torchft's Lighthouse: pip install -c constraints.txt -e '.[live]' "
                          "(or set train.live_recovery = false)")
    lc = cfg.lowcomm
    if lc.workers > 1:  # the DiLoCo workers are the failure domains (train/live_outer.py)
        if lc.method not in ("diloco", "streaming") or lc.compression != "none" or p.dp_replicate > 1:
            raise ConfigError('train.live_recovery over lowcomm.workers is built for lowcomm.method = "diloco" or '
                              '"streaming" with lowcomm.compression = "none" and parallel.dp_replicate = 1')
        if lc.method == "streaming" and lc.quant_bits != 32:  # the quorum's exchange is a plain sum and count
            raise ConfigError(f"train.live_recovery with Streaming DiLoCo exchanges in full precision: set "
                              f"lowcomm.quant_bits = 32 (got {lc.quant_bits})")
        if lc.method == "streaming" and lc.fragments > lc.inner_steps:  # one quorum per exchange, one per step
            raise ConfigError(f"train.live_recovery with Streaming DiLoCo needs lowcomm.fragments = {lc.fragments} "
                              f"<= lowcomm.inner_steps = {lc.inner_steps} (one fragment exchanged per step)")
    elif p.dp_replicate < 2:
        raise ConfigError("train.live_recovery needs replica groups that fail independently: set "
                          "parallel.dp_replicate >= 2 (or lowcomm.workers >= 2 with DiLoCo)")
    elif lc.method != "none" or lc.compression != "none":
        raise ConfigError('train.live_recovery over parallel.dp_replicate with [lowcomm] is not built: set '
                          'lowcomm.method = "none" and lowcomm.compression = "none"')
    if t.live_replay_phase and (lc.workers <= 1 or lc.method != "diloco"):  # train/live_outer.py
        raise ConfigError('train.live_replay_phase replays a DiLoCo worker\'s phase: it needs lowcomm.method = "diloco" '
                          'with lowcomm.workers >= 2 (or set train.live_replay_phase = false)')
    if cfg.data.balance != "none":
        raise ConfigError('train.live_recovery with data.balance is not built yet: set data.balance = "none"')
    if lc.workers <= 1 and t.global_batch % p.dp_replicate:
        raise ConfigError(f"train.global_batch = {t.global_batch} must split into parallel.dp_replicate = "
                          f"{p.dp_replicate} equal slices (one per replica group)")
    if t.live_rejoin_wait_s < 0:
        raise ConfigError(f"train.live_rejoin_wait_s = {t.live_rejoin_wait_s} must be >= 0")
    if t.live_heartbeat_timeout_s <= 0 or t.live_join_timeout_s <= 0:
        raise ConfigError(f"train.live_heartbeat_timeout_s = {t.live_heartbeat_timeout_s} and train.live_join_timeout_s "
                          f"= {t.live_join_timeout_s} must be > 0")
