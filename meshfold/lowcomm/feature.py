"""The ``[lowcomm]`` feature of a run (``train/feature.py``): per-worker data, the outer
optimizer, 1-bit Adam and the low-communication state in checkpoints; see the package doc
(``meshfold/lowcomm/__init__.py``) for the batch convention with workers."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from meshfold.data.dataset import GlobalBatchSampler
from meshfold.lowcomm.compress import DDPCompression, build_compression
from meshfold.lowcomm.onebit_adam import OneBitAdam
from meshfold.lowcomm.outer import build_outer, local_tensor
from meshfold.parallel.dp.plan import unwrap, uses_fsdp
from meshfold.optim.adamw import param_groups
from meshfold.optim.lr_schedule import build_scheduler

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


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
    """The trainer feature of ``[lowcomm]`` (``train/feature.py``): per-worker data
    (``wrap_sampler``), 1-bit Adam (``wrap_optimizer``), the outer step (``after_step``) and
    the low-communication state in checkpoints (``extra.lowcomm``). Built from the config,
    the mesh, this rank's model and the size of the training set; it never sees the trainer."""

    name = "lowcomm"

    def __init__(self, cfg: Config, dims, rank: int, train_size: int,
                 compression: DDPCompression | None = None):
        """Built before the model: ``compression`` (``build_compression``) is the owner of
        ``lowcomm.compression``'s DDP hook, whose ``install`` goes to ``parallelize`` as the
        run's ``comm_hook``; the model and the hook's state (codec, 1-bit Adam switch) are
        read in ``attach``, once both exist."""

        lc = cfg.lowcomm
        self.cfg, self.dims, self.model, self.rank, self.train_size = cfg, dims, None, rank, train_size
        self.optimizer = None  # the run's optimizer, once ``wrap_optimizer`` has seen it
        self.workers = dims.size("worker")
        self.outer = None
        self.hook_owner = compression
        self.comm_hook = compression.install if compression is not None else None
        self.compression = None
        # The outer methods and 1-bit Adam read or write the fp32 parameters between steps
        # (or replace the optimizer): ZeRO-1 keeps its fp32 gather for them.
        self.touches_master_weights = lc.method != "none" or lc.onebit_adam
        # The straggler check gathers timings over the whole world every k steps: a
        # collective over all workers, which NoLoCo promises not to issue.
        self.world_collectives = not (lc.method == "noloco" and self.workers > 1)

    def attach(self, parts) -> None:
        """``parts.model``: this rank's parallelised model."""
        lc, dims, model = self.cfg.lowcomm, self.dims, parts.model
        self.model = model
        if lc.method != "none":
            named = list(unwrap(model).named_parameters())
            norm_group = dims.group("dp_shard_cp") if uses_fsdp(dims) else None
            self.outer = build_outer(lc.method, named, lc, outer_group(dims) if self.workers > 1 else None,
                                     self.cfg.train.steps, self.cfg.train.seed, norm_group)
        # CompressionState, or None (no compression, or no DDP module to hook: one process,
        # the gradient reducer's layouts)
        self.compression = self.hook_owner.state if self.hook_owner is not None else None

    def wrap_sampler(self, sampler):
        """With workers, worker w takes its slice of a W x B global batch (module doc)."""
        if self.workers <= 1:
            return sampler
        t = self.cfg.train
        return WorkerSampler(self.train_size, t.global_batch, self.workers, self.dims.rank("worker"), t.seed)

    def wrap_optimizer(self, optimizer, scheduler):
        """``lowcomm.onebit_adam``: 1-bit Adam (and its scheduler) in place of the run's
        optimizer; the compression state steps with it."""
        if self.compression is not None and self.cfg.lowcomm.onebit_adam:
            t, state = self.cfg.train, self.compression
            optimizer = OneBitAdam(param_groups(self.model, t.weight_decay), state.group, state.n,
                                   self.cfg.lowcomm.onebit_warmup_steps, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
            scheduler = build_scheduler(optimizer, t)
            state.optimizer = optimizer
        self.optimizer = optimizer
        return optimizer, scheduler

    def after_step(self, step: int) -> dict:
        out = self.outer.after_step(step) if self.outer is not None else {}
        if self.compression is not None and self.compression.codec is not None:
            codec = self.compression.codec
            if hasattr(codec, "current_ratio"):
                out["topk_ratio"] = codec.current_ratio()
        return out

    # Checkpoints (through DCP, like the rest of the run's state): a flat dict of tensors and
    # plain values whose keys start with a *scope* saying who holds that value:
    #   all/...        identical on every rank (outer state shared by the workers, PowerSGD's Q,
    #                  counters): saved once, loads at any worker count and data-parallel size
    #   s<j>/...       the same, when the model is sharded (FSDP/TP) inside a worker: shard j
    #   w<i>/...       worker i's own model replica, inner optimizer, NoLoCo/CO2 local state
    #   r<R>/...       rank R's error feedback (and DGC momentum)
    # A checkpoint with a different number of workers, or a different sharding inside the
    # workers, is refused with one line; error feedback saved at another data-parallel size
    # loads as the mean of the saved ranks' residuals, which is all the error-feedback
    # invariant (sum of what was sent + mean residual = sum of mean gradients) depends on.
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

        return list(unwrap(self.model).named_parameters())

    def _replica_state(self) -> dict:
        """This rank's parameters and optimizer state. The checkpointer stores plain tensors
        once, as if every data-parallel copy were equal; across workers they are not (each
        worker trains its own replica between outer steps), so each worker keeps its own."""

        opt = self.optimizer
        out = {"params": {}, "optim": {}}
        for name, p in self._named():
            out["params"][name] = local_tensor(p).detach().clone()
            st = opt.state.get(p, {})
            out["optim"][name] = {k: (local_tensor(v).clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        return out

    @torch.no_grad()
    def _load_replica_state(self, sd: dict) -> None:

        opt = self.optimizer
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

    # -- scopes
    def _layout(self) -> tuple[bool, int, int]:
        """(model sharded inside the worker, this rank's position in its worker, ranks per worker)."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        sharded = any(hasattr(p, "to_local") for _, p in self._named())
        per_worker = world // max(1, self.workers)
        return sharded, self.rank % per_worker, per_worker

    def _scopes(self) -> tuple[str, str, str]:
        sharded, inner, _ = self._layout()
        worker = self.dims.rank("worker") if self.workers > 1 else 0
        shared = f"s{inner}" if sharded else "all"
        return shared, (f"w{worker}.s{inner}" if sharded else f"w{worker}"), f"r{self.rank}"

    def _scope_of(self, key: str) -> str:
        shared, worker, rank = self._scopes()
        parts = key.split("/")
        if parts[0] == "worker_replica":
            return worker
        if parts[0] == "outer":
            per_worker = self.outer is not None and (self.outer.name == "noloco" or parts[1] == "start")
            return worker if per_worker else shared
        if parts[0] == "codec" and parts[1] == "state" and len(parts) > 3 and parts[3] in ("error", "momentum"):
            return rank
        return shared

    def state_dict(self) -> dict:
        return {f"{self._scope_of(k)}/{k}": v for k, v in flatten_state(self.local_state()).items()}

    def load_template(self, saved: dict) -> dict:
        """What this rank loads, from the checkpoint's DCP metadata (``saved``: key -> storage
        metadata, keys without the ``extra.lowcomm.`` prefix): empty tensors of the saved
        shapes on this rank's device, None for plain values. One-line refusals."""
        shared, worker, rank = self._scopes()
        sharded, _, per_worker = self._layout()
        scopes = {k.split("/", 1)[0] for k in saved}
        foreign = sorted(s for s in scopes if not _SCOPE.fullmatch(s))
        if foreign:
            raise ValueError(f"lowcomm: the checkpoint holds low-communication state in another format "
                             f"({foreign[0]!r}, e.g. an older meshfold's pickled per-rank blob), which is not loaded; "
                             f"start the low-communication state fresh from another checkpoint")
        saved_workers = {s.split(".")[0] for s in scopes if s.startswith("w")}
        if len(saved_workers) != (self.workers if self.workers > 1 else 0):
            raise ValueError(f"lowcomm: the checkpoint holds {len(saved_workers) or 1} worker(s)' state, this run has "
                             f"{self.workers}; each worker's own replica cannot be split or merged: resume with "
                             f"lowcomm.workers = {len(saved_workers) or 1}")
        saved_sharded = any(s.startswith("s") or ".s" in s for s in scopes)
        if saved_sharded != sharded or (sharded and shared not in scopes):
            raise ValueError("lowcomm: the outer state was saved with a different sharding of the model inside each "
                             "worker (FSDP/TP); resume with the same [parallel] layout inside the workers")
        ranks = sorted(int(s[1:]) for s in scopes if s.startswith("r"))
        want = {shared, worker}
        if ranks:
            if len(ranks) == self._world() and rank in scopes:
                want.add(rank)
            elif sharded:
                raise ValueError(f"lowcomm: error feedback was saved by {len(ranks)} ranks of a sharded model; "
                                 f"resume with the same [parallel] layout")
            else:
                want |= {f"r{r}" for r in ranks}  # averaged in load_state_dict
        device = self._device()
        out = {}
        for key, md in saved.items():
            if key.split("/", 1)[0] not in want:
                continue
            size = getattr(md, "size", None)
            if size is None:
                out[key] = None
            else:
                out[key] = torch.empty(tuple(size), dtype=md.properties.dtype, device=device)
        return out

    def load_state_dict(self, sd: dict) -> None:
        rank_scopes = {k.split("/", 1)[0] for k in sd if k.startswith("r")}
        local: dict = {}
        rank_parts: dict[str, list] = {}
        for key, value in sd.items():
            scope, rest = key.split("/", 1)
            if len(rank_scopes) > 1 and scope in rank_scopes:
                rank_parts.setdefault(rest, []).append(value)
            else:
                local[rest] = value
        for rest, values in rank_parts.items():  # saved at another data-parallel size: the mean
            local[rest] = torch.stack(values).mean(0) if torch.is_tensor(values[0]) else values[0]
        self.load_local_state(unflatten_state(local))

    def _world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1

    def _device(self) -> torch.device:
        for _, p in self._named():
            return p.device
        return torch.device("cpu")


# ------------------------------------------------------------------ checkpoint helpers

_SCOPE = re.compile(r"all|s\d+|w\d+(\.s\d+)?|r\d+")
_EMPTY_DICT, _EMPTY_LIST = "__meshfold_empty_dict__", "__meshfold_empty_list__"


def flatten_state(tree, prefix: str = "") -> dict:
    """Nested dicts/lists/tuples -> {"a/b/#0": leaf}: one level of string keys that DCP
    stores as they are (model names keep their dots); list items become "#i"; empty
    containers become marker strings (DCP would drop them)."""
    out = {}
    if isinstance(tree, dict):
        if not tree:
            out[prefix.rstrip("/")] = _EMPTY_DICT
        for k, v in tree.items():
            k = str(k)
            if "/" in k or k.startswith("#"):
                raise ValueError(f"state key {k!r} cannot be stored (contains '/' or starts with '#')")
            out.update(flatten_state(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        if not tree:
            out[prefix.rstrip("/")] = _EMPTY_LIST
        for i, v in enumerate(tree):
            out.update(flatten_state(v, f"{prefix}#{i}/"))
    else:
        out[prefix.rstrip("/")] = tree
    return out


def unflatten_state(flat: dict):
    root: dict = {}
    for key, value in flat.items():
        node = root
        parts = key.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, str) and value in (_EMPTY_DICT, _EMPTY_LIST):
            value = {} if value == _EMPTY_DICT else []
        node[parts[-1]] = value

    def lists(node):
        if not isinstance(node, dict):
            return node
        node = {k: lists(v) for k, v in node.items()}
        if node and all(k.startswith("#") for k in node):
            return [node[f"#{i}"] for i in range(len(node))]
        return node

    return lists(root)


def outer_group(dims):
    """A process group of its own linking rank i of every worker (the mesh's "worker"
    dimension). Not the mesh's group: when workers span the whole world DeviceMesh reuses
    the default group, and streaming/co2 exchanges run on a background thread, which must
    never share a group with the main thread's collectives (checkpoints, stragglers)."""
    import torch.distributed as dist

    mine = None
    for members in dims.rank_lists("worker"):  # every rank creates every group, in the same order
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


def build_lowcomm(cfg: Config, parts) -> LowComm | None:
    """The ``[lowcomm]`` feature of a run (registered in ``train/registry.py``), or None when
    it uses neither an outer optimizer nor gradient compression."""
    lc = cfg.lowcomm
    if lc.method == "none" and lc.compression == "none":
        return None
    return LowComm(cfg, parts.dims, parts.rank, len(parts.data.train), build_compression(lc))
