"""Live recovery's commit fence (docs/resilience.md, "No step committed twice"): whatever
quorums the Lighthouse forms, no step is applied by two lineages of the model.

The Lighthouse answers the replicas that heartbeat and ask. A replica dropped for a while
(stopped, cut off) that comes back while the replicas that went on without it are silent
in turn gets a quorum of its own at the step it last trained; alone, it would train again
steps the others applied. The fence keeps in the job's store, per *lineage*, the newest
commit (``live/head/<epoch>``: "ordinal group") and who made it (``live/held/<epoch>/<replica>``:
"restart-count ordinal"). A commit's *ordinal* orders them: a step's number (``dp_replicate``
replicas), or DiLoCo's outer exchange of fragment p at step t, t x fragments + p (the
exchanges of one step go in fragment order):

- ``claim`` (rank 0 of every member, once the step's exchange succeeded and before the
  optimizer applies it; DiLoCo: before the outer mean is used): moves the head from an
  older commit to this one, or finds it there under this quorum's group (a co-member was
  first). A head at this commit or beyond under another group: nothing is applied, and the
  step (the exchange) is redone with a new quorum.
- ``settle`` (rank 0 of every member, on every quorum): a quorum whose lineage's head is at
  or beyond the commit it would make waits (asks again) while a replica that made those beats
  (its beat changed within ``void_after_s``): alive, it will ask and heal the quorum;
  restarted, it joins with its checkpoint, which the quorum then weighs (``quorum.decide``).
  Once every such replica is silent that long, or the quorum holds them all and its newest
  state is still behind the head (the steps beyond died with a replica's memory), the
  quorum starts a new lineage from its own state, as does a quorum whose members all
  started from no lineage (the job's start). A lineage is named by the Lighthouse's creation
  time of the quorum that started it; a newer lineage is ahead of an older one whatever their
  steps (``quorum.decide``), so a replica of an abandoned lineage that comes back is healed
  from the newer one; a checkpoint records its lineage (``extra.live``), so a replica
  restarted from it is weighed by its step within that lineage. Each quorum's verdict is
  stored once (compare-and-set) and read by every member: they never disagree on waiting.
"""

from __future__ import annotations

from collections import deque

WAIT = "wait"


class CommitFence:
    """One replica's rank-0 side of the fence (module docstring). ``store``: a client of the
    job's store; ``beats(r)``: (restart count of replica r's newest beat or None, seconds since
    it last changed) — ``live_watch.PeerWatch.beat``; ``next_commit(d)``: the ordinal quorum
    ``d`` commits next, ``label(ordinal)`` says it in words (by default a step's number)."""

    def __init__(self, store, replica: int, replicas: int, attempt: int, beats, void_after_s: float,
                 next_commit=lambda d: d["step"] + 1, label=lambda ordinal: f"step {ordinal}"):
        self.store, self.replica, self.replicas, self.attempt = store, replica, replicas, attempt
        self.beats, self.void_after_s = beats, void_after_s
        self.next_commit, self.label = next_commit, label
        self.verdicts: deque[str] = deque()  # this replica's recent verdict keys (older ones are deleted)
        self.waiting: str | None = None  # why the last verdict was to wait (said once per episode)

    def _get(self, key: str) -> str:
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def head(self, epoch: int) -> tuple[int, str] | None:
        """(the newest commit's ordinal, the group that made it) of a lineage."""
        value = self._get(f"live/head/{epoch}")
        if not value:
            return None
        ordinal, group = value.split(" ", 1)
        return int(ordinal), group

    def holders(self, epoch: int, ordinal: int, members: list[int]) -> list[int]:
        """The replicas outside ``members`` that made commit ``ordinal`` of the lineage or a
        later one and still beat (module docstring): alive or restarted, they will ask."""
        out = []
        for r in range(self.replicas):
            held = self._get(f"live/held/{epoch}/{r}") if r not in members else ""
            if not held:
                continue
            last = int(held.split()[1])
            beat_attempt, silent_s = self.beats(r)
            if last >= ordinal and beat_attempt is not None and silent_s < self.void_after_s:
                out.append(r)
        return out

    def settle(self, d: dict) -> int | None:
        """The lineage quorum ``d`` trains in (also set as ``d["epoch"]``), or None: wait and ask
        again. ``d``: ``quorum.decide``'s decision with ``created_ns`` and ``lighthouse_quorum``."""
        epoch = d["epoch"]
        if epoch < 0:  # no member holds a lineage yet (the job's start): a new one
            opinion = str(d["created_ns"])
        else:
            head, nxt = self.head(epoch), self.next_commit(d)
            ahead = self.holders(epoch, nxt, d["members"]) if head is not None and head[0] >= nxt else []
            if ahead:
                opinion = WAIT
                why = (f"{self.label(nxt)} through {self.label(head[0])} were committed by replica(s) {ahead}, which "
                       f"still beat: waiting for them instead of training those again (the commit fence)")
                if why != self.waiting:
                    print(f"meshfold: replica {self.replica}: {why}", flush=True)
                self.waiting = why
            else:  # nothing beyond (the common case), or everyone beyond is gone: a new lineage
                opinion = str(epoch if head is None or head[0] < nxt else d["created_ns"])
        key = f"live/settle/{d['lighthouse_quorum']}"
        verdict = self.store.compare_set(key, "", opinion).decode()
        self.verdicts.append(key)
        while len(self.verdicts) > 16:  # every member read it long ago
            self.store.delete_key(self.verdicts.popleft())
        if verdict == WAIT:
            return None
        self.waiting = None
        d["epoch"] = int(verdict)
        return d["epoch"]

    def claim(self, epoch: int, ordinal: int, group: str) -> bool:
        """Whether this quorum (``group``) may apply commit ``ordinal`` of lineage ``epoch``:
        True once the head is there under ``group``; False when another group made it or a later one."""
        key, mine = f"live/head/{epoch}", f"{ordinal} {group}"
        current = self._get(key)
        while current != mine:
            if current and int(current.split(" ", 1)[0]) >= ordinal:
                return False
            current = self.store.compare_set(key, current, mine).decode()
        self.store.set(f"live/held/{epoch}/{self.replica}", f"{self.attempt} {ordinal}")
        return True
