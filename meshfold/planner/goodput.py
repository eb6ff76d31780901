"""Goodput under failures: the fraction of wall-clock time that advances training, with and
without live recovery (``train.live_recovery``; docs/resilience.md). Pure, torch-free.

Failures arrive as a Poisson process, each node failing independently with mean time
between failures ``mtbf_node_h`` (MegaScale, the Llama 3 report and C4 count them per day
at 10k-GPU scale), so the job sees ``nodes / mtbf`` failures per hour.

Without live recovery (restart the whole job from the last checkpoint) each failure costs
the restart (detect, reschedule, start every process, reload the checkpoint:
``restart_s``) plus the work since the last checkpoint, on average half the interval; and
saving costs ``save_s`` per interval. The interval is Young's optimum
``sqrt(2 save_s / rate)`` unless given.

With live recovery the job is split into ``replicas`` failure domains. A failure takes one
replica out for ``replace_s`` (its processes restart, or a spare node takes over) while the
others go on; the survivors train the whole global batch (exactly-once data, so their step
is ``replicas / (replicas - 1)`` as long), i.e. the job loses that replica's share of the
throughput while it is out. Each failure also costs every replica the step that was
running when it struck (redone) and the pause while the rejoining replica receives the
model and optimizer state (``transfer_s``). Checkpoints are still written (for whole-job
failures), at the same cost per interval. When more than one replica is expected to be out
at once the loss adds up linearly (first order; the formula is exact for rare failures,
``rate * replace_s`` well below ``replicas``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HOUR = 3600.0


@dataclass(frozen=True)
class FailureModel:
    mtbf_node_h: float  # mean time between failures of one node, hours
    restart_s: float = 600.0  # a whole-job restart: reschedule, start, reload the checkpoint
    save_s: float = 30.0  # one checkpoint save (blocking part)
    checkpoint_interval_s: float | None = None  # None: Young's optimum for this failure rate
    replace_s: float = 300.0  # one replica back in (restart its processes or swap in a spare)
    transfer_s: float = 10.0  # the rejoining replica receives model + optimizer from a peer


def failures_per_s(nodes: int, mtbf_node_h: float) -> float:
    return nodes / (mtbf_node_h * HOUR)


def young_interval_s(save_s: float, rate_per_s: float) -> float:
    """Young's checkpoint interval: sqrt(2 * save cost / failure rate)."""
    return math.sqrt(2.0 * save_s / rate_per_s) if rate_per_s > 0 else math.inf


def goodput(nodes: int, replicas: int, step_time_s: float, fm: FailureModel) -> dict:
    """Expected goodput (0..1) with and without live recovery, and the terms behind it."""
    if nodes < 1 or fm.mtbf_node_h <= 0:
        raise ValueError("goodput needs nodes >= 1 and mtbf_node_h > 0")
    rate = failures_per_s(nodes, fm.mtbf_node_h)
    interval = fm.checkpoint_interval_s or young_interval_s(fm.save_s, rate)
    save_frac = fm.save_s / (interval + fm.save_s) if math.isfinite(interval) else 0.0
    # Restart from the checkpoint: the restart plus, on average, half an interval of lost work.
    restart_frac = rate * (fm.restart_s + interval / 2.0) if math.isfinite(interval) else 0.0
    without = max(0.0, (1.0 - save_frac) * (1.0 - restart_frac))
    out = {"nodes": nodes, "replicas": replicas, "failures_per_day": rate * 86400.0,
           "checkpoint_interval_s": interval, "goodput_restart": without}
    if replicas >= 2:
        down_frac = min(1.0, rate * fm.replace_s / replicas)  # expected share of replicas out
        stall_frac = rate * (step_time_s + fm.transfer_s)  # the redone step + the state transfer
        live = max(0.0, (1.0 - save_frac) * (1.0 - down_frac - stall_frac))
        out.update(goodput_live=live, replica_down_frac=down_frac)
    else:
        out.update(goodput_live=None, replica_down_frac=None)
    return out


def failures_line(g: dict, mtbf_node_h: float) -> str:
    """``meshfold simulate``'s summary of ``goodput``'s answer ``g``."""
    with_replicas = _percent(g["goodput_live"], "n/a (one replica group)")
    return (f"failures: {g['failures_per_day']:.2f}/day at MTBF {mtbf_node_h:g} h per node; goodput "
            f"{100 * g['goodput_restart']:.1f}% restarting from checkpoints (every {g['checkpoint_interval_s']:.0f} s), "
            f"{with_replicas} with live recovery over {g['replicas']} replica groups")


def _percent(share: float | None, absent: str) -> str:
    return absent if share is None else f"{100 * share:.1f}%"
