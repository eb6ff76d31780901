"""Live recovery (``train.live_recovery = true``; docs/resilience.md): replica groups that
drop out and rejoin while the others keep training, without a restart of the job and
without reading a checkpoint.

Each of the ``parallel.dp_replicate`` replica groups is a failure domain and a world of
its own: its processes form their own default process group (its inner layout: dp_shard,
tp, pp, cp) and are restarted alone by their own elastic agent (``launch.py``). Rank j of
every replica group holds the same pieces of the model, so the replica dimension is a
*standalone* group per inner rank (``train/abortable.py``: aborted on its own timeout),
rebuilt from a shared store whenever the quorum changes. The quorum (which replicas train a step, who heals whom) comes
from the job's Lighthouse (``train/quorum.py``), asked by each replica's rank 0 at every
step boundary; its heartbeat thread beats while the replica makes progress.

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
   among themselves (nothing was applied: no step is counted twice, no sequence lost);
5. ``claim``: the commit fence (``train/live_fence.py``) lets only one quorum apply each
   step, whatever quorums the Lighthouse forms (a stale replica answered alone waits).

Data guarantee: **exactly once** per step. Every optimizer step trains the whole global
batch of that step; a failure only changes who trains which slice.

DiLoCo and Streaming DiLoCo workers (``lowcomm.workers``) as failure domains: the quorum is
asked at the outer exchanges only (``train/live_outer.py``); a restarted worker receives the
outer state too. Data there: **at most once** (a lost worker's progress since its last
exchange is lost with it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.data.dataset import make_sampler
from meshfold.lowcomm.feature import WorkerSampler
from meshfold.lowcomm.outer import local_tensor
from meshfold.train.abortable import AbortableGroup
from meshfold.train.fault import set_restart_note
from meshfold.train.live_drill import Faults
from meshfold.train.live_fence import CommitFence
from meshfold.train.live_outer import OuterLive
from meshfold.train.live_watch import PeerWatch, WatchedGroup, destroy, store_client
from meshfold.train.quorum import LighthouseLost, Membership
from meshfold.train.stop import StopAtBoundary

if TYPE_CHECKING:
    from meshfold.config import Config

ENV_REPLICA = "MESHFOLD_LIVE_REPLICA"  # this process's replica group (set by the launcher)
ENV_REPLICAS = "MESHFOLD_LIVE_REPLICAS"
ENV_LIGHTHOUSE = "MESHFOLD_LIVE_LIGHTHOUSE"  # host:port of the job's Lighthouse (train/quorum.py)
ENV_STORE = "MESHFOLD_LIVE_STORE"  # host:port of the store the standalone groups meet through
ENV_HOST = "MESHFOLD_LIVE_HOST"  # the address launch_live serves the Lighthouse and the store at (127.0.0.1)
ENV_TRACE = "MESHFOLD_LIVE_TRACE"  # 1: each rank appends what it trained and a parameter digest


class LiveStepFailed(RuntimeError):
    """A member of the quorum was lost during the step: train it again with a new quorum."""


def replica_count(cfg: Config) -> int:
    """The failure domains: the DiLoCo workers, else the data-parallel replica groups."""
    return cfg.lowcomm.workers if cfg.lowcomm.workers > 1 else cfg.parallel.dp_replicate


def replica_env() -> tuple[int, int] | None:
    """(this process's replica group, the configured number), when launched as a live replica."""
    if ENV_REPLICA not in os.environ:
        return None
    return int(os.environ[ENV_REPLICA]), int(os.environ[ENV_REPLICAS])


def replica_config(cfg: Config, replica: int) -> Config:
    """What one replica group runs: its inner layout (``dp_replicate = 1``) and one slice of
    the global batch; only replica 0 writes checkpoints (they are all equal). A restarted
    replica resumes from the newest one like any replica (``train.resume``): when every group
    was lost, that is where the job goes on; otherwise a healthy replica's newer state is then
    received live (the heal)."""
    out = copy.deepcopy(cfg)
    if cfg.lowcomm.workers > 1:  # DiLoCo: train.global_batch is per worker already
        out.lowcomm.workers = 1
    else:
        out.parallel.dp_replicate = 1
        out.train.global_batch = cfg.train.global_batch // cfg.parallel.dp_replicate
    out.data.prefetch = 0  # which slices this replica trains is known only once the quorum is
    out.live_replica = True  # config.validate_live: one replica group's own layout
    if replica != 0:
        out.train.checkpoint_every = 0
    return out


def digest(tensors) -> str:
    """A short SHA-1 of the tensors' bytes (bitwise comparisons across processes)."""
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
    """metrics.jsonl is written by the rank 0 of each step quorum's source (its lowest replica at the newest step)."""

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

    name = "live"  # checkpoint key: the lineage of the saved state (``state_dict``; live_fence.py)
    # The run directory: replica groups share it; the launcher holds its lock
    # (live_launch.py) and a restarted replica heals from a peer, not from disk.
    holds_run_lock = False
    # The fp32 parameters and the optimizer state are healed between steps: ZeRO-1 keeps its fp32 gather.
    touches_master_weights = True

    def __init__(self, cfg: Config, replica: int, replicas: int, device: torch.device, train_data, progress):
        self.cfg, self.replica, self.replicas = cfg, replica, replicas
        self.device, self.train_data, self.progress = device, train_data, progress
        self.checks_resume = cfg.train.resume != "never"
        self.writes_run_files = replica == 0  # run.json and config.toml: written once per run
        self.parts: list = []
        self.rank, self.world = dist.get_rank() if dist.is_initialized() else 0, (
            dist.get_world_size() if dist.is_initialized() else 1)
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.client = None
        self.timeout_s = cfg.train.collective_timeout_s
        self.quorum: dict = {}
        self.epoch = -1  # the lineage of this replica's state (live_fence.py; in checkpoints): -1 none yet
        self.fence: CommitFence | None = None
        self.group: comm.StandaloneGroup | None = None
        self.members: list[int] = []
        self.writes_metrics = False
        self.events: list[dict] = []
        self.sampler: LiveSampler | None = None
        self.optimizer = self.scheduler = None
        self.redo_cause: str | None = None
        self.trace = os.environ.get(ENV_TRACE) == "1"
        self.faults = Faults(replica, self.rank, self.attempt, cfg.train.run_dir)  # drills (live_drill.py)
        self.healed_bytes = 0
        self.outer = None
        self.outer_live: OuterLive | None = None  # DiLoCo workers: the outer exchange over the quorum
        self.pending_heal: dict | None = None

    def attach(self, parts) -> None:
        """Once the model exists: this rank's model parts, the Lighthouse and the beats."""
        self.parts = parts.model_parts
        t = self.cfg.train
        self.progress_mark = time.monotonic()
        self.beats = PeerWatch(os.environ[ENV_STORE], self.replica, self.replicas, self.rank, self.attempt,
                               t.live_heartbeat_timeout_s, self._alive, self.world)
        if self.rank == 0:  # one hung rank of the group stops its Lighthouse heartbeat (live_watch.replica_alive)
            # a replica silent for the collective timeout is taken for gone by the commit fence
            self.fence = CommitFence(store_client(os.environ[ENV_STORE], self.timeout_s), self.replica,
                                     self.replicas, self.attempt, self.beats.beat, self.timeout_s,
                                     lambda d: self.next_commit(d["step"], int(d["meta"].get("fragment", 0))),
                                     self.commit_label)
            self.client = Membership(os.environ[ENV_LIGHTHOUSE], self.replica, self.replicas, self.attempt,
                                     t.live_heartbeat_timeout_s, Path(t.run_dir) / "live-done.json", t.steps,
                                     t.live_rejoin_wait_s, alive=lambda: self._alive() and self.beats.replica_alive(),
                                     settle=self.fence.settle)
        # DiLoCo workers as failure domains: the quorum is formed at the outer steps only and
        # the outer gradient is averaged over the workers that trained the phase.
        lowcomm = parts.features.named("lowcomm")
        self.outer = lowcomm.outer if lowcomm is not None and lowcomm.outer is not None else None
        if self.outer is not None:
            self.outer_live = OuterLive(self, self.outer)

    def _alive(self) -> bool:
        """The heartbeat's condition: the training loop came back to this replica's code
        within the collective timeout (a hung step stops the heartbeat)."""
        return time.monotonic() - self.progress_mark < self.timeout_s

    # ------------------------------------------------------------------ feature hooks

    def wrap_sampler(self, sampler):
        t = self.cfg.train
        if self.outer is not None:  # worker w's slice of the W x B batch, as without live recovery
            self.sampler = WorkerSampler(len(self.train_data), t.global_batch, self.replicas, self.replica, t.seed)
            return self.sampler
        self.sampler = LiveSampler(make_sampler(self.train_data, t.global_batch * self.replicas, t.seed),
                                   self.replicas)
        return self.sampler

    def state_dict(self) -> dict:
        """What a checkpoint records of live recovery: its state's lineage (a replica restarted
        from it is weighed by its step within that lineage: ``quorum.decide``)."""
        return {"epoch": self.epoch}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch = int(sd["epoch"])

    def wrap_optimizer(self, optimizer, scheduler):
        self.optimizer, self.scheduler = optimizer, scheduler
        return optimizer, scheduler

    def wrap_logger(self, logger):
        return _Writer(logger, self)

    def after_step(self, step: int) -> dict:
        self.progress_mark = time.monotonic()
        if self.pending_heal is not None:  # DiLoCo: after the outer step, the joiners receive it
            self._heal(self.pending_heal)
            self.pending_heal = None
        if self.outer_live is not None:
            self.outer_live.after_step(step)  # train.live_replay_phase: this worker's phase start
        trainers = self.outer_live.trainers if self.outer_live is not None else None
        out = {"replicas": trainers if trainers is not None else len(self.members)}
        if self.outer_live is not None:
            self.outer_live.trainers = None
        if self.events and self.writes_metrics:
            out["events"] = self.events
        self.events = []
        if self.trace:
            self._trace(step)
        return out

    # ------------------------------------------------------------------ the step

    def wrap_step(self, train_step):
        return lambda: self.step(train_step)

    def step(self, train_step):
        """Run ``train_step`` (the trainer's step, which calls ``reduce``) until a quorum
        commits it."""
        if self.outer_live is not None:
            if self.outer_live.lost is not None:  # lost during the last exchange, which finished alone
                self._lighthouse_lost(self.outer_live.lost)
            if not self.members:  # the start, or a restarted worker: join at the next outer exchange
                try:
                    self.outer_live.join()
                except LighthouseLost as err:
                    self._lighthouse_lost(err)
            return train_step()
        while True:
            try:
                self._begin()
            except LighthouseLost as err:
                self._lighthouse_lost(err)
            except LiveStepFailed as err:  # a member lost while the quorum's group formed or in the heal:
                self.beats.abandoned = True  # ask again (nothing of this step was drawn or applied yet)
                self.redo_cause = str(err)
                continue
            try:
                return train_step()
            except LiveStepFailed as err:
                self.beats.abandoned = True  # tells the peers still waiting in this exchange (live_watch)
                self.redo_cause = str(err)
                for part in self.parts:
                    part.zero_grad(set_to_none=True)
                self.sampler.redo = True

    def _lighthouse_lost(self, err: LighthouseLost) -> None:
        """Nothing decides membership any more: every group stops at this step boundary (replica 0
        writes the checkpoint; ``StopAtBoundary``: exit ``EXIT_STOPPED``, one line) and a restart of
        the job resumes. The group's elastic agent is told to stop (SIGTERM, as on a user's stop:
        it gives its workers ``STOP_GRACE_S`` to finish), not to restart the group into the
        same loss."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent passes its SIGTERM on: already stopping
        if os.environ.get("LOCAL_RANK") == "0" and "TORCHELASTIC_RESTART_COUNT" in os.environ:
            os.kill(os.getppid(), signal.SIGTERM)
        raise StopAtBoundary(str(err)) from err

    def _ask(self) -> dict:
        """Rank 0 asks the Lighthouse; every rank of the replica gets the answer."""
        reply = None
        self.progress_mark = time.monotonic()
        if self.rank == 0:
            position = getattr(self.sampler, "boundary_state", self.sampler.state_dict)()
            meta = {"sampler": position, "scheduler": _plain(self.scheduler.state_dict()),
                    "outer_steps": self.outer.outer_steps if self.outer is not None else 0,
                    "fragment": self.outer_live.fragment if self.outer_live is not None else 0,
                    "group": self.quorum.get("quorum_id"),  # kept only if every member holds it (quorum.group_key)
                    "epoch": self.epoch}
            try:
                reply = self.client.quorum(self.progress.step, meta, self.redo_cause)
            except LighthouseLost as err:
                reply = {"lost": str(err)}
        if self.world > 1:
            reply = comm.broadcast_object(reply, 0)
        self.progress_mark = time.monotonic()
        self.faults.at(self.progress.step + 1, "quorum")
        if "lost" in reply:
            raise LighthouseLost(reply["lost"])
        return reply

    def _begin(self) -> None:
        q = self._ask()
        good, error = self._take(q)
        if not good:
            raise LiveStepFailed(error)
        if q["heal"]:
            self._heal(q)
        me = self.members.index(self.replica)
        self.sampler.slices = [i for i in range(self.replicas) if i % len(self.members) == me]
        self.writes_metrics = self.rank == 0 and self.replica == self.quorum["source"]  # up to date: it knows the events

    def _take(self, q: dict) -> tuple[bool, str]:
        """``_apply(q)``; a new group is voted on: every rank of this replica agrees it formed
        (a member may have died since the quorum)."""
        if q.get("done") or q["quorum_id"] == self.quorum.get("quorum_id"):
            self._apply(q)
            good, error = True, ""
        else:
            good, error = self._agreed(lambda: self._apply(q))
        if good and self.replica not in q["heal"]:  # up to date: its state is the quorum's lineage now
            self.epoch = q["epoch"]
        return good, error

    def _apply(self, q: dict) -> None:
        """Take a quorum's answer: the standalone group of its members, the events."""
        if q.get("done"):  # restarted after the others finished: nothing is left to train
            if self.rank == 0:
                print(f"meshfold: replica {self.replica}: the run finished at step {q['step']} while this group "
                      "was restarting; nothing left to train", flush=True)
            raise SystemExit(0)
        self.redo_cause = None
        self.events.extend(q.get("events", []))
        if q["quorum_id"] != self.quorum.get("quorum_id"):
            if self.group is not None:
                self.group.abort()
                threading.Thread(target=destroy, args=(self.group,), daemon=True, name="meshfold-group-close").start()
            self.group = None
            self.quorum, self.members = q, q["members"]
            self.beats.enter(q["quorum_id"], q["members"], q.get("attempts"))
            if len(q["members"]) > 1:
                # Watched (a member may be gone); one store client per group: a rendezvous abandoned
                # for a lost member keeps its own connection blocked until its timeout.
                store = dist.PrefixStore(f"live/q{q['quorum_id']}/s{self.rank}",
                                         store_client(os.environ[ENV_STORE], self.timeout_s))
                self.group = self.beats.build(lambda: AbortableGroup(
                    store, q["members"].index(self.replica), len(q["members"]), self.timeout_s, self.device.type))
                self.group.pg = WatchedGroup(self.group.pg, self.beats.wait)
        self.beats.enter(q["quorum_id"], q["members"], q.get("attempts"))
        self.quorum, self.members = q, q["members"]
        self.writes_metrics = self.rank == 0 and self.replica == self.quorum["source"]  # up to date: it knows the events

    def _agreed(self, fn) -> tuple[bool, str]:
        """``fn()`` (a new group's rendezvous, a heal's transfer), then this replica's vote on it."""
        ok, error = torch.ones((), dtype=torch.int64, device=self.device), ""
        try:
            fn()
        except RuntimeError as err:  # a member lost: the watch, gloo's closed connection, NCCL's abort
            ok.zero_()
            error = str(err).splitlines()[0][:200]
        return self._vote(ok, error)

    def _vote(self, ok: torch.Tensor, error: str) -> tuple[bool, str]:
        """Every rank of this replica group agrees whether its exchange succeeded (one
        all-reduce over its own, healthy, world); on failure, what the ranks that saw it saw."""
        if self.world > 1:
            comm.all_reduce(ok, None, None, op="min")
        if int(ok) == 1:
            return True, ""
        if self.world > 1:  # the failure path only
            seen = [e for e in comm.all_gather_object(error) if e]
            error = seen[0] if seen else error
        return False, (f"replica {self.replica} lost its cross-replica exchange in step "
                       f"{self.progress.step + 1}: {error}")

    # ------------------------------------------------------------------ healing

    def _state_tensors(self):
        """Parameters, then each parameter's optimizer state, in one fixed order."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        out = [local_tensor(p) for p in params]
        for p in params:
            st = self.optimizer.state.get(p, {})
            out.extend(local_tensor(st[k]) for k in sorted(st) if torch.is_tensor(st[k]))
        if self.outer is not None:  # DiLoCo's global copy, outer momentum, pending results
            out.extend(self.outer.heal_tensors())
        return params, out

    def create_optimizer_state(self) -> None:
        """The optimizer's state (shapes, keys), when it has none yet, with one zero-gradient
        step: before a state is copied into it (every value is overwritten)."""
        params, _ = self._state_tensors()
        if any(not self.optimizer.state.get(p) for p in params):
            with torch.enable_grad():
                for p in params:
                    p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def _heal(self, q: dict) -> None:
        """The members behind receive the state of ``q['source']`` (a broadcast on the
        standalone group; members already up to date take part as senders or bystanders)."""
        start = time.perf_counter()
        behind = self.replica in q["heal"]
        if behind:
            self.create_optimizer_state()
        src = q["members"].index(q["source"])
        sent = 0

        def transfer():
            nonlocal sent
            self.beats.watching = True  # a member lost mid-heal: every member asks again (the vote)
            try:
                if self.outer_live is not None:  # what is pending decides which tensors follow
                    self.outer_live.heal_schedule(behind, src)
                _, tensors = self._state_tensors()
                for t in tensors:
                    buf = t.to(self.device, copy=True)  # e.g. Adam's step counter lives on the host
                    comm.group_broadcast(buf, src, self.group, "live")
                    if behind:
                        t.copy_(buf)
                    sent += buf.numel() * buf.element_size()
                    self.faults.at(self.progress.step + 1, "heal")
            finally:
                self.beats.watching = False
        good, error = self._agreed(transfer)
        if not good and behind:  # its state is part old, part received: only a restart makes it whole again
            raise RuntimeError(f"meshfold: replica {self.replica}: the heal from replica {q['source']} failed midway "
                               f"({error}); its state is partial, so its group restarts and rejoins")
        if not good:
            raise LiveStepFailed(error)
        if behind:
            meta = q["meta"]
            self.sampler.load_state_dict(meta["sampler"])
            self.scheduler.load_state_dict(meta["scheduler"])
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
            self.progress.step, self.epoch = q["step"], q["epoch"]
            if self.outer_live is not None:
                self.outer_live.received_state(q["step"])
            if self.trace:
                self._trace(q["step"], healed=True)
            self.events.append({"event": "healed", "replica": self.replica, "step": q["step"] + 1,
                                "cause": f"received {sent} bytes of model and optimizer state from replica "
                                         f"{q['source']} in {time.perf_counter() - start:.3f} s (rank {self.rank})"})
        self.healed_bytes += sent

    # ------------------------------------------------------------------ reduce

    def reduce(self, loss_sum: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Across the members: gradients weighted by each replica's tokens, the loss sum and
        the tokens; then the replica's vote. Returns (loss sum, tokens) over the members.
        Raises ``LiveStepFailed`` when a member was lost (every rank of this replica agrees)."""
        self.faults.at(self.progress.step + 1)
        if self.outer is not None:  # DiLoCo: nothing crosses the workers between outer steps
            return loss_sum, tokens
        grads = [local_tensor(p.grad) for part in self.parts for p in part.parameters() if p.grad is not None]
        ok = torch.ones((), dtype=torch.int64, device=self.device)
        error = ""
        if self.group is not None:
            try:
                self.beats.watching = True  # a peer lost here only costs a redo: judge it by its heartbeat
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
            finally:
                self.beats.watching = False
        good, error = self._vote(ok, error)
        if not good:
            raise LiveStepFailed(error)
        good, error = self.claim()
        if not good:
            raise LiveStepFailed(error)
        return loss_sum, tokens

    def claim(self) -> tuple[bool, str]:
        """The commit fence's claim on what the current quorum commits (rank 0, live_fence.py):
        the step being trained, or DiLoCo's outer exchange; agreed by every rank of the replica.
        A quorum that lost the claim applies nothing and asks again."""
        ordinal = self.next_commit(self.quorum["step"], self.outer_live.fragment if self.outer_live else 0)
        claimed = self.rank != 0 or self.fence.claim(self.epoch, ordinal, self.quorum["quorum_id"])
        ok = torch.full((), int(claimed), dtype=torch.int64, device=self.device)
        return self._vote(ok, "" if claimed else f"{self.commit_label(ordinal)} was committed by another "
                                                 "quorum meanwhile (the commit fence)")

    def next_commit(self, step: int, fragment: int) -> int:
        """The commit fence's ordinal of what a quorum at ``step`` commits: the next step, or
        (DiLoCo workers) the outer exchange of ``fragment`` at that step."""
        return step + 1 if self.outer_live is None else step * len(self.outer.phi) + fragment

    def commit_label(self, ordinal: int) -> str:
        if self.outer_live is None:
            return f"step {ordinal}"
        step, fragment = divmod(ordinal, len(self.outer.phi))
        return f"the outer exchange of fragment {fragment} at step {step}"

    # ------------------------------------------------------------------ inspection

    def _trace(self, step: int, healed: bool = False) -> None:
        path = Path(self.cfg.train.run_dir) / f"live-trace-r{self.replica}-rank{self.rank}.jsonl"
        params = [local_tensor(p) for part in self.parts for p in part.parameters()]
        rec = {"step": step, "healed": healed, "replica": self.replica, "attempt": self.attempt, "members": self.members,
               "slices": getattr(self.sampler, "slices", [self.replica]), "params": digest(params),
               "indices": self.sampler.trained.tolist() if getattr(self.sampler, "trained", None) is not None else None}
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self.client is not None:
            self.client.bye(self.progress.step)
        self.beats.close()


def _plain(sd: dict) -> dict:
    """A scheduler's state as JSON values (LambdaLR's functions are not in it)."""
    return json.loads(json.dumps(sd, default=lambda _: None))


def replica_restart_note(done: int, allowed: int) -> str:
    """What follows a worker's end under live recovery (``fault.after_worker_loss``)."""
    if done < allowed:
        return (f"its replica group's agent restarts the group (restart {done + 1} of {allowed}), which rejoins "
                "the running groups from a peer; the others train on")
    return f"this replica group has no restart left ({allowed} used); the other groups train on without it"


def build_live(cfg: Config, parts) -> LiveReplicas | None:
    """The live-recovery feature of a replica group's process (registered in
    ``train/registry.py``), or None (not a live replica)."""
    env = replica_env()
    if not cfg.train.live_recovery or env is None:
        return None
    set_restart_note(replica_restart_note)  # a lost peer restarts this replica group, not the job
    return LiveReplicas(cfg, env[0], env[1], parts.device, parts.data.train, parts.progress)
