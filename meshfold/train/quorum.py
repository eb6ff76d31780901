"""The quorum service of live recovery (``train.live_recovery``; docs/resilience.md): a small
TCP server (the "lighthouse", one per job, in the launcher) that decides, at every step
boundary, which replica groups train the next step together, and which of them must first
receive the current state from a healthy one. Torch-free; JSON lines over TCP.

Connections:

- an *agent* (the launcher process that owns one replica group's workers and restarts
  them) says ``{"op": "agent", "replica": r}`` and keeps the connection open: while it is
  open, replica r is expected back when its workers are gone (restarting);
- a replica's rank-0 *worker* says ``{"op": "hello", "replica": r, "attempt": k}`` and then
  asks ``{"op": "quorum", "step": s, "meta": {...}, "failed": "..."}`` before each step
  (``failed``: the error that made it redo the step). Its connection closing without
  ``{"op": "bye", "step": s}`` is a departure (the process died or was killed); after a bye
  (the run is finished) a replica still asking is told ``{"done": true}``.

A round completes when every replica with a connected worker has asked, and then: the
first round when all the configured replicas are there (or ``start_timeout_s`` passed); a
round redoing a step a departure interrupted at once (the survivors finish that step among
themselves); any other round when no replica is restarting (agent connected, no worker) or
``rejoin_wait_s`` has passed since the round began. The reply to every member: ``quorum_id`` (changes whenever the members change or
someone heals), ``members`` (sorted replica ids), ``step`` (the largest step among them),
``source`` (the lowest member at that step: it sends the state), ``heal`` (members behind:
they receive it), ``meta`` (the source's ``meta``: plain values such as the sampler
position) and ``events`` (departures and rejoins since this member's last reply, with
their cause).
"""

from __future__ import annotations

import json
import socket
import threading
import time


def _send(sock: socket.socket, obj: dict) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


