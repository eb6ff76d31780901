"""Live recovery's commit fence (docs/resilience.md, "No step committed twice"): whatever
quorums the Lighthouse forms, no step is applied by two lineages of the model.

The Lighthouse answers the replicas that heartbeat and ask. A replica dropped for a while
(stopped, cut off) that comes back while the replicas that went on without it are silent
in turn gets a quorum of its own at the step it last trained; alone, it would train again
steps the others applied. The fence keeps in the job's store, per *lineage*, the newest
step committed (``live/head/<epoch>``: "step group") and who committed it
(``live/held/<epoch>/<replica>``: "restart-count step"):

- ``claim`` (rank 0 of every member, once the step's exchange succeeded and before the
  optimizer applies it): moves the head from an older step to this one, or finds it there
  under this quorum's group (a co-member was first). A head at this step or beyond under
  another group: the step is not applied, and redone with a new quorum.
- ``settle`` (rank 0 of every member, on every quorum): a quorum whose lineage's head is
  beyond its step waits (asks again) while a replica that committed those steps beats
  (its beat changed within ``void_after_s``): alive, it will ask and heal the quorum;
  restarted, it joins with its checkpoint, which the quorum then weighs (``quorum.decide``).
  Once every such replica is silent that long, or the quorum holds them all and its newest
  state is still behind the head (the steps beyond died with a replica's memory), the
  quorum starts a new lineage from its own state, as does a quorum whose members all
  started from no lineage (the job's start). A lineage is named by the Lighthouse's creation
  time of the quorum that started it; a newer lineage is ahead of an older one whatever their
  steps (``quorum.decide``), so a replica of an abandoned lineage that comes back is healed
  from the newer one; a checkpoint records its lineage (``extra.live``), so a replica
  restarted from it is weighed by its step within that lineage. Each quorum's verdict is stored once (compare-and-set) and read by every
  member, so the members never disagree on waiting.
"""

from __future__ import annotations

import time
from collections import deque

WAIT = "wait"


class CommitFence:
    """One replica's rank-0 side of the fence (module docstring). ``store``: a client of the
    job's store; ``beats(r)``: (restart count of replica r's newest beat or None, seconds since
    it last changed) — ``live_watch.PeerWatch.beat``."""

    def __init__(self, store, replica: int, replicas: int, attempt: int, beats, void_after_s: float):
        self.store, self.replica, self.replicas, self.attempt = store, replica, replicas, attempt
        self.beats, self.void_after_s = beats, void_after_s
        self.verdicts: deque[str] = deque()  # this replica's recent verdict keys (older ones are deleted)
        self.waiting: str | None = None  # why the last verdict was to wait (said once per episode)

    def _get(self, key: str) -> str:
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def head(self, epoch: int) -> tuple[int, str] | None:
        """(newest committed step, the group that committed it) of a lineage."""
        value = self._get(f"live/head/{epoch}")
        if not value:
            return None
        step, group = value.split(" ", 1)
        return int(step), group

    def holders(self, epoch: int, step: int, members: list[int]) -> list[int]:
        """The replicas outside ``members`` that committed a step after ``step`` of the lineage
        and still beat (module docstring): alive or restarted, they will ask."""
        out = []
        for r in range(self.replicas):
            held = self._get(f"live/held/{epoch}/{r}") if r not in members else ""
            if not held:
                continue
            last = int(held.split()[1])
            beat_attempt, silent_s = self.beats(r)
            if last > step and beat_attempt is not None and silent_s < self.void_after_s:
                out.append(r)
        return out

    def settle(self, d: dict) -> int | None:
        """The lineage quorum ``d`` trains in (also set as ``d["epoch"]``), or None: wait and ask
        again. ``d``: ``quorum.decide``'s decision with ``created_ns`` and ``lighthouse_quorum``."""
        epoch, step = d["epoch"], d["step"]
        if epoch < 0:  # every member started from a checkpoint: a new lineage from there
            opinion = str(d["created_ns"])
        else:
            head = self.head(epoch)
            ahead = self.holders(epoch, step, d["members"]) if head is not None and head[0] > step else []
            if ahead:
                opinion = WAIT
                why = (f"steps {step + 1}-{head[0]} were committed by replica(s) {ahead}, which still beat: "
                       f"waiting for them instead of training those steps again (the commit fence)")
                if why != self.waiting:
                    print(f"meshfold: replica {self.replica}: {why}", flush=True)
                self.waiting = why
            else:  # nothing beyond (the common case), or everyone beyond is gone: a new lineage
                opinion = str(epoch if head is None or head[0] <= step else d["created_ns"])
        key = f"live/settle/{d['lighthouse_quorum']}"
        verdict = self.store.compare_set(key, "", opinion).decode()
        self.verdicts.append(key)
        while len(self.verdicts) > 16:  # every member read it long ago
            self.store.delete_key(self.verdicts.popleft())
        if verdict == WAIT:
            time.sleep(0.2)
            return None
        self.waiting = None
        d["epoch"] = int(verdict)
        return d["epoch"]

    def claim(self, epoch: int, step: int, group: str) -> bool:
        """Whether this quorum (``group``) may apply ``step`` of lineage ``epoch``: True once
        the head is at ``step`` under ``group``; False when another group committed it or beyond."""
        key, mine = f"live/head/{epoch}", f"{step} {group}"
        current = self._get(key)
        while current != mine:
            if current and int(current.split(" ", 1)[0]) >= step:
                return False
            current = self.store.compare_set(key, current, mine).decode()
        self.store.set(f"live/held/{epoch}/{self.replica}", f"{self.attempt} {step}")
        return True
