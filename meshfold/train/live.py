"""Live recovery (``train.live_recovery = true``; docs/resilience.md): replica groups that
drop out and rejoin while the others keep training, without a restart of the job and
without reading a checkpoint.

Each of the ``parallel.dp_replicate`` replica groups is a failure domain and a world of
its own: its processes form their own default process group (its inner layout: dp_shard,
tp, pp, cp) and are restarted alone by their own elastic agent (``launch.py``). Rank j of
every replica group holds the same pieces of the model, so the replica dimension is a
*standalone* group per inner rank (``comm.StandaloneGroup``), rebuilt from a shared store
whenever the quorum changes. The quorum (which replicas train a step, who heals whom) comes
from the job's quorum server (``train/quorum.py``), asked by each replica's rank 0 at
every step boundary.

One step (``LiveReplicas.step``):

1. quorum: members, and the members that are behind (a restarted replica); those receive
   parameters, optimizer state, scheduler and sampler position from the lowest member at
   the newest step (a broadcast on the standalone groups: live, never from disk);
2. the global batch of the step (the same ``train.global_batch`` sequences as a run without
   failures) is cut into one slice per configured replica; slice i is trained by member
   ``i mod P`` of the P members, so every sequence of the step is trained exactly once
   whoever is there;
3. forward/backward inside the replica as usual (loss scaled by this replica's tokens);
4. ``reduce``: across the members, the sum of (gradient x tokens) and of tokens, then
   divided: the gradient of the mean loss over exactly the tokens trained; then every rank
   of the replica votes (one all-reduce over its own world) whether its exchange
   succeeded. A member lost in the middle of the step makes the vote fail: the survivors
   drop the step's gradients, ask for a new quorum and train the same global batch again
   among themselves (nothing was applied: no step is counted twice, no sequence lost).

Data guarantee: **exactly once** per step. Every optimizer step trains the whole global
batch of that step; a failure only changes who trains which slice.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.data.dataset import make_sampler
from meshfold.train.quorum import QuorumClient

if TYPE_CHECKING:
    from meshfold.config import Config

ENV_REPLICA = "MESHFOLD_LIVE_REPLICA"  # this process's replica group (set by the launcher)
ENV_REPLICAS = "MESHFOLD_LIVE_REPLICAS"
ENV_QUORUM = "MESHFOLD_LIVE_QUORUM"  # host:port of the quorum server
ENV_STORE = "MESHFOLD_LIVE_STORE"  # host:port of the store the standalone groups meet through
ENV_KILL = "MESHFOLD_LIVE_KILL"  # fault injection (tests, drills): "REPLICA:RANK:STEP" -> SIGKILL itself
ENV_TRACE = "MESHFOLD_LIVE_TRACE"  # 1: each rank appends what it trained and a parameter digest


class LiveStepFailed(RuntimeError):
    """A member of the quorum was lost during the step: train it again with a new quorum."""


def replica_count(cfg: Config) -> int:
    return cfg.parallel.dp_replicate


def replica_env() -> tuple[int, int] | None:
    """(this process's replica group, the configured number), when launched as a live replica."""
    if ENV_REPLICA not in os.environ:
        return None
    return int(os.environ[ENV_REPLICA]), int(os.environ[ENV_REPLICAS])


def replica_config(cfg: Config, replica: int, attempt: int) -> Config:
    """What one replica group runs: its inner layout (``dp_replicate = 1``) and one slice of
    the global batch; only replica 0 writes checkpoints (they are all equal); a restarted
    replica never reads one (it receives the state from a healthy replica)."""
    out = copy.deepcopy(cfg)
    replicas = cfg.parallel.dp_replicate
    out.parallel.dp_replicate = 1
    out.train.global_batch = cfg.train.global_batch // replicas
    out.data.prefetch = 0  # which slices this replica trains is known only once the quorum is
    if replica != 0:
        out.train.checkpoint_every = 0
    if attempt > 0:
        out.train.resume, out.train.init_from = "never", ""
    return out


def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class LiveSampler:
    """The run's global batches (``train.global_batch`` per step, the sequence a run without
    failures draws), of which this replica takes the slices the quorum assigns it."""

    def __init__(self, base, replicas: int):
        self.base, self.replicas = base, replicas
        self.slices: list[int] = [0]
        self.current = None
        self.before: dict | None = None
        self.redo = False
        self.trained = None

    def next(self) -> torch.Tensor:
        if not self.redo or self.current is None:
            self.before = self.base.state_dict()
            self.current = self.base.next()
        self.redo = False
        size = self.current.shape[0] // self.replicas
        self.trained = torch.cat([self.current[i * size:(i + 1) * size] for i in self.slices])
        return self.trained

    def boundary_state(self) -> dict:
        """The position at the step boundary (before a batch drawn for a step being redone)."""
        return self.before if self.redo and self.before is not None else self.base.state_dict()

    def state_dict(self) -> dict:
        return self.boundary_state()

    def load_state_dict(self, sd: dict) -> None:
        self.base.load_state_dict(sd)
        self.current, self.redo = None, False


class _Writer:
    """metrics.jsonl is written by the rank 0 of the lowest replica in each step's quorum."""

    def __init__(self, logger, live: "LiveReplicas"):
        self.logger, self.live = logger, live

    def log(self, record: dict) -> None:
        if self.live.writes_metrics:
            self.logger.log(record)

    def __getattr__(self, name):
        return getattr(self.logger, name)


class LiveReplicas:
    """The live-recovery feature (``train/feature.py``): ``wrap_sampler``, ``wrap_optimizer``
    (to reach the optimizer and scheduler it heals), ``wrap_logger``, ``after_step``
    (``replicas``, ``events``), and the step protocol (``step``, ``reduce``)."""

    name = None

    def __init__(self, cfg: Config, replica: int, replicas: int, model_parts, device: torch.device,
                 train_data, progress):
        self.cfg, self.replica, self.replicas = cfg, replica, replicas
        self.parts, self.device, self.train_data, self.progress = model_parts, device, train_data, progress
        self.rank, self.world = dist.get_rank() if dist.is_initialized() else 0, (
            dist.get_world_size() if dist.is_initialized() else 1)
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.client = QuorumClient(os.environ[ENV_QUORUM], replica, self.attempt) if self.rank == 0 else None
        host, port = os.environ[ENV_STORE].rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=cfg.train.collective_timeout_s))
        self.timeout_s = cfg.train.collective_timeout_s
        self.quorum: dict = {}
        self.group: comm.StandaloneGroup | None = None
        self.groups_made: list = []  # old groups kept alive: a dead peer's pairs close with the job
        self.members: list[int] = []
        self.writes_metrics = False
        self.events: list[dict] = []
        self.sampler: LiveSampler | None = None
        self.optimizer = self.scheduler = None
        self.redo_cause: str | None = None
        self.trace = os.environ.get(ENV_TRACE) == "1"
        self.kill = self._parse_kill(os.environ.get(ENV_KILL, ""))
        self.healed_bytes = 0

    def _parse_kill(self, text: str):
        if not text or self.attempt > 0:
            return None
        r, rank, step = (int(x) for x in text.split(":"))
        return step if (r, rank) == (self.replica, self.rank) else None

    # ------------------------------------------------------------------ feature hooks

    def wrap_sampler(self, sampler):
        t = self.cfg.train
        self.sampler = LiveSampler(make_sampler(self.train_data, t.global_batch * self.replicas, t.seed),
                                   self.replicas)
        return self.sampler

    def wrap_optimizer(self, optimizer, scheduler):
        self.optimizer, self.scheduler = optimizer, scheduler
        return optimizer, scheduler

    def wrap_logger(self, logger):
        return _Writer(logger, self)

    def after_step(self, step: int) -> dict:
        out = {"replicas": len(self.members)}
        if self.events and self.writes_metrics:
            out["events"] = self.events
        self.events = []
        if self.trace:
            self._trace(step)
        return out

    # ------------------------------------------------------------------ the step

    def step(self, train_step):
        """Run ``train_step`` (the trainer's step, which calls ``reduce``) until a quorum
        commits it."""
        while True:
            self._begin()
            try:
                return train_step()
            except LiveStepFailed as err:
                self.redo_cause = str(err)
                for part in self.parts:
                    part.zero_grad(set_to_none=True)
                self.sampler.redo = True

    def _ask(self) -> dict:
        """Rank 0 asks the quorum server; every rank of the replica gets the answer."""
        reply = None
        if self.rank == 0:
            meta = {"sampler": self.sampler.boundary_state(), "scheduler": _plain(self.scheduler.state_dict()),
                    "attempt": self.attempt}
            reply = self.client.quorum(self.progress.step, meta, self.redo_cause)
        if self.world > 1:
            reply = comm.broadcast_object(reply, 0)
        return reply

    def _begin(self) -> None:
        q = self._ask()
        if q.get("done"):  # restarted after the others finished: nothing is left to train
            if self.rank == 0:
                print(f"meshfold: replica {self.replica}: the run finished at step {q['step']} while this group "
                      "was restarting; nothing left to train", flush=True)
            raise SystemExit(0)
        self.redo_cause = None
        if q["quorum_id"] != self.quorum.get("quorum_id"):
            if self.group is not None:
                self.group.abort()
                self.groups_made.append(self.group)
            self.group = None
            if len(q["members"]) > 1:
                key = f"live/q{q['quorum_id']}/s{self.rank}"
                self.group = comm.StandaloneGroup(dist.PrefixStore(key, self.store), q["members"].index(self.replica),
                                                  len(q["members"]), self.timeout_s, self.device.type)
        self.quorum, self.members = q, q["members"]
        self.events.extend(q.get("events", []))
        if q["heal"]:
            self._heal(q)
        me = self.members.index(self.replica)
        self.sampler.slices = [i for i in range(self.replicas) if i % len(self.members) == me]
        self.writes_metrics = self.rank == 0 and self.replica == self.members[0]

    # ------------------------------------------------------------------ healing

    def _state_tensors(self):
        """Parameters, then each parameter's optimizer state, in one fixed order."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        out = [comm_local(p) for p in params]
        for p in params:
            st = self.optimizer.state.get(p, {})
            out.extend(comm_local(st[k]) for k in sorted(st) if torch.is_tensor(st[k]))
        return params, out

    @torch.no_grad()
    def _heal(self, q: dict) -> None:
        """The members behind receive the state of ``q['source']`` (a broadcast on the
        standalone group; members already up to date take part as senders or bystanders)."""
        start = time.perf_counter()
        behind = self.replica in q["heal"]
        params, _ = self._state_tensors()
        if behind and any(not self.optimizer.state.get(p) for p in params):
            # Create the optimizer's state (shapes, keys) with one zero-gradient step; every
            # value is overwritten below.
            with torch.enable_grad():
                for p in params:
                    p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        _, tensors = self._state_tensors()
        src = q["members"].index(q["source"])
        sent = 0
        for t in tensors:
            buf = t.to(self.device, copy=True)  # e.g. Adam's step counter lives on the host
            comm.group_broadcast(buf, src, self.group, "live")
            if behind:
                t.copy_(buf)
            sent += buf.numel() * buf.element_size()
        if behind:
            meta = q["meta"]
            self.sampler.load_state_dict(meta["sampler"])
            self.scheduler.load_state_dict(meta["scheduler"])
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
            self.progress.step = q["step"]
            self.events.append({"event": "healed", "replica": self.replica, "step": q["step"] + 1,
                                "cause": f"received {sent} bytes of model and optimizer state from replica "
                                         f"{q['source']} in {time.perf_counter() - start:.3f} s (rank {self.rank})"})
        self.healed_bytes += sent

    # ------------------------------------------------------------------ reduce

    def reduce(self, loss_sum: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Across the members: gradients weighted by each replica's tokens, the loss sum and
        the tokens; then the replica's vote. Returns (loss sum, tokens) over the members.
        Raises ``LiveStepFailed`` when a member was lost (every rank of this replica agrees)."""
        if self.kill is not None and self.progress.step + 1 == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: a hard crash mid-step
        grads = [comm_local(p.grad) for part in self.parts for p in part.parameters() if p.grad is not None]
        ok = torch.ones((), dtype=torch.int64, device=self.device)
        error = ""
        if self.group is not None:
            try:
                weight = tokens.to(grads[0].dtype) if grads else None
                flat = torch.cat([g.reshape(-1) for g in grads]) * weight if grads else None
                control = torch.stack([loss_sum.double(), tokens.double()])
                if flat is not None:
                    comm.group_all_reduce(flat, self.group, "live")
                comm.group_all_reduce(control, self.group, None)
                total = control[1].to(flat.dtype) if flat is not None else None
                if flat is not None:
                    flat /= total
                    offset = 0
                    for g in grads:
                        g.copy_(flat[offset:offset + g.numel()].view_as(g))
                        offset += g.numel()
                loss_sum, tokens = control[0], control[1]
            except RuntimeError as err:  # a member died (gloo: connection closed; NCCL: aborted)
                ok.zero_()
                error = str(err).splitlines()[0][:200]
        if self.world > 1:
            comm.all_reduce(ok, None, None, op="min")  # the replica's own world: healthy
        if int(ok) == 0:
            if self.world > 1:  # the failure path only: say what the ranks that saw it saw
                seen = [e for e in comm.all_gather_object(error) if e]
                error = seen[0] if seen else error
            raise LiveStepFailed(f"replica {self.replica} lost its cross-replica exchange in step "
                                 f"{self.progress.step + 1}: {error}")
        return loss_sum, tokens

    # ------------------------------------------------------------------ inspection

    def _trace(self, step: int) -> None:
        path = Path(self.cfg.train.run_dir) / f"live-trace-r{self.replica}-rank{self.rank}.jsonl"
        params = [comm_local(p) for part in self.parts for p in part.parameters()]
        rec = {"step": step, "replica": self.replica, "attempt": self.attempt, "members": self.members,
               "slices": self.sampler.slices, "indices": self.sampler.trained.tolist(), "params": digest(params)}
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self.client is not None:
            self.client.bye(self.progress.step)


def comm_local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (its shard of a DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _plain(sd: dict) -> dict:
    """A scheduler's state as JSON values (LambdaLR's functions are not in it)."""
    return json.loads(json.dumps(sd, default=lambda _: None))


def build_live(cfg: Config, model_parts, device: torch.device, train_data, progress) -> LiveReplicas | None:
    """The live-recovery feature of a replica group's process, or None (not a live replica)."""
    env = replica_env()
    if not cfg.train.live_recovery or env is None:
        return None
    return LiveReplicas(cfg, env[0], env[1], model_parts, device, train_data, progress)