class _Lines:
    """Newline-delimited JSON messages from a socket."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def next(self) -> dict | None:
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return None
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class QuorumServer:
    """One per job. ``replicas``: the configured replica groups; ``rejoin_wait_s``: how long a
    round waits for a replica whose agent is restarting it (0: go on without it)."""

    def __init__(self, replicas: int, rejoin_wait_s: float = 0.0, start_timeout_s: float = 600.0,
                 host: str = "127.0.0.1", port: int = 0):
        self.replicas, self.rejoin_wait_s, self.start_timeout_s = replicas, rejoin_wait_s, start_timeout_s
        self.sock = socket.create_server((host, port))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.cond = threading.Condition()
        self.agents: set[int] = set()
        self.workers: dict[int, object] = {}  # replica -> connection token of its current rank-0 worker
        self.finished: set[int] = set()
        self.pending: dict[int, dict] = {}  # replica -> its request this round
        self.replies: dict[int, dict] = {}
        self.round_started: float | None = None
        self.round = 0
        self.quorum_id = 0
        self.last_members: list[int] = []
        self.events: list[dict] = []
        self.seen: dict[int, int] = {}  # replica -> events already told
        self.last_step: dict[int, int] = {}
        self.failures: list[str] = []
        self.log: list[dict] = []  # every quorum decided (tests, docs)
        self.done_step: int | None = None  # a replica finished the run at this step
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="meshfold-quorum").start()

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lines = _Lines(conn)
        hello = lines.next()
        if hello is None:
            conn.close()
            return
        replica = int(hello["replica"])
        if hello["op"] == "agent":
            with self.cond:
                self.agents.add(replica)
            lines.next()  # blocks until the agent's connection closes
            with self.cond:
                self.agents.discard(replica)
                self.cond.notify_all()
            conn.close()
            return
        token = object()
        with self.cond:
            self.workers[replica] = token
            self.finished.discard(replica)
            self.seen.setdefault(replica, len(self.events))
            self.cond.notify_all()
        said_bye = False
        while True:
            msg = lines.next()
            if msg is None:
                break
            if msg["op"] == "bye":
                said_bye = True
                with self.cond:
                    self.done_step = max(self.done_step or 0, int(msg.get("step", 0)))
                break
            if msg["op"] == "quorum":
                reply = self._quorum(replica, token, msg)
                try:
                    _send(conn, reply)
                except OSError:
                    break
        with self.cond:
            if self.workers.get(replica) is token:
                del self.workers[replica]
                self.pending.pop(replica, None)
                if said_bye:
                    self.finished.add(replica)
                else:
                    # No longer a member: when it comes back (even before any round without it,
                    # as DiLoCo workers meet only at outer steps) that is a rejoin.
                    self.last_members = [m for m in self.last_members if m != replica]
                    step = self.last_step.get(replica, 0)
                    self._event({"event": "departure", "replica": replica, "step": step + 1,
                                 "cause": f"replica {replica}'s rank-0 worker disconnected during step {step + 1} "
                                          "(its process exited or was killed, or its agent stopped its group)"})
                self.cond.notify_all()
        conn.close()

    def _event(self, ev: dict) -> None:
        ev["time"] = round(time.time(), 3)
        self.events.append(ev)

    # ------------------------------------------------------------------ rounds

    def _restarting(self) -> set[int]:
        return {r for r in self.agents if r not in self.workers and r not in self.finished}

    def _complete(self) -> bool:
        if not self.pending or any(r not in self.pending for r in self.workers):
            return False
        waited = time.time() - (self.round_started or 0.0)
        if self.round == 0:  # the start: every replica, unless one never comes
            return len(self.pending) == self.replicas or waited >= self.start_timeout_s
        if any(m.get("failed") for m in self.pending.values()):
            return True  # a step interrupted by a departure: the survivors finish it now
        return not self._restarting() or waited >= self.rejoin_wait_s

    def _decide(self) -> None:
        members = sorted(self.pending)
        steps = {r: int(self.pending[r]["step"]) for r in members}
        top = max(steps.values())
        source = min(r for r in members if steps[r] == top)
        heal = [r for r in members if steps[r] < top]
        for r in members:
            if self.pending[r].get("failed"):
                self.failures.append(self.pending[r]["failed"])
        for ev in self.events:  # departures noticed by the survivors: say how it showed
            if ev["event"] == "departure" and "seen_as" not in ev and self.failures:
                ev["seen_as"] = self.failures[-1]
        for r in members:
            if r not in self.last_members:
                attempt = self.pending[r].get("meta", {}).get("attempt", 0)
                if self.round == 0:
                    ev = {"event": "join", "cause": "at the start"}
                else:
                    how = f"received step {top}'s state from replica {source}" if r in heal else "was up to date"
                    ev = {"event": "rejoin", "cause": f"replica {r} is back (restart {attempt} of its group): {how}"}
                self._event(dict(ev, replica=r, step=top + 1))
        if members != self.last_members or heal or any(self.pending[r].get("failed") for r in members):
            self.quorum_id += 1
        self.last_members = members
        decided = {"quorum_id": self.quorum_id, "members": members, "step": top, "source": source, "heal": heal,
                   "meta": self.pending[source].get("meta", {})}
        self.log.append(dict(decided, round=self.round))
        for r in members:
            self.replies[r] = dict(decided, events=self.events[self.seen.get(r, 0):])
            self.seen[r] = len(self.events)
            self.last_step[r] = top
        self.pending.clear()
        self.round += 1
        self.round_started = None
        self.cond.notify_all()

    def _quorum(self, replica: int, token, msg: dict) -> dict:
        with self.cond:
            if self.done_step is not None and not self.pending:  # the others finished the run meanwhile
                return {"done": True, "step": self.done_step}
            self.replies.pop(replica, None)
            self.pending[replica] = msg
            self.last_step[replica] = int(msg["step"])
            if self.round_started is None:
                self.round_started = time.time()
            self.cond.notify_all()
            while replica not in self.replies:
                if self.workers.get(replica) is not token:
                    raise ConnectionError("replaced")
                if self.done_step is not None:  # another replica finished the run while this one waited
                    self.pending.pop(replica, None)
                    return {"done": True, "step": self.done_step}
                if self._complete():
                    self._decide()
                    break
                self.cond.wait(timeout=0.05)
            return self.replies.pop(replica)

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class QuorumClient:
    """A replica's rank-0 worker (or its agent, ``agent=True``) talking to the server."""

    def __init__(self, address: str, replica: int, attempt: int = 0, agent: bool = False, timeout_s: float = 600.0):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.settimeout(None)
        self.lines = _Lines(self.sock)
        _send(self.sock, {"op": "agent" if agent else "hello", "replica": replica, "attempt": attempt})

    def quorum(self, step: int, meta: dict | None = None, failed: str | None = None) -> dict:
        _send(self.sock, {"op": "quorum", "step": step, "meta": meta or {}, "failed": failed})
        reply = self.lines.next()
        if reply is None:
            raise ConnectionError("live recovery: the quorum server closed the connection")
        return reply

    def bye(self, step: int = 0) -> None:
        try:
            _send(self.sock, {"op": "bye", "step": step})
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
