"""Training over slow links: outer optimizers across workers (``outer.py``), gradient
codecs for the per-step data-parallel path (``codecs.py``, ``compress.py``,
``onebit_adam.py``) and a network lab of throttled namespaces (``netlab.py``).

The Trainer calls ``attach_lowcomm(trainer)`` once and ``after_step(step)`` after every
optimizer step; everything else lives here.

Batch convention with workers (the DiLoCo convention): ``train.global_batch`` is the batch
of ONE worker per inner step, so W workers together process W x global_batch sequences per
step. Worker w takes rows [w B, (w+1) B) of a global batch of W B sequences drawn by the
seeded sampler, so workers see disjoint data, deterministically, and a DDP run with
global_batch = W B sees exactly the same sequences step by step.
"""

from __future__ import annotations

import io

import torch

from meshfold.config import Config, ConfigError
from meshfold.data.dataset import GlobalBatchSampler


class WorkerSampler:
    """This worker's slice of a W x B global batch (same interface as GlobalBatchSampler)."""

    def __init__(self, n: int, per_worker: int, workers: int, worker: int, seed: int):
        self.base = GlobalBatchSampler(n, per_worker * workers, seed)
        self.per_worker, self.worker = per_worker, worker

    def next(self) -> torch.Tensor:
        batch = self.base.next()
        return batch[self.worker * self.per_worker: (self.worker + 1) * self.per_worker]

    def state_dict(self) -> dict:
        return self.base.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.base.load_state_dict(sd)


class LowComm:
    """Glue between the Trainer and the outer optimizer / compression state."""

    def __init__(self, trainer):
        from meshfold.lowcomm.outer import build_outer
        from meshfold.parallel.data import unwrap, uses_fsdp

        cfg: Config = trainer.cfg
        lc, dims = cfg.lowcomm, trainer.dims
        self.trainer = trainer
        self.workers = dims.size("worker")
        worker = dims.rank("worker")
        if self.workers > 1:
            trainer.sampler = WorkerSampler(len(trainer.data.train), cfg.train.global_batch, self.workers, worker,
                                            cfg.train.seed)
        self.outer = None
        if lc.method != "none":
            named = list(unwrap(trainer.model).named_parameters())
            norm_group = dims.group("dp_shard_cp") if uses_fsdp(dims) else None
            self.outer = build_outer(lc.method, named, lc, outer_group(dims) if self.workers > 1 else None,
                                     cfg.train.steps, cfg.train.seed, norm_group)
        self.compression = getattr(trainer.model, "meshfold_compression", None)
        if self.compression is not None and lc.onebit_adam:
            self._use_onebit_adam(trainer)
        self.rank = trainer.rank
        if lc.method == "noloco" and self.workers > 1 and getattr(trainer, "fault", None) is not None:
            # The straggler check gathers timings over the whole world every k steps: a
            # collective over all workers, which NoLoCo promises not to issue.
            trainer.fault.every = 0
        if getattr(trainer, "checkpointer", None) is not None:
            trainer.checkpointer.register("lowcomm", self)

    def _use_onebit_adam(self, trainer) -> None:
        from meshfold.lowcomm.onebit_adam import OneBitAdam
        from meshfold.train.optim import build_scheduler, param_groups

        t = trainer.cfg.train
        state = self.compression
        trainer.optimizer = OneBitAdam(param_groups(trainer.model, t.weight_decay), state.group, state.n,
                                       trainer.cfg.lowcomm.onebit_warmup_steps, lr=t.lr, betas=(t.beta1, t.beta2),
                                       eps=t.eps)
        trainer.scheduler = build_scheduler(trainer.optimizer, t)
        state.optimizer = trainer.optimizer

    def after_step(self, step: int) -> dict:
        out = self.outer.after_step(step) if self.outer is not None else {}
        if self.compression is not None and self.compression.codec is not None:
            codec = self.compression.codec
            if hasattr(codec, "current_ratio"):
                out["topk_ratio"] = codec.current_ratio()
        return out

    # Checkpoints: outer state (global copy, outer momentum, in-flight results) and codec
    # error-feedback buffers differ per rank (shards, workers), so each rank stores its own
    # serialized blob under its global rank; restoring needs the same world size and layout.
    def local_state(self) -> dict:
        sd = {}
        if self.workers > 1:
            sd["worker_replica"] = self._replica_state()
        if self.outer is not None:
            sd["outer"] = self.outer.state_dict()
        if self.compression is not None and self.compression.codec is not None:
            sd["codec"] = self.compression.codec.state_dict()
        return sd

    def _named(self):
        from meshfold.parallel.data import unwrap

        return list(unwrap(self.trainer.model).named_parameters())

    def _replica_state(self) -> dict:
        """This rank's parameters and optimizer state. The checkpointer stores plain tensors
        once, as if every data-parallel copy were equal; across workers they are not (each
        worker trains its own replica between outer steps), so each rank keeps its own."""
        from meshfold.lowcomm.outer import local_tensor

        opt = self.trainer.optimizer
        out = {"params": {}, "optim": {}}
        for name, p in self._named():
            out["params"][name] = local_tensor(p).detach().clone()
            st = opt.state.get(p, {})
            out["optim"][name] = {k: (local_tensor(v).clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        return out

    @torch.no_grad()
    def _load_replica_state(self, sd: dict) -> None:
        from meshfold.lowcomm.outer import local_tensor

        opt = self.trainer.optimizer
        for name, p in self._named():
            local_tensor(p).copy_(sd["params"][name])
            st = opt.state.get(p)
            for k, v in sd["optim"].get(name, {}).items():
                if st is not None and k in st and torch.is_tensor(st[k]):
                    local_tensor(st[k]).copy_(v)
                elif st is not None:
                    st[k] = v

    def load_local_state(self, sd: dict) -> None:
        if "worker_replica" in sd:
            self._load_replica_state(sd["worker_replica"])
        if self.outer is not None and "outer" in sd:
            self.outer.load_state_dict(sd["outer"])
        if self.compression is not None and self.compression.codec is not None and "codec" in sd:
            self.compression.codec.load_state_dict(sd["codec"])

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.local_state(), buf)
        return {f"rank{self.rank}": buf.getvalue()}

    def load_state_dict(self, sd: dict) -> None:
        blob = sd.get(f"rank{self.rank}")
        if not blob:
            raise ValueError(f"checkpoint has no low-communication state for rank {self.rank} "
                             f"(saved with a different world size?)")
        self.load_local_state(torch.load(io.BytesIO(blob), weights_only=False))


def outer_group(dims):
    """A process group of its own linking rank i of every worker (the mesh's "worker"
    dimension). Not the mesh's group: when workers span the whole world DeviceMesh reuses
    the default group, and streaming/co2 exchanges run on a background thread, which must
    never share a group with the main thread's collectives (checkpoints, stragglers)."""
    import torch.distributed as dist

    ranks = dims.mesh.mesh.reshape(dims.size("worker"), -1)
    mine = None
    for j in range(ranks.shape[1]):  # every rank creates every group, in the same order
        members = ranks[:, j].tolist()
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


def attach_lowcomm(trainer) -> LowComm | None:
    lc = trainer.cfg.lowcomm
    if lc.method == "none" and lc.compression == "none":
        return None
    return LowComm(trainer)


def check_lowcomm(cfg: Config) -> None:
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
