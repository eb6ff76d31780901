"""Live recovery's membership (``train.live_recovery``; docs/resilience.md) on torchft's
Lighthouse: which replica groups train the next step together, and which of them must
first receive the current state from a healthy one. Torch-free.

The Lighthouse (torchft's Rust gRPC server, ``torchft.coordination``; one per job, started
by ``serve_lighthouse``, here or on a host of its own) decides *who*: replicas heartbeat
(dropped after ``heartbeat_timeout_ms`` of silence: a killed, SIGSTOPped, hung or
unreachable replica), ask for a quorum at every step boundary, and are answered when every
heartbeating replica asked, or the last quorum's members all asked (fast path), or
``join_timeout_ms`` passed; more than half of the heartbeating replicas must ask (which
does not stop a stale replica answered alone while the others are silent: the commit fence,
``live_fence.py``, does). meshfold decides the rest, from the quorum alone, so every member computes the same
(``decide``): ``members`` (sorted replica ids, ids outside the job refused), ``step`` and
``epoch`` (the newest state among them: the newest lineage, then the largest step; the
lineages are ``live_fence.py``'s), ``source`` (the lowest member holding it: it sends the
state), ``heal`` (members behind), ``meta`` (the source's plain values: sampler position,
scheduler), ``events`` (departures, rejoins, with their cause). Only torchft's Lighthouse is
used: not its Manager, checkpoint transports or sampler (docs/resilience.md says why).

``Membership`` is one replica's rank-0 side: the quorum call (with the start gate, the
rejoin wait and the "run finished" mark) and the heartbeat thread, which beats only while
``alive()`` says this replica makes progress (a hung replica stops heartbeating).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

# torchft's Rust logger reads RUST_LOG once, at its import: its per-quorum INFO lines stay out
# of the job's output unless asked for.
os.environ.setdefault("RUST_LOG", "warn")

try:
    from torchft.coordination import LighthouseClient, LighthouseServer  # noqa: E402
except ImportError:  # the `live` extra; config.validate refuses train.live_recovery without it, in one line
    LighthouseClient = LighthouseServer = None

EXIT_LIGHTHOUSE_LOST = 75  # EX_TEMPFAIL: checkpointed, restart the job to resume


class LighthouseLost(RuntimeError):
    """The Lighthouse cannot be reached: nothing decides membership any more."""


def start_lighthouse(bind: str, heartbeat_timeout_s: float, join_timeout_s: float) -> LighthouseServer:
    """A Lighthouse in this process (``min_replicas = 1``: survivors go on alone; the start
    gate that wants all R is ``Membership.quorum``'s)."""
    return LighthouseServer(bind=bind, min_replicas=1, join_timeout_ms=int(join_timeout_s * 1000),
                            quorum_tick_ms=50, heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


def lighthouse_address(server: LighthouseServer, bind: str) -> str:
    """host:port to reach it: the bound host when it is a specific one."""
    port = server.address().rsplit(":", 1)[1]
    host = bind.rsplit(":", 1)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = server.address().split("//", 1)[1].rsplit(":", 1)[0]
    return f"{host}:{port}"


def spawn_lighthouse(bind: str, heartbeat_timeout_s: float, join_timeout_s: float,
                     store: str = "") -> tuple[subprocess.Popen, dict[str, str]]:
    """The Lighthouse (and with ``store``, the cross-replica store) as a child process
    (``python -m meshfold.train.quorum``): its own failure domain, which the launcher (or a
    drill) can lose. Returns (process, {"lighthouse": host:port[, "store": host:port]})."""
    cmd = [sys.executable, "-m", "meshfold.train.quorum", "--bind", bind,
           "--heartbeat-timeout-s", str(heartbeat_timeout_s), "--join-timeout-s", str(join_timeout_s)]
    proc = subprocess.Popen(cmd + (["--store", store] if store else []), stdout=subprocess.PIPE, text=True)
    out = {}
    for _ in range(2 if store else 1):
        line = proc.stdout.readline().split()
        if len(line) != 2:
            proc.kill()
            raise RuntimeError(f"live recovery: the lighthouse did not start on {bind} (exit {proc.wait()})")
        out[line[0]] = line[1]
    return proc, out


def decide(participants, replicas: int, last: dict | None) -> dict:
    """Members, step, source, heal, meta and events from a Lighthouse quorum: a pure
    function of the quorum (and of this member's previous decision, for the events), so
    every member decides the same. Participants whose id is not one of this job's replicas
    are refused (a stray or malformed client never becomes the heal source)."""
    data, refused = {}, []
    for p in participants:
        try:
            r = int(p.replica_id)
            meta = json.loads(p.data) if isinstance(p.data, str) else dict(p.data or {})
            ok = 0 <= r < replicas and str(r) == p.replica_id and int(meta.get("step", -1)) == p.step >= 0
        except (TypeError, ValueError):
            ok = False
        if ok:
            data[r] = meta
        else:
            refused.append(p.replica_id)
    members = sorted(data)
    state = {r: (int(data[r].get("epoch", -1)), data[r]["step"]) for r in members}  # a newer lineage is ahead
    epoch, top = max(state.values()) if members else (-1, 0)
    source = min(r for r in members if state[r] == (epoch, top)) if members else -1
    # up to date: at the newest state, or restarted from a checkpoint (no lineage yet) at its step
    # (a DiLoCo worker that replayed its phase: its own state, not to be overwritten)
    heal = [r for r in members if state[r][1] != top or state[r][0] not in (epoch, -1)]
    failed = next((data[r]["failed"] for r in members if data[r].get("failed")), None)
    events, before = [], (last or {}).get("attempts", {})
    for r in members:
        attempt = data[r].get("attempt", 0)
        if not before and (not heal or r not in heal):  # no history (a restarted writer): only its heals are news
            if not heal:  # the start, or every group resumed from a checkpoint
                events.append({"event": "join", "replica": r, "step": top + 1, "cause": "at the start"})
        elif before.get(r) != attempt:
            if r in before:  # restarted between two quorums it was in (a fast restart; DiLoCo's outer steps)
                events.append(_departure(r, top, failed))
            how = f"received step {top}'s state from replica {source}" if r in heal else "was up to date"
            events.append({"event": "rejoin", "replica": r, "step": top + 1,
                           "cause": f"replica {r} is back (restart {attempt} of its group): {how}"})
    for r in sorted(set(before) - set(members)):
        events.append(_departure(r, top, failed))
    now = round(time.time(), 3)
    for ev in events:
        ev["time"] = now
    return {"members": members, "step": top, "epoch": epoch, "source": source, "heal": heal, "refused": refused,
            "groups": {r: data[r].get("group") for r in members},
            "meta": {k: v for k, v in data[source].items() if k not in ("step", "epoch", "failed")} if members else {},
            "failed": failed, "attempts": {r: data[r].get("attempt", 0) for r in members},
            "short_since": min((data[r]["short_since"] for r in members if data[r].get("short_since") is not None),
                               default=None), "events": events}


def group_key(d: dict, quorum_id: int, created_ns: int) -> str:
    """The store key of the standalone group a decision's members meet in, the same for every
    member. The group the members hold is kept when every member holds the same one, of
    exactly these members, and nothing failed or heals; otherwise a new key names this quorum
    by the Lighthouse's id *and* its creation time, so no key is ever used twice (a replica
    restarted before its heartbeat lapsed brings the same quorum id back: a reused key would
    meet the previous group's stale addresses and hang)."""
    members = "m" + "-".join(str(r) for r in d["members"])
    held = set(d["groups"].values())
    if len(held) == 1 and not d["heal"] and not d["failed"]:
        key = held.pop()
        if isinstance(key, str) and key.rsplit(".", 1)[-1] == members:
            return key
    return f"{quorum_id}.{created_ns}.{members}"


def _departure(r: int, top: int, failed: str | None) -> dict:
    ev = {"event": "departure", "replica": r, "step": top + 1,
          "cause": f"replica {r} left the quorum during step {top + 1} (its process exited or was killed, "
                   "or it stopped heartbeating: hung, stopped or unreachable)"}
    if failed:
        ev["seen_as"] = failed
    return ev


class Membership:
    """One replica's rank 0: quorums from the Lighthouse and the heartbeat thread.

    ``alive()``: whether this replica still makes progress (its heartbeat stops otherwise);
    ``done_mark``: the file a run finished at ``final_step`` leaves (a replica restarted after it has nothing
    to train); ``rejoin_wait_s``: how long the members of a short quorum wait for the
    missing replicas at a step boundary (never while redoing an interrupted step);
    ``start_timeout_s``: how long the first quorum waits for all the configured replicas;
    ``settle(d)``: the lineage quorum ``d`` trains in, or None to ask again
    (``live_fence.CommitFence.settle``; by default no fence: the decision's own)."""

    def __init__(self, address: str, replica: int, replicas: int, attempt: int, heartbeat_timeout_s: float,
                 done_mark: Path, final_step: int, rejoin_wait_s: float = 0.0, start_timeout_s: float = 600.0,
                 alive=lambda: True, settle=lambda d: d["epoch"]):
        self.replica, self.replicas, self.attempt = replica, replicas, attempt
        self.id, self.address = str(replica), address
        self.rejoin_wait_s, self.start_timeout_s, self.done_mark = rejoin_wait_s, start_timeout_s, done_mark
        self.final_step = final_step
        self.heartbeat_s, self.alive, self.settle = heartbeat_timeout_s, alive, settle
        self.lost_after_s = max(5.0, 2 * heartbeat_timeout_s)  # unreachable this long: lost (not a blip)
        self.lost: str | None = None  # why the last heartbeat failed
        try:
            self.client = LighthouseClient(f"http://{address}", connect_timeout=timedelta(seconds=self.lost_after_s))
        except RuntimeError as err:
            self.client, self.lost = None, str(err).splitlines()[0][:200]  # said at the first quorum
        self.last: dict | None = None
        self.short_since: float | None = None
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="meshfold-heartbeat")
        self._thread.start()
        # Joined before the interpreter finalizes: a daemon thread inside torchft's Rust client
        # then (its GIL released) is ended by pthread_exit, which aborts the process.
        atexit.register(self.close)

    def _beat(self) -> None:
        if self.client is None:
            return
        try:
            self.client.heartbeat(self.id, timeout=timedelta(seconds=max(1.0, self.heartbeat_s)))
        except Exception as err:  # noqa: BLE001 - torchft raises plain RuntimeError/TimeoutError
            self.lost = str(err).splitlines()[0][:200]
        else:
            self.lost = None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 4):
            if self.alive():  # hung: no beat, the Lighthouse drops this replica
                self._beat()

    def finished(self) -> int | None:
        """The step the run finished at, when another replica finished it (a mark a shorter
        earlier run left in the directory does not count)."""
        try:
            step = int(json.loads(self.done_mark.read_text())["step"])
        except (OSError, ValueError, KeyError):
            return None
        return step if step >= self.final_step else None

    def quorum(self, step: int, meta: dict | None = None, failed: str | None = None) -> dict:
        """The decision for the next step (``decide``); ``{"done": True, "step": s}`` when the
        run was finished by the others. Raises ``LighthouseLost``."""
        start = time.monotonic()
        unreachable_since = None
        while True:
            done = self.finished()
            if done is not None:
                return {"done": True, "step": done}
            if self.client is None:
                raise LighthouseLost(f"the lost lighthouse ({self.address} unreachable: {self.lost})")
            data = dict(meta or {}, step=step, failed=failed, attempt=self.attempt, short_since=self.short_since)
            try:
                q = self.client.quorum(replica_id=self.id, timeout=timedelta(seconds=max(30.0, 4 * self.heartbeat_s)),
                                       step=step, world_size=1, shrink_only=False, data=data)
            except TimeoutError:
                continue  # nobody else asked yet (e.g. the others finished): check the mark, ask again
            except Exception as err:  # noqa: BLE001 - torchft raises plain RuntimeError
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since < self.lost_after_s:
                    time.sleep(0.2)
                    continue
                raise LighthouseLost(f"the lost lighthouse ({self.address} unreachable for {self.lost_after_s:.0f} s: "
                                     f"{str(err).splitlines()[0][:120]})") from err
            unreachable_since = None
            done = self.finished()  # the others finished while this one waited (e.g. it was cut off): a quorum
            if done is not None:  # formed once they stopped heartbeating must not train their last steps again
                return {"done": True, "step": done}
            d = decide(q.participants, self.replicas, self.last)
            if self.replica not in d["members"]:
                continue
            created = q.created.seconds + q.created.nanos * 1e-9
            short = len(d["members"]) < self.replicas
            if self.last is None and short and d["heal"] == [] and time.monotonic() - start < self.start_timeout_s:
                time.sleep(0.05)  # the start gate: the first quorum holds every replica group
                continue
            # every member decides alike (a restarted joiner too: it must not build a group the others skip)
            if short and (self.last is not None or d["heal"]) and not d["failed"] and self.rejoin_wait_s > 0:
                since = d["short_since"] if d["short_since"] is not None else created
                self.short_since = since
                if created - since < self.rejoin_wait_s:
                    time.sleep(0.1)  # a replica may be restarting: wait for it at this boundary
                    continue
            created_ns = q.created.seconds * 10**9 + q.created.nanos
            d["created_ns"], d["lighthouse_quorum"] = created_ns, f"{q.quorum_id}.{created_ns}"
            if self.settle(d) is None:  # the commit fence: others may hold newer steps of this lineage
                time.sleep(0.2)
                continue
            if not short:
                self.short_since = None
            d["quorum_id"] = group_key(d, q.quorum_id, created_ns)
            self.last = d
            return d

    def bye(self, step: int = 0) -> None:
        """The run is finished: a replica restarted after this is told so (``done_mark``)."""
        if self.finished() is None:
            self.done_mark.write_text(json.dumps({"step": step}))
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.heartbeat_s))


def main(argv: list[str] | None = None) -> None:
    """``python -m meshfold.train.quorum --bind HOST:PORT [--store HOST:PORT]``: the job's
    Lighthouse on a host of its own (one per job; the replica groups, on any host, reach it
    through ``MESHFOLD_LIVE_LIGHTHOUSE=host:port``), and with ``--store`` the store the
    cross-replica groups meet through (``MESHFOLD_LIVE_STORE``). Prints ``lighthouse
    HOST:PORT`` (and ``store HOST:PORT``) once it listens (port 0: a free one), then serves
    until killed."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m meshfold.train.quorum")
    ap.add_argument("--bind", default="[::]:29510")
    ap.add_argument("--store", default="", help="HOST:PORT: also serve the cross-replica store (HOST: the address "
                                                "the replica groups reach it at; it listens on every interface)")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    ap.add_argument("--join-timeout-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    server = start_lighthouse(args.bind, args.heartbeat_timeout_s, args.join_timeout_s)
    print("lighthouse", lighthouse_address(server, args.bind), flush=True)
    if args.store:
        import torch.distributed as dist  # only here: the Lighthouse alone needs no torch

        host, port = args.store.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False)
        print("store", f"{host}:{store.port}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
