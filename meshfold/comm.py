"""A per-step ledger of bytes this rank sends, by mesh dimension.

Convention (the same the planner's alpha-beta model uses): bytes a rank sends under the
bandwidth-optimal ring algorithm for each collective over a group of n ranks holding
``size`` bytes in total (all-reduce, all-gather output, reduce-scatter input):

    all-reduce      2 (n-1)/n * size
    all-gather        (n-1)/n * size
    reduce-scatter    (n-1)/n * size
    all-to-all        (n-1)/n * size   (uniform splits; variable splits: the bytes leaving)
    send              size

Parallel code records each collective it issues (or, for FSDP2 and DDP, each one they
issue on its behalf) here; ``metrics.jsonl`` writes the totals as ``comm_bytes``.
"""

from __future__ import annotations

from collections import defaultdict

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
           "send": lambda n: 1.0, "broadcast": lambda n: (n - 1) / n}


class CommLedger:
    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)

    def record(self, dim: str, op: str, size_bytes: float, group_size: int) -> None:
        if group_size <= 1 or size_bytes <= 0:
            return
        sent = FACTORS[op](group_size) * size_bytes
        self.step[dim] += sent
        self.total[dim] += sent

    def add_sent(self, dim: str, sent_bytes: float) -> None:
        """Record bytes already known to be sent (point-to-point, variable all-to-all)."""
        self.step[dim] += sent_bytes
        self.total[dim] += sent_bytes

    def pop_step(self) -> dict[str, int]:
        out = {k: int(round(v)) for k, v in sorted(self.step.items())}
        self.step.clear()
        return out


_LEDGER = CommLedger()


def ledger() -> CommLedger:
    """The process-wide ledger (one training job per process)."""
    return _LEDGER


def reset_ledger() -> CommLedger:
    global _LEDGER
    _LEDGER = CommLedger()
    return _LEDGER
