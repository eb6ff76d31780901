"""``[parallel]``: the layout's dataclass and its checks that need nothing but it.

It sits in the core layer (below ``models``) because ``mesh.py`` builds the device mesh from
it. The checks that relate the layout to the model (heads over tp, seq_len over cp, layers
over pp, experts over ep) live in ``parallel/config.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from meshfold.errors import ConfigError
from meshfold.schedules import all_schedules, schedule_names


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1 = whatever the world size leaves after the other degrees
    zero: int = 3
    tp: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"  # a registered schedule (meshfold/schedules): gpipe | 1f1b | interleaved | zbv | skippipe
    pp_microbatches: int = 0  # 0 = pp (or the local micro-batch count)
    pp_virtual_stages: int = 1
    pp_split: list = field(default_factory=list)  # layers per stage, overrides the balancer
    # skippipe (docs/pipeline.md): largest share of stages a micro-batch may skip (0 = none),
    # whether middle stages may be visited out of order, and what its path scheduler prices:
    # link rates between pp ranks (Mbit/s; [a, b, rate] pairs over the default, 0 = free)
    # and a stage's sustained TFLOP/s
    pp_skip: float = 0.0
    pp_reorder: bool = False
    pp_link_mbit: float = 0.0
    pp_links: list = field(default_factory=list)
    pp_stage_tflops: float = 0.02
    cp: int = 1
    cp_mode: str = "ring"  # ring | ulysses | hybrid
    cp_ulysses: int = 0  # hybrid: Ulysses degree inside a ring group (0 = largest that fits)
    cp_balance: bool = True  # causal load-balanced chunking for ring attention
    ep: int = 1
    # Expert parallel: the tokens of a micro-batch go to their experts in this many chunks,
    # chunk i+1's all-to-all in flight while the experts compute chunk i (docs/moe.md);
    # 1 = one exposed dispatch and combine per layer
    ep_overlap_chunks: int = 1
    # The dispatch all-to-all's rows in fp8 (e4m3, a power-of-2 scale per row sent beside them;
    # needs train.fp8; parallel/fp8/dispatch.py); the combine and the gradients stay in bf16
    ep_fp8_dispatch: bool = False
    # Expert tensor parallel (Megatron-Core's expert_tensor_parallel_size): 1 = whole experts
    # split over ep x tp; tp = each expert's FFN split over the tp group, ep over dp x cp only
    # (parallel/facts/expert_tp.py)
    expert_tp: int = 1

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


CHOICES: dict[str, tuple] = {
    "pp_schedule": schedule_names(),
    "cp_mode": ("ring", "ulysses", "hybrid"),
}


def validate(p: ParallelConfig) -> None:
    """``[parallel]`` on its own, before the world size is known: degrees and ZeRO stage."""
    for key in ("dp_replicate", "tp", "pp", "cp", "ep", "ep_overlap_chunks", "pp_virtual_stages", "expert_tp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallel.dp_shard must be >= 1 or -1 (fill from world size), got {p.dp_shard}")
    if p.ep_overlap_chunks > 1 and p.ep == 1:
        raise ConfigError(f"parallel.ep_overlap_chunks = {p.ep_overlap_chunks} pipelines the expert-parallel "
                          "all-to-all; it needs parallel.ep > 1 (set it to 1 without expert parallel)")
    if p.expert_tp not in (1, p.tp):
        raise ConfigError(f"parallel.expert_tp = {p.expert_tp} must be 1 (whole experts over ep x tp) or "
                          f"parallel.tp = {p.tp} (each expert split over the tp group)")
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero = {p.zero}; choose 0, 1, 2 or 3")
    for schedule in all_schedules():  # each checks its own keys, chosen or not
        schedule.check_parallel(p, chosen=schedule.name == p.pp_schedule)
    for link in p.pp_links:
        if (not isinstance(link, list) or len(link) != 3 or not all(isinstance(x, int) for x in link[:2])
                or not 0 <= min(link[:2]) <= max(link[:2]) < p.pp or link[0] == link[1] or link[2] <= 0):
            raise ConfigError(f"parallel.pp_links: {link} must be [rank a, rank b, Mbit/s > 0] with two "
                              f"different pp ranks below parallel.pp = {p.pp}")
    if p.pp_link_mbit < 0 or p.pp_stage_tflops <= 0:
        raise ConfigError("parallel.pp_link_mbit must be >= 0 (0 = free) and parallel.pp_stage_tflops > 0")


def validate_world(p: ParallelConfig, world_size: int, workers: int = 1) -> ParallelConfig:
    """Resolve ``dp_shard`` against the ranks of one worker and check the layout fills them
    exactly; then the checks that need the resolved degrees. Returns the resolved layout."""
    p = p.resolved(world_size)
    if p.world_size() != world_size:
        what = "the world size" if workers == 1 else f"the ranks per worker ({world_size})"
        raise ConfigError(
            f"parallel: dp_replicate*dp_shard*tp*pp*cp = {p.dp_replicate}*{p.dp_shard}*{p.tp}*{p.pp}*{p.cp} "
            f"= {p.world_size()} but {what} is {world_size}; change parallel.dp_shard to "
            f"{_fit_dp_shard(p, world_size)} or the process count to {p.world_size() * workers}"
        )
    return p


def validate_resolved(p: ParallelConfig) -> None:
    """Checks on the resolved degrees (``dp_shard`` known)."""
    if p.ep > 1 and (p.dp * p.cp) % p.ep:
        raise ConfigError(
            f"parallel.ep = {p.ep} must divide dp_replicate*dp_shard*cp = {p.dp * p.cp} (ep folds onto them)"
        )
    if p.ep > 1 and p.zero >= 2 and (p.dp_shard * p.cp) % p.ep:
        # (zero 0/1 reduce the experts over edp with their own reducer: any data x context ranks do)
        raise ConfigError(
            f"parallel.ep = {p.ep} must divide dp_shard*cp = {p.dp_shard * p.cp} with parallel.zero >= 2 (ep folds "
            f"onto the sharded data x context ranks); change parallel.ep or parallel.dp_shard, or use zero 0/1"
        )
    if p.dp_shard > 1 and p.zero == 0:
        raise ConfigError(
            f"parallel.zero = 0 replicates everything but parallel.dp_shard = {p.dp_shard}; "
            f"set parallel.zero to 1, 2 or 3, or use parallel.dp_replicate = {p.dp} with dp_shard = 1"
        )


def _fit_dp_shard(p: ParallelConfig, world_size: int) -> str:
    rest = p.dp_replicate * p.tp * p.pp * p.cp
    if world_size % rest == 0:
        return str(world_size // rest)
    return "-1 after making dp_replicate*tp*pp*cp divide the world size"
