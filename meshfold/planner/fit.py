"""Does a run fit this machine, before any process starts (``meshfold train``)?

The planner's peak for the config's own layout next to the memory there is: on CPU the
host's available RAM, shared by every local process; on CUDA one GPU's memory. When it does
not fit, the refusal names the smallest change that does, tried in this order: more
recompute on the same layout, the optimizer state on the host (GPUs), a layout
``meshfold plan`` finds for the same number of processes; else more devices.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from meshfold.config import Config
from meshfold.models.counts import param_count
from meshfold.planner.cluster import GiB, Cluster, load_cluster
from meshfold.planner.cost import CostModel, Layout
from meshfold.planner.from_config import layout_from_config, on_gpu, workload_from_config
from meshfold.planner.search import search


@dataclass
class Fit:
    model: str  # e.g. "llama3-1b (1.24 B parameters)"
    processes: int
    on_gpu: bool
    need_bytes: float  # the host's share (all local processes) on CPU; one GPU's on CUDA
    have_bytes: float | None  # None: unknown
    fix: str = ""  # the smallest change that fits, when it does not

    @property
    def fits(self) -> bool:
        return self.have_bytes is None or self.need_bytes <= self.have_bytes

    def where(self) -> str:
        return "per GPU" if self.on_gpu else "on the host"

    def building_line(self) -> str:
        procs = f"{self.processes} process" + ("es" if self.processes > 1 else "")
        have = "" if self.have_bytes is None else f" of {_gib(self.have_bytes)} GiB {self.available()}"
        return f"building {self.model} on {procs}, estimated peak {_gib(self.need_bytes)} GiB {self.where()}{have}"

    def available(self) -> str:
        return "(one GPU)" if self.on_gpu else "available"

    def refusal(self) -> str:
        procs = f"{self.processes} process" + ("es" if self.processes > 1 else "")
        there = "one GPU has" if self.on_gpu else "this host has"
        return (f"{self.model} on {procs} needs an estimated {_gib(self.need_bytes)} GiB {self.where()} at peak, "
                f"and {there} {_gib(self.have_bytes or 0)} GiB{'' if self.on_gpu else ' available'}; {self.fix} (--force to start anyway)")


def _gib(x: float) -> str:
    return f"{x / GiB:,.1f}"


def model_label(cfg: Config) -> str:
    m = cfg.model
    name = m.preset or f"a {m.n_layers}-layer model of dim {m.dim}"
    n = param_count(m)
    count = next(f"{n / scale:.3g} {unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                 if n >= scale or scale == 1)
    return f"{name} ({count} parameters)"


def available_bytes(gpu: bool) -> float | None:
    """What there is: one GPU's memory, or the host's available RAM (``MemAvailable``)."""
    if gpu:
        import torch  # only on CUDA hosts; the planner itself never needs torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fit(cfg: Config, world: int, local: int, config_path: str, have: float | None = None) -> Fit:
    """The planner's estimate for ``cfg``'s layout on ``world`` ranks, ``local`` of them on
    this host; ``have`` overrides the measured memory (tests)."""
    gpu = on_gpu(cfg.train.device)
    cluster = load_cluster("h100" if gpu else "cpu", devices=world)
    cm = CostModel(workload_from_config(cfg, gpu), cluster)
    layout = layout_from_config(cfg, world)
    share = 1 if gpu else max(1, local)  # CPU ranks share the host's memory

    build_only = cfg.train.steps == 0  # train.steps = 0 builds the sharded model and exits: parameters only

    def need(L: Layout) -> float:
        est = cm.estimate(L, detail=False)
        return (est.param_bytes if build_only else est.peak_mem_bytes) * share

    have = available_bytes(gpu) if have is None else have
    fit = Fit(model_label(cfg), world, gpu, need(layout), have)
    if not fit.fits:
        fit.fix = _smallest_fix(cfg, cm, cluster, layout, need, have, share, config_path)
    return fit


def _smallest_fix(cfg: Config, cm: CostModel, cluster: Cluster, layout: Layout, need, have: float, share: int,
                  config_path: str) -> str:
    for recompute in ("selective", "full"):
        if recompute == layout.recompute:
            continue
        needed = need(dataclasses.replace(layout, recompute=recompute))
        if needed <= have:
            return f"with --set train.recompute={recompute} it needs {_gib(needed)} GiB"
    if cm.c.device.name != "cpu":
        est = cm.estimate(layout)
        if est.peak_mem_bytes - est.optimizer_bytes <= have:
            return "with --set train.offload=optimizer (Adam's state on the host) it fits"
    world = cluster.world_size
    per_device = dataclasses.replace(cluster.device, memory_gib=have / share / GiB)
    plan = search(cm.w, dataclasses.replace(cluster, device=per_device), top=1)
    if plan.any_fits and plan.ranked:
        best = plan.ranked[0]
        return (f"the layout {best.layout.short()} needs {_gib(best.peak_mem_bytes * share)} GiB: "
                + " ".join(f"--set {k}={_toml(v)}" for k, v in changed_keys(layout, best.layout, cfg.train.global_batch).items()))
    least = min([e.peak_mem_bytes * share for e in plan.ranked] + [need(dataclasses.replace(layout, recompute="full"))])
    return (f"no layout of {world} process{'es' if world > 1 else ''} fits (the smallest needs "
            f"{_gib(least)} GiB): use more devices (meshfold plan {config_path} --cluster h100:64) or a smaller model")


def changed_keys(current: Layout, layout: Layout, global_batch: int) -> dict[str, object]:
    """``section.key -> value`` of ``layout``'s keys that differ from the ``current`` one's."""
    now = current.config_values(global_batch)
    return {f"{section}.{key}": value for section, values in layout.config_values(global_batch).items()
            for key, value in values.items() if now[section].get(key) != value}


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
