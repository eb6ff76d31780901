"""Live recovery with DiLoCo or Streaming DiLoCo workers as the failure domains
(``train.live_recovery`` with ``lowcomm.workers > 1``; docs/resilience.md "DiLoCo workers").

Nothing crosses the workers between outer exchanges, so the quorum is asked at the exchanges
only: the outer optimizer's ``mean_fn`` (``lowcomm/outer.py``) is ``OuterLive.mean``, called
inline for each fragment whose outer gradient is due (DiLoCo: the whole model every H steps;
Streaming DiLoCo: fragment p at the steps t with t mod H = offset_p; the overlap of tau steps
is kept as a schedule: the mean is applied at t + tau, as without live recovery). The outer
gradient of a fragment is averaged over the members that trained its phase in full: a member
whose state came from another replica (a live heal, or a resume from replica 0's checkpoint)
at step s adds nothing to a fragment's next exchange unless that fragment was exchanged at s
(``stale``): its own progress on the other fragments started from the peer's, which the peer
sends itself. A restarted worker waits for the others' next exchange, takes part with nothing
to add, then receives the whole state: parameters, inner optimizer, scheduler, sampler, and the
outer state as plain numbers (``OuterOptimizer.schedule``: outer steps, each fragment's pending
due step) then tensors (``heal_tensors``: global copy, outer momentum, pending means), each a
broadcast on the quorum's group, no pickle.

``train.live_replay_phase`` (DiLoCo only): after each committed outer step (θ = φ) every
rank writes its worker's own state (parameters, inner optimizer, φ, outer momentum, outer
steps, sampler and scheduler position) to ``<run_dir>/live-phase/w<worker>-rank<r>.safetensors``
(no pickle). A worker restarted by its agent loads it and replays its phase from there, while
the others wait at the exchange (``train.live_rejoin_wait_s``): it then adds the outer gradient
it would have added had it never died, so every sequence is trained once and the losses are
the fault-free run's. If the others went on without it, it is behind at that exchange: it adds
nothing and is healed as above. Not replayed: a loss in the first phase (no phase start
written yet) and a restart of the whole job (``attempt`` 0: the checkpoint resume).

Data otherwise: **at most once**. A lost worker's inner progress since each fragment's last exchange
existed only in its memory; its sequences of that span (and while it is out) are lost, every
other sequence is trained once, none twice (docs/resilience.md: why not exactly once).
Lighthouse lost during an exchange: the exchange finishes as a quorum of this replica alone
(its own outer gradient), so the checkpoint replica 0 then writes holds a completed outer
step; the stop (exit 75) comes at the next step boundary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshfold import comm
from meshfold.train.quorum import LighthouseLost

if TYPE_CHECKING:
    from meshfold.train.live import LiveReplicas


class OuterLive:
    """The outer exchange of one worker (replica group) over its quorum (module doc)."""

    def __init__(self, live: LiveReplicas, outer):
        self.live, self.outer = live, outer
        self.fragment = 0  # the fragment being exchanged (in the quorum's meta: a joiner sizes its zeros by it)
        self.stale: set[int] = set()  # fragments this worker's next exchange adds nothing to
        self.trainers: int | None = None  # workers whose phase went into the last exchange
        self.lost: LighthouseLost | None = None  # the Lighthouse was lost during an exchange: stop at the boundary
        self.replay = live.cfg.train.live_replay_phase and outer.name == "diloco"
        self.replaying = False  # restored from this worker's phase start: its next exchange decides
        outer.mean_fn = self.mean

    def received_state(self, step: int) -> None:
        """This worker's state came from another replica at ``step``: only the fragments
        exchanged at that step count as its own from here."""
        self.stale = set(range(len(self.outer.phi))) - self.outer.exchanged_at(step)

    def join(self) -> None:
        """Before a worker's first step: the start (everyone at the same step: nothing to do but
        note a resume from replica 0's checkpoint), or a restarted worker, which waits for the
        others' next exchange, takes part with nothing to add, then receives the state."""
        live = self.live
        if self.replaying or self.restore_phase():  # replay this worker's lost phase (module doc)
            return
        while True:
            q = live._ask()
            good, error = live._take(q)
            if not good:  # a member lost since the quorum: ask again
                live.beats.abandoned, live.redo_cause = True, error
                continue
            if live.replica not in q["heal"]:
                if live.progress.step > 0 and live.replica != 0:  # resumed from replica 0's checkpoint
                    self.received_state(live.progress.step)
                return
            self.fragment = int(q["meta"].get("fragment", 0))
            ok, error = self.exchange(None)
            if ok:
                live._heal(q)
                return
            live.beats.abandoned = True
            live.redo_cause = error

    def mean(self, delta: torch.Tensor, fragment: int = 0) -> None:
        """The outer optimizer's ``mean_fn``: ``delta`` becomes the mean of fragment
        ``fragment``'s outer gradient over the quorum's members that trained its phase;
        retried with a new quorum when a member is lost during the exchange."""
        live = self.live
        self.fragment = fragment
        while True:
            try:
                q = live._ask()
            except LighthouseLost as err:  # a quorum of this replica alone: its own outer gradient
                self.lost, self.trainers = err, 1
                return
            good, error = live._take(q)
            if not good:
                live.beats.abandoned, live.redo_cause = True, error
                continue
            behind = live.replica in q["heal"]  # a replayed phase the others did not wait for: adds nothing
            ok, error = self.exchange(None if behind else delta)
            if ok:
                self.replaying = False
                self.stale.discard(fragment)
                live.pending_heal = q if q["heal"] else None
                return
            live.beats.abandoned = True
            live.redo_cause = error

    def exchange(self, delta: torch.Tensor | None) -> tuple[bool, str]:
        """Sum of the contributing members' outer gradients and their count (a joiner, or a
        fragment of ``stale``, adds zeros), then this worker's vote; ``delta`` becomes the mean.
        The sum is taken in a buffer of its own: a collective abandoned for a lost member may
        still write into it later (gloo finishes it in the background), never into ``delta``."""
        live = self.live
        adds = delta is not None and self.fragment not in self.stale
        flat = delta.clone() if adds else torch.zeros_like(self.outer.phi[self.fragment])
        count = torch.full((), 1.0 if adds else 0.0, dtype=torch.float64, device=live.device)
        ok = torch.ones((), dtype=torch.int64, device=live.device)
        error = ""
        if live.group is not None:
            try:
                live.beats.watching = True  # a peer lost here only costs a retry: judge it by its heartbeat
                comm.group_all_reduce(flat, live.group, "outer")
                comm.group_all_reduce(count, live.group, None)
            except RuntimeError as err:
                ok.zero_()
                error = str(err).splitlines()[0][:200]
            finally:
                live.beats.watching = False
        ok, error = live._vote(ok, error)
        if ok:  # the commit fence (live_fence.py): an exchange another quorum made is not applied twice
            ok, error = live.claim()
        if ok and delta is not None:
            delta.copy_(flat.div_(count.to(flat.dtype)) if float(count) > 0 else flat)
            self.trainers = int(count)
        return ok, error

    def heal_schedule(self, behind: bool, src: int) -> None:
        """The outer state's plain numbers from the source (before the tensors, whose list
        depends on what is pending)."""
        values = self.outer.schedule()
        buf = torch.tensor(values, dtype=torch.int64, device=self.live.device)
        comm.group_broadcast(buf, src, self.live.group, "live")
        if behind:
            self.outer.load_schedule(buf.tolist())

    # ------------------------------------------------------------------ train.live_replay_phase

    def _phase_path(self) -> Path:
        live = self.live
        return Path(live.cfg.train.run_dir) / "live-phase" / f"w{live.replica}-rank{live.rank}.safetensors"

    def after_step(self, step: int) -> None:
        """After a committed outer step: this worker's phase start, written for a replay."""
        if not self.replay or not self.outer.exchanged_at(step) or step >= self.live.cfg.train.steps:
            return
        live = self.live
        _, tensors = live._state_tensors()
        meta = {"step": str(step), "outer_steps": str(self.outer.outer_steps),
                "sampler": json.dumps(live.sampler.state_dict()),
                "scheduler": json.dumps(live.scheduler.state_dict(), default=lambda _: None)}
        path = self._phase_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({str(i): t.detach().to("cpu", copy=True).contiguous() for i, t in enumerate(tensors)}, str(tmp),
                  metadata=meta)
        os.replace(tmp, path)  # a worker killed while writing keeps the previous phase start

    @torch.no_grad()
    def restore_phase(self) -> bool:
        """A restarted worker (``attempt`` > 0): its own last phase start, when written."""
        live, path = self.live, self._phase_path()
        if not self.replay or live.attempt == 0 or not path.exists():
            return False
        live.create_optimizer_state()
        _, tensors = live._state_tensors()
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            for i, t in enumerate(tensors):
                t.copy_(f.get_tensor(str(i)))
        live.sampler.load_state_dict(json.loads(meta["sampler"]))
        live.scheduler.load_state_dict(json.loads(meta["scheduler"]))
        for group, lr in zip(live.optimizer.param_groups, live.scheduler.get_last_lr()):
            group["lr"] = lr
        live.progress.step = int(meta["step"])
        self.outer.outer_steps = int(meta["outer_steps"])
        self.replaying = True
        if live.rank == 0:
            print(f"meshfold: replica {live.replica}: replaying its phase from step {meta['step']} "
                  "(train.live_replay_phase)", flush=True)
        return True
