"""Live recovery's watch over a step's cross-replica exchange (docs/resilience.md): a hung
replica *inside* a collective is noticed within the heartbeat timeout, not after the
collective timeout.

Every rank beats in the job's store (``live/hb/<replica>/<rank>``: its restart count, a
counter and its group's key, ``-``-prefixed once it dropped that group's exchange) while its
training loop makes progress, and reads its peers' (the same rank of every replica). A
collective of a step's exchange is abandoned (``RuntimeError``, so the step is redone with a
new quorum) when a peer's beat did not change for the heartbeat timeout since this replica
entered the group (judged at this rank's own last read: a reader starved of CPU sees no false
silence), when the peer dropped this exchange, or when it went on in a group this replica
never entered (how a replica resumed after a stop learns it was dropped). The same watch
guards a new group's rendezvous (``build``: a member that died after the quorum named it never
arrives) and rank 0's Lighthouse heartbeat (``replica_alive``: one hung rank of the replica
group stops it, so the Lighthouse drops the group within its heartbeat timeout).
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time

import torch.distributed as dist


def store_client(address: str, timeout_s: float) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class PeerWatch:
    """One rank's beats and its watch (``wait``, the standalone group's ``watch``)."""

    def __init__(self, store_address: str, replica: int, replicas: int, rank: int, attempt: int,
                 heartbeat_s: float, alive, world: int = 1):
        self.replica, self.replicas, self.rank, self.attempt = replica, replicas, rank, attempt
        self.heartbeat_s, self.alive = heartbeat_s, alive
        self.group_key = ""  # the group this replica is in
        self.members: list[int] = []
        self.attempts: dict = {}
        self.seen: set[str] = set()
        self.peers: dict[int, tuple[str, float]] = {}  # replica -> (its last beat, when this rank saw it change)
        self.watching = False  # inside a step's exchange (the heal is not watched: no redo covers it)
        self.abandoned = False  # this replica dropped the current group's exchange (its peers must too)
        self.polled = self.started = time.monotonic()  # when this rank last read its peers' beats
        # rank 0: the other ranks of this replica group -> (their last beat, when it changed)
        self.own = {k: ("", self.polled) for k in range(1, world)} if rank == 0 else {}
        timeout_s = max(5.0, heartbeat_s)
        self.store = store_client(store_address, timeout_s)  # the reads of the waiting (main) thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(store_client(store_address, timeout_s),), daemon=True,
                                        name="meshfold-peer-heartbeat")
        self._thread.start()
        atexit.register(self.close)  # joined before the interpreter finalizes (see quorum.Membership)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(10.0, 2 * self.heartbeat_s))

    def enter(self, key: str, members: list[int], attempts: dict | None = None) -> None:
        """This replica takes part in group ``key`` of ``members`` (at ``attempts``, their restart
        counts in the quorum): each member's beat is judged from now."""
        self.group_key, self.members, self.abandoned = key, members, False
        self.attempts = attempts or {}
        self.seen.add(key)
        now = time.monotonic()
        for r in members:
            self.peers[r] = (self.peers.get(r, ("",))[0], now)

    def _key(self, replica: int, rank: int | None = None) -> str:
        return f"live/hb/{replica}/{self.rank if rank is None else rank}"

    def beat(self, replica: int) -> tuple[int | None, float]:
        """(restart count in ``replica``'s newest beat, or None before any; seconds since its beat
        last changed as this rank saw it) — the commit fence's view of a replica (live_fence.py)."""
        value, since = self.peers.get(replica, ("", self.started))
        return (int(value.split(" ", 1)[0]) if value else None), time.monotonic() - since

    def replica_alive(self) -> bool:
        """Every other rank of this replica group beat within the heartbeat timeout (rank 0)."""
        return all(self.polled - since <= self.heartbeat_s for _, since in self.own.values())

    def _beat(self, store) -> None:
        beat, pause = 0, self.heartbeat_s / 5
        while True:
            try:
                if self.alive():
                    beat += 1
                    mark = "-" if self.abandoned else ""
                    store.set(self._key(self.replica), f"{self.attempt} {beat} {mark}{self.group_key}")
                self._read(store)
                pause = self.heartbeat_s / 5
            except RuntimeError:  # the store's host is gone (the quorum says the rest): ask less and less often
                pause = min(2 * pause, 30.0)
            if self._stop.wait(pause):
                return

    def _read(self, store) -> None:
        """The peers' beats as they are now in the store."""
        for r in range(self.replicas):
            key = self._key(r)
            if r != self.replica and store.check([key]):
                value = store.get(key).decode()
                if self.peers.get(r, ("",))[0] != value:
                    self.peers[r] = (value, time.monotonic())
        for k, (last, _) in list(self.own.items()):
            key = self._key(self.replica, k)
            if store.check([key]) and (value := store.get(key).decode()) != last:
                self.own[k] = (value, time.monotonic())
        self.polled = time.monotonic()

    def wait(self, work) -> None:
        """Wait for a collective; inside a step's exchange, abandon it when a peer is gone."""
        if not self.watching:
            work.wait()
            return
        while True:
            done = work.is_completed()
            if done:  # judged once more on the beats as they are now: a replica resumed after a stop
                self._read(self.store)  # must not keep a result its peers abandoned
            self._judge()
            if done:
                work.wait()
                return
            time.sleep(0.002)

    def _judge(self) -> None:
        """Raise ``RuntimeError`` when a member of the current group is gone (see the module)."""
        now = time.monotonic()
        for r in self.members:
            if r == self.replica:
                continue
            value, since = self.peers.get(r, ("", now))
            key = value.split(" ", 2)[2] if value.count(" ") >= 2 else ""
            if self.polled - since > self.heartbeat_s:
                raise RuntimeError(f"replica {r} (rank {self.rank}) stopped heartbeating "
                                   f"{now - since:.1f} s ago (hung, stopped or unreachable)")
            # restarted since the quorum (faster than its beat could lapse); an older attempt is a stale read
            if value and r in self.attempts and int(value.split(" ", 1)[0]) > self.attempts[r]:
                raise RuntimeError(f"replica {r} (rank {self.rank}) restarted since the quorum")
            if key == "-" + self.group_key:
                raise RuntimeError(f"replica {r} (rank {self.rank}) dropped this step's exchange")
            # a newer group only: a peer still publishing the group before this one merely lags behind
            if key and not key.startswith("-") and key not in self.seen and _created(key) > _created(self.group_key):
                raise RuntimeError(f"replica {r} (rank {self.rank}) went on in group {key} without this one")

    def build(self, make):
        """``make()`` (a new group's rendezvous) in a thread, abandoned with ``RuntimeError`` when
        a member is gone: one that died after the quorum named it never arrives, and the
        rendezvous would wait the whole collective timeout (the abandoned thread ends there)."""
        box: dict = {}

        def run():
            try:
                box["group"] = make()
            except Exception as err:  # noqa: BLE001 - re-raised on the waiting thread
                box["error"] = err

        thread = threading.Thread(target=run, daemon=True, name="meshfold-group-build")
        thread.start()
        while thread.is_alive():
            self._judge()
            thread.join(0.01)
        if "error" in box:
            raise RuntimeError(f"the group of replicas {self.members} did not form: {box['error']}")
        return box["group"]


def _created(key: str) -> int:
    """When the Lighthouse created a group key's quorum (``quorum.group_key``: ``id.created_ns.members``)."""
    parts = key.split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


class WatchedGroup:
    """A standalone group's process group (``comm.StandaloneGroup.pg``) whose collectives are
    waited for through ``PeerWatch.wait`` (``comm``'s group collectives call
    ``pg.allreduce(...).wait()``); everything else (``abort``) is the group's own."""

    def __init__(self, pg, watch):
        self.pg, self.watch = pg, watch

    def allreduce(self, *args):
        return _Watched(self.pg.allreduce(*args), self.watch)

    def broadcast(self, *args):
        return _Watched(self.pg.broadcast(*args), self.watch)

    def __getattr__(self, name):
        return getattr(self.pg, name)


class _Watched:
    def __init__(self, work, watch):
        self.work, self.watch = work, watch

    def wait(self) -> None:
        self.watch(self.work)


def destroy(group) -> None:
    """Drop a standalone group's process group (its last reference): its pairs and work threads
    end, its sockets close. Run off the training thread: gloo's destructor waits for the group's
    work, which an abandoned collective holds until the collective timeout."""
    group.pg = None
