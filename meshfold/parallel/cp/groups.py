"""A context-parallel rank's plan: the cp group, the Ulysses degree and, for the hybrid,
the Ulysses (adjacent cp ranks) and ring (stride = Ulysses degree) sub-groups, made once per
process; and the attention work each rank did, for the balance metric."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshfold.parallel.facts.attention import ulysses_degree

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


@dataclass
class AttentionWork:
    """Score entries this rank computed (whole tiles) and the visible ones among them. The
    visible entries of partial tiles stay a device tensor (no host read in the step)."""

    computed: int = 0
    visible_known: int = 0
    tiles: int = 0
    skipped_tiles: int = 0
    visible_partial: torch.Tensor | None = None

    def add(self, layout) -> None:
        self.computed += layout.computed
        self.visible_known += layout.visible_known
        self.tiles += layout.tiles
        self.skipped_tiles += layout.skipped
        if layout.partial:
            part = layout.partial_visible()
            self.visible_partial = part if self.visible_partial is None else self.visible_partial + part

    def visible_tensor(self, device) -> torch.Tensor:
        out = torch.full((1,), float(self.visible_known), dtype=torch.float64, device=device)
        return out if self.visible_partial is None else out + self.visible_partial.to(device)

    @property
    def visible(self) -> int:
        """Visible entries (reads the device count: for tests and reports, not the step)."""
        return int(self.visible_tensor(torch.device("cpu")).item())

    def reset(self) -> None:
        self.computed = self.visible_known = self.tiles = self.skipped_tiles = 0
        self.visible_partial = None


@dataclass
class ContextParallelPlan:
    cp: int
    ulysses: int
    balance: bool
    cp_rank: int
    cp_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    tile: int = 0  # tokens per attention tile; 0 = seq_len / (2 max(cp, 4)) (set on first use)
    work: AttentionWork = field(default_factory=AttentionWork)
    count_work: bool = True  # off for forwards without grad (evaluation)
    kernel: str = "auto"  # "math": the explicit reference kernel instead of the fused ones
    device: torch.device | None = None  # where attention ran (for the per-step metric)

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    @property
    def ring_rank(self) -> int:
        return self.cp_rank // self.ulysses


_GROUPS: dict[tuple, dict] = {}  # hybrid sub-groups, made once per process (pipeline chunks share them)


def _new_groups(rank_lists: list[list[int]]) -> dict[tuple, dist.ProcessGroup]:
    """Create every group in the same order on every rank; keep the ones this rank is in.
    Made again once destroyed (a process group re-initialised by live recovery, or the
    test pool's clean-up between tasks): every rank destroys them together."""
    key = tuple(map(tuple, rank_lists))
    existing = dist.distributed_c10d._world.pg_map
    if key not in _GROUPS or any(g not in existing for g in _GROUPS[key].values()):
        _GROUPS[key] = _make_groups(rank_lists)
    return _GROUPS[key]


def _make_groups(rank_lists: list[list[int]]) -> dict[tuple, dist.ProcessGroup]:
    me = dist.get_rank()
    mine = {}
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if me in ranks:
            mine[tuple(ranks)] = group
    return mine


def build_plan(cfg: Config, dims) -> ContextParallelPlan:
    """The plan for this rank from the mesh: the cp group, and for hybrid the Ulysses
    (adjacent cp ranks) and ring (stride = Ulysses degree) sub-groups."""
    p = cfg.parallel
    degree = ulysses_degree(p, cfg.model)
    cp_group = dims.group("cp")
    cp_rank = dims.rank("cp")
    if degree == 1:
        return ContextParallelPlan(p.cp, 1, p.cp_balance, cp_rank, cp_group, None, cp_group)
    if degree == p.cp:
        return ContextParallelPlan(p.cp, degree, p.cp_balance, cp_rank, cp_group, cp_group, None)
    rows = dims.rank_lists("cp")
    ring = p.cp // degree
    uly_lists = [row[g * degree:(g + 1) * degree] for row in rows for g in range(ring)]
    ring_lists = [row[u::degree] for row in rows for u in range(degree)]
    uly = _new_groups(uly_lists)
    rings = _new_groups(ring_lists)
    (uly_group,) = uly.values()
    (ring_group,) = rings.values()
    return ContextParallelPlan(p.cp, degree, p.cp_balance, cp_rank, cp_group, uly_group, ring_group)
