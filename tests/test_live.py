"""Live recovery (train.live_recovery; docs/resilience.md) through the real CLI: 4 gloo
processes as 2 replica groups x 2 FSDP shards, one process of replica 1 SIGKILLed in the
middle of step 3 (after its backward, before the cross-replica exchange). The job goes on
and exits 0; replica 1's agent restarts its group, which rejoins at a step boundary with
the state of replica 0 received live; every step's global batch is trained exactly once,
so every loss equals the one-process float64 run of the same seed and batch."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import tomli_w
import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.config import from_dict, validate
from meshfold.errors import ConfigError
from meshfold.data.dataset import GlobalBatchSampler
from meshfold.planner.goodput import FailureModel, goodput
from meshfold.testing import free_port, run_on, tiny_config, train_collect
from meshfold.train.live_watch import destroy
from meshfold.train.quorum import Membership, group_key, lighthouse_address, spawn_lighthouse, start_lighthouse
from meshfold.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
STEPS, KILL_STEP = 5, 3


def _traces(run_dir: Path, healed: bool = False) -> dict[tuple[int, int], dict[int, dict]]:
    """(replica, rank) -> step -> what that rank trained and its parameter digest (after the
    step; ``healed``: also the digest a rejoined rank has right after receiving the state)."""
    out = {}
    for path in run_dir.glob("live-trace-r*-rank*.jsonl"):
        replica, rank = (int(x) for x in path.stem[len("live-trace-r"):].split("-rank"))
        out[(replica, rank)] = {r["step"]: r for r in map(json.loads, path.read_text().splitlines())
                                if healed or not r["healed"]}
    return out


def _run_live(tmp_path: Path, cfg: dict, kill: str, nproc: int = 4, **env) -> tuple[list[dict], list[dict], float]:
    """``meshfold train --nproc N`` of ``cfg`` with one process SIGKILLed (``kill``; ``env``:
    other fault injections): the metrics records, their events, and the wall time."""
    (tmp_path / "live.toml").write_text(tomli_w.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHFOLD_LIVE_TRACE="1", MESHFOLD_LIVE_KILL=kill, **env)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshfold", "train", str(tmp_path / "live.toml"), "--nproc", str(nproc)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if kill:  # the death messages say what happens under live recovery: the group restarts and rejoins
        replica = kill.split(":")[0]
        assert f"meshfold: launcher: replica group {replica}: rank " in proc.stderr, proc.stderr[-3000:]
        assert "(restart 1 of 3); they rejoin the running groups from a peer" in proc.stderr, proc.stderr[-3000:]
    assert "restart from the last checkpoint" not in proc.stderr + proc.stdout
    records = [json.loads(x) for x in (Path(cfg["train"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return records, [e for r in records for e in r.get("events", [])], took


def _rejoin_step(events: list[dict], replica: int, first: int) -> int:
    """The step replica ``replica`` rejoined at: ``first`` (its restart was back before the
    survivors' redo formed) or later, told in the event which state it received."""
    rejoin = [e for e in events if e["event"] == "rejoin" and e["replica"] == replica]
    assert len(rejoin) == 1 and rejoin[0]["step"] >= first, events
    step = rejoin[0]["step"]
    assert f"received step {step - 1}'s state from replica 0" in rejoin[0]["cause"], rejoin
    return step


def _assert_exactly_once(traces: dict, steps: int, ranks, ref_dir: Path) -> Trainer:
    """Every step's sequences, over the replicas, are exactly that step's global batch of the
    run without failures (one replica each); returns that run's one-process trainer."""
    reference = Trainer(from_dict(tiny_config(str(ref_dir))))
    sampler = GlobalBatchSampler(len(reference.data.train), 8, 0)
    for step in range(1, steps + 1):
        expected = sampler.next().tolist()
        for rank in ranks:
            trained = [i for (replica, r), t in traces.items() if r == rank and step in t
                       for i in t[step]["indices"]]
            assert sorted(trained) == sorted(expected), (step, rank)
    return reference


def _assert_losses(records: list[dict], reference: Trainer) -> None:
    """Every logged loss equals the one-process float64 run's within 1e-9 (relative)."""
    ref_losses = reference.fit()
    for got, ref in zip([r["loss"] for r in records], ref_losses, strict=True):
        assert abs(got - ref) <= 1e-9 * abs(ref), ([r["loss"] for r in records], ref_losses)


@pytest.mark.parametrize("restart", ["any", "fast"])
def test_replica_killed_mid_step_rejoins_and_losses_match(tmp_path, restart):
    """Whatever the restart's speed (back before the survivors' redo formed: step 3 trained by
    both; or after it: step 3 by replica 0 alone, replica 1 back at step 4), the invariants:
    steps 1..5 once each, one departure and one rejoin with their causes, every step's global
    batch trained exactly once, the rejoined replica bitwise equal to the survivor from its
    rejoin on, every loss equal to the one-process run's. ``fast`` forces the fast restart
    (the one the first Lighthouse version hung on: the same quorum id back): with 300 s
    heartbeat and join timeouts the Lighthouse holds the survivors' redo until the restarted
    replica 1 asks, so it rejoins at step 3 itself."""
    timeouts = {"live_heartbeat_timeout_s": 300.0, "live_join_timeout_s": 300.0} if restart == "fast" else {}
    cfg = tiny_config(str(tmp_path / "run"), parallel={"dp_replicate": 2, "dp_shard": 2},
                      train={"steps": STEPS, "live_recovery": True, "live_rejoin_wait_s": 300.0, **timeouts})
    records, events, took = _run_live(tmp_path, cfg, f"1:1:{KILL_STEP}")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none repeated, none missing
    back = _rejoin_step(events, 1, KILL_STEP)
    assert back == KILL_STEP or restart != "fast", events
    replicas = [r["replicas"] for r in records]
    assert replicas == [2] * (KILL_STEP - 1) + [1] * (back - KILL_STEP) + [2] * (STEPS - back + 1), replicas
    departure = [e for e in events if e["event"] == "departure"]
    assert [(e["replica"], e["step"]) for e in departure] == [(1, KILL_STEP)], events
    assert "killed" in departure[0]["cause"] and "lost its cross-replica exchange" in departure[0].get("seen_as", ""), events

    traces = _traces(tmp_path / "run")
    for rank in (0, 1):
        survivor, rejoined = traces[(0, rank)], traces[(1, rank)]
        for step in range(back, STEPS + 1):  # bitwise: sha1 of every local shard's bytes
            assert rejoined[step]["attempt"] == 1 and rejoined[step]["params"] == survivor[step]["params"], (rank, step)
    _assert_losses(records, _assert_exactly_once(traces, STEPS, (0, 1), tmp_path / "ref"))
    print(f"live recovery run: {took:.1f} s (replica 1 back at step {back})")


def test_hung_replica_is_dropped_within_the_heartbeat_timeout_and_rejoins(tmp_path):
    """The drill a kill -9 does not show: replica 1's worker SIGSTOPped in the middle of step
    3 (before its cross-replica exchange), a 3 s heartbeat timeout and a 300 s collective
    timeout; it is SIGCONTed only once metrics.jsonl holds step 3 (replica 0 trained it
    alone), so the order of events is the same on any machine. Replica 0 abandons the exchange
    once replica 1's beat is stale ("stopped heartbeating": not the collective timeout, which
    the stop outlasts), the Lighthouse drops replica 1, replica 0 finishes step 3 alone and
    waits at the boundary (live_rejoin_wait_s); on SIGCONT replica 1 sees the others went on
    without it, drops its step and rejoins with replica 0's state. No step repeated or
    skipped, losses equal the one-process run."""
    cfg = tiny_config(str(tmp_path / "run"), parallel={"dp_replicate": 2},
                      train={"steps": STEPS, "live_recovery": True, "live_rejoin_wait_s": 300.0,
                             "live_heartbeat_timeout_s": 3.0, "collective_timeout_s": 300.0})
    records, events, took = _run_live(tmp_path, cfg, "", nproc=2, MESHFOLD_LIVE_STOP=f"1:0:{KILL_STEP}:300:{KILL_STEP}")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none repeated, none missing
    assert [r["replicas"] for r in records] == [2] * (KILL_STEP - 1) + [1] + [2] * (STEPS - KILL_STEP), records
    departure = [e for e in events if e["event"] == "departure"]
    assert [(e["replica"], e["step"]) for e in departure] == [(1, KILL_STEP)], events
    assert "stopped heartbeating" in departure[0]["seen_as"], departure
    assert _rejoin_step(events, 1, KILL_STEP + 1) == KILL_STEP + 1
    traces = _traces(tmp_path / "run")
    assert KILL_STEP not in traces[(1, 0)]  # replica 1 dropped its step 3: trained once, by replica 0
    for step in range(KILL_STEP + 1, STEPS + 1):
        assert traces[(1, 0)][step]["params"] == traces[(0, 0)][step]["params"], step
    _assert_losses(records, _assert_exactly_once(traces, STEPS, (0,), tmp_path / "ref"))
    print(f"hung-replica drill: {took:.1f} s")


def test_every_group_lost_resumes_from_the_newest_checkpoint(tmp_path):
    """Every worker of every replica group killed in step 4 (2 replicas x 1 rank, a checkpoint
    every 2 steps): each group's agent restarts it, and the restarted groups resume from the
    newest checkpoint (step 2) and train steps 3-5, never from initialisation; the losses equal
    the one-process run's."""
    cfg = tiny_config(str(tmp_path / "run"), parallel={"dp_replicate": 2},
                      train={"steps": STEPS, "live_recovery": True, "checkpoint_every": 2})
    records, events, took = _run_live(tmp_path, cfg, "0:0:4,1:0:4", nproc=2)
    traces = {key: [(json.loads(x)["step"], json.loads(x)["attempt"]) for x in
                    (tmp_path / "run" / f"live-trace-r{key[0]}-rank{key[1]}.jsonl").read_text().splitlines()]
              for key in ((0, 0), (1, 0))}
    for key, trained in traces.items():  # step 3 again after checkpoint 2, by the restarted groups
        assert trained == [(1, 0), (2, 0), (3, 0), (3, 1), (4, 1), (5, 1)], (key, trained)
    # metrics.jsonl: the resume dropped the lines after step 2, then steps 3-5 were logged again
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    assert [r["replicas"] for r in records] == [2] * STEPS, records
    _assert_losses(records, Trainer(from_dict(tiny_config(str(tmp_path / "ref")))))
    # each checkpoint records the lineage of its state (live_fence.py): the restart is weighed in it
    manifests = [json.loads(m.read_text()) for m in (tmp_path / "run").rglob("meshfold.json")]
    assert manifests and all("live" in m["extras"] for m in manifests), manifests
    print(f"every-group-lost run: {took:.1f} s")


def test_diloco_worker_killed_rejoins_at_the_outer_step(tmp_path):
    """2 DiLoCo workers, one process each (the inner layout's part is shown above; this keeps
    the suite's time), outer step every 2 steps; worker 1 killed in step 3. Worker 0 trains on; at the outer step 4 the quorum waits for the restarted
    worker, averages the outer gradient over the one worker that trained the phase, and the
    rejoined worker receives the new global copy, outer momentum and inner Adam state.
    Data: at most once (worker 1's sequences of steps 3-4 are not trained)."""
    lowcomm = {"method": "diloco", "workers": 2, "inner_steps": 2}
    cfg = tiny_config(str(tmp_path / "run"), lowcomm=lowcomm,
                      train={"steps": 6, "live_recovery": True, "live_rejoin_wait_s": 300.0})
    records, events, took = _run_live(tmp_path, cfg, "1:0:3", nproc=2)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r.get("outer_step") for r in records] == [None, 1, None, 2, None, 3]
    assert [r["replicas"] for r in records] == [2, 2, 2, 1, 2, 2]  # outer step 2: worker 0's phase only
    assert [(e["event"], e["replica"]) for e in events if e["event"] != "join"] == [("departure", 1), ("rejoin", 1)]
    assert all("rejoin" not in e["event"] and "departure" not in e["event"]
               for r in records if r["step"] != 4 for e in r.get("events", []))
    traces = _traces(tmp_path / "run", healed=True)
    survivor, rejoined = traces[(0, 0)], traces[(1, 0)]
    assert 3 not in rejoined and rejoined[4]["healed"] and rejoined[4]["attempt"] == 1
    for step in (4, 6):  # right after the rejoin (theta = phi) and at the next outer step
        assert rejoined[step]["params"] == survivor[step]["params"], step
    # Losses (worker 0, as metrics.jsonl logs): the run without the fault (2 processes, the
    # same seed and batches) up to the outer step the lost phase would have joined, then not.
    ref = run_on(2, train_collect, tiny_config(str(tmp_path / "ref"), lowcomm=lowcomm, train={"steps": 6}))[0]
    got = [r["loss"] for r in records]
    for step in range(4):
        assert abs(got[step] - ref["losses"][step]) <= 1e-9 * abs(ref["losses"][step]), (got, ref["losses"])
    assert abs(got[4] - ref["losses"][4]) > 1e-6  # outer step 2 averaged one worker's phase, not two
    print(f"live recovery (DiLoCo) run: {took:.1f} s")


def test_membership_on_the_lighthouse_gate_redo_rejoin_refusal(tmp_path):
    """Membership alone, on a real Lighthouse (torchft, in this process; 0.5 s heartbeat
    timeout, 600 s join timeout): the start gate holds the first quorum until every replica asks; a redo goes on
    without a replica that stopped heartbeating (hung: its ``alive`` says no) within the
    heartbeat timeout; the rejoined one is told to heal from the newest member; a client
    claiming a replica id outside the job is refused; garbage sent to the Lighthouse's port
    does not take it down; a replica restarted after the run finished is told so."""
    server = start_lighthouse("127.0.0.1:0", heartbeat_timeout_s=0.5, join_timeout_s=600.0)
    address = lighthouse_address(server, "127.0.0.1:0")
    mark = tmp_path / "live-done.json"
    hung = threading.Event()
    a = Membership(address, 0, 2, 0, 0.5, mark, 3)
    b = Membership(address, 1, 2, 0, 0.5, mark, 3, alive=lambda: not hung.is_set())
    got = {}
    t = threading.Timer(0.5, lambda: got.update(b=b.quorum(0, {"sampler": "b0"})))
    t.start()  # replica 1 asks late: the gate holds replica 0 until it does
    first = a.quorum(0, {"sampler": "s0"})
    t.join()
    assert first["members"] == [0, 1] and got["b"]["quorum_id"] == first["quorum_id"]
    assert [e["event"] for e in first["events"]] == ["join", "join"]
    with socket.create_connection(address.split(":")) as junk:  # a malformed client
        junk.sendall(b"PRI * HTTP/2.0\r\n\r\nnot grpc at all\n" * 100)
    hung.set()  # replica 1 hangs: it stops heartbeating and never asks
    asker = threading.Thread(target=lambda: got.update(redo=a.quorum(2, {"sampler": "s2"}, failed="peer lost")))
    asker.start()  # the 600 s join timeout cannot be what answers it: only the heartbeat's lapse
    asker.join(timeout=120)
    redo = got["redo"]
    assert redo["members"] == [0] and redo["quorum_id"] != first["quorum_id"], redo
    dep = [e for e in redo["events"] if e["event"] == "departure"]
    assert [(e["replica"], e["step"]) for e in dep] == [(1, 3)] and dep[0]["seen_as"] == "peer lost"
    stray = Membership(address, 7, 2, 0, 0.5, mark, 3)  # not one of the job's replicas
    hung.clear()
    back = Membership(address, 1, 2, 1, 0.5, mark, 3)
    threading.Timer(0.3, lambda: got.update(c=back.quorum(0, {"sampler": "c0"}))).start()
    threading.Timer(0.3, lambda: got.update(s=_ask_quietly(stray))).start()
    a.rejoin_wait_s = 300.0  # bounds the wait; replica 1 asks at 0.3 s
    later = a.quorum(3, {"sampler": "s3"})  # waits (rejoin_wait_s) for the restarting replica 1
    assert later["members"] == [0, 1] and later["heal"] == [1] and later["source"] == 0, later
    assert later["meta"]["sampler"] == "s3" and "7" in later["refused"] + got.get("s", {}).get("refused", ["7"])
    assert [e["event"] for e in later["events"]] == ["rejoin"] and "received step 3's state" in later["events"][0]["cause"]
    a.bye(step=3)  # replica 0 finished the run: a replica restarted after that has nothing to do
    late = Membership(address, 1, 2, 2, 0.5, mark, 3)
    assert late.quorum(0) == {"done": True, "step": 3}
    for m in (b, back, stray, late):
        m.close()
    server.shutdown()


def test_group_key_is_never_reused():
    """The standalone group's store key (quorum.group_key): kept while every member holds the
    same group of exactly these members; a new one, named by the quorum's creation time too,
    when a member holds another (a restarted replica holds none), a member heals or a step
    failed, even when a fast restart brings back the same Lighthouse quorum id."""
    def d(groups, heal=(), failed=None):
        return {"members": sorted(groups), "groups": groups, "heal": list(heal), "failed": failed}
    first = group_key(d({0: None, 1: None}), 1, 100)
    assert first == "1.100.m0-1"
    assert group_key(d({0: first, 1: first}), 1, 200) == first  # the same quorum, next step: kept
    keys = [first,
            group_key(d({0: first, 1: None}), 1, 300),  # replica 1 restarted fast: same quorum id 1
            group_key(d({0: first, 1: first}, heal=[1]), 1, 400),
            group_key(d({0: first, 1: first}, failed="lost"), 1, 500),
            group_key(d({0: first}), 2, 600)]  # replica 1 dropped: its members differ
    assert len(set(keys)) == len(keys) and keys[-1] == "2.600.m0", keys
    assert group_key(d({0: "2.600.m0", 1: "2.600.m0"}), 3, 700) == "3.700.m0-1"  # not a group of these members


def _group_churn(port: int, rounds: int) -> list[int]:
    """Rounds of a standalone group of the 2 ranks, as live recovery makes one per quorum:
    built, one all-reduce, aborted and closed off the thread; this rank's open file
    descriptors after each round."""
    rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    fds = []
    for i in range(rounds):
        group = comm.StandaloneGroup(dist.PrefixStore(f"churn/{i}", store), rank, 2, 120.0, "cpu")
        t = torch.ones(3, dtype=torch.float64)
        comm.group_all_reduce(t, group, None)
        assert t.tolist() == [2.0, 2.0, 2.0]
        group.abort()
        closer = threading.Thread(target=destroy, args=(group,))
        closer.start()
        del group
        closer.join(timeout=120)
        fds.append(len(os.listdir("/proc/self/fd")))
    return fds


def test_old_standalone_groups_are_destroyed():
    """20 quorum changes in a row (drill h): no growth in open file descriptors (each group's
    sockets close with it)."""
    for fds in run_on(2, _group_churn, free_port(), 20):
        assert fds[-1] <= fds[4], fds


def test_live_recovery_without_torchft_is_one_line(tmp_path, monkeypatch):
    """torchft is the `live` extra: without it, train.live_recovery is refused before any process starts."""
    import importlib.util

    cfg = from_dict(tiny_config(str(tmp_path), parallel={"dp_replicate": 2}, train={"live_recovery": True}))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else object())
    with pytest.raises(ConfigError, match=r"needs torchft's Lighthouse: pip install .*\[live\]"):
        validate(cfg, 2)


def _ask_quietly(m):
    m.start_timeout_s = 0.0
    try:
        return m.quorum(0)
    except Exception:  # noqa: BLE001
        return {}


def test_goodput_live_recovery_beats_restarts_at_scale():
    fm = FailureModel(mtbf_node_h=6334.0, restart_s=600.0, save_s=30.0, replace_s=300.0, transfer_s=10.0)
    small, large = goodput(128, 8, 2.0, fm), goodput(2048, 128, 2.0, fm)
    assert 0 < large["goodput_restart"] < small["goodput_restart"] < 1  # more nodes, more failures
    assert large["goodput_live"] > large["goodput_restart"] and small["goodput_live"] > small["goodput_restart"]
    assert abs(large["failures_per_day"] - 2048 * 24 / 6334.0) < 1e-9
    assert goodput(2048, 1, 2.0, fm)["goodput_live"] is None  # one replica group: nothing to go on with


def _wait_for_step(run_dir: Path, step: int, procs, bound_s: float = 400.0) -> None:
    """Until metrics.jsonl holds ``step`` (bounded; fails at once if a process ended first)."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        try:
            if any(json.loads(x).get("step") == step for x in (run_dir / "metrics.jsonl").read_text().splitlines()):
                return
        except (OSError, ValueError):
            pass
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {bound_s} s")


def spawn_group(tmp_path: Path, replica: int, serve: dict, restarts: int, **env) -> subprocess.Popen:
    """Replica group ``replica`` of 2 as its own ``meshfold train --nproc 1`` (its own elastic
    agent, as on a host of its own) on ``tmp_path/live.toml``, with the Lighthouse and store of
    ``serve``; its output in ``r<replica>-<store>.log``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHFOLD_LIVE_REPLICA=str(replica), MESHFOLD_LIVE_REPLICAS="2",
               MESHFOLD_LIVE_LIGHTHOUSE=serve["lighthouse"], MESHFOLD_LIVE_STORE=serve["store"], **env)
    log = (tmp_path / f"r{replica}-{serve['store']}.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "meshfold", "train", str(tmp_path / "live.toml"), "--nproc", "1",
                             "--max-restarts", str(restarts)], cwd=ROOT, env=env, stdout=log, stderr=log)


def _stop(procs: list) -> None:
    for p in procs:
        p.kill()
        p.wait()


def exit_codes(groups: list, server) -> list[int]:
    """Each replica group's exit code once it finishes (400 s at most), then every process stopped."""
    try:
        return [p.wait(timeout=400) for p in groups]
    finally:
        _stop(groups + [server])


def lose_the_lighthouse(run_dir: Path, first: list, server, log: Path, step: int, saved: int) -> tuple[float, float]:
    """Replica 0 of ``first`` reaches ``step`` while replica 1 dies for good; the Lighthouse
    ``server`` is killed: replica 0 must checkpoint (``after step <saved>``) and exit 75 with one
    line and no traceback. Returns when the step was reached and when replica 0 stopped."""
    try:
        _wait_for_step(run_dir, step, first[:1])
        assert first[1].wait(timeout=300) != 0  # killed, no restart left
        reached = time.monotonic()
        server.kill()
        assert first[0].wait(timeout=300) == 75
        stopped = time.monotonic()
    finally:
        _stop(first + [server])
    out = log.read_text()
    lost = [x for x in out.splitlines() if "lost lighthouse" in x]
    assert len(lost) == 1 and f"after step {saved}; checkpoint" in lost[0] and "exit code 75" in lost[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    return reached, stopped


def test_two_hosts_lighthouse_lost_stops_with_75_and_a_restart_resumes(tmp_path):
    """The multi-host launch on one machine: the Lighthouse and the cross-replica store served
    by ``python -m meshfold.train.quorum`` on an address of their own (127.0.0.2), each replica
    group started on its own (``MESHFOLD_LIVE_REPLICA``, as torchrun or Slurm does per host).
    Replica 1 is killed in step 3 with no restart left: replica 0 trains step 3 alone and waits
    at the boundary for it (live_rejoin_wait_s). The Lighthouse is then killed: replica 0
    writes its step-3 checkpoint and exits 75 with one line. A new Lighthouse (127.0.0.3) and
    both groups again: they resume from step 3 (never step 0) and finish; steps 1..6 once in
    metrics.jsonl, every loss equal to the one-process run's."""
    run_dir, steps = tmp_path / "run", 6
    cfg = tiny_config(str(run_dir), parallel={"dp_replicate": 2},
                      train={"steps": steps, "live_recovery": True, "live_rejoin_wait_s": 600.0})
    (tmp_path / "live.toml").write_text(tomli_w.dumps(cfg))

    def group(replica: int, serve: dict, restarts: int, **env):
        return spawn_group(tmp_path, replica, serve, restarts, **env)

    server, serve = spawn_lighthouse("127.0.0.2:0", 5.0, 30.0, store="127.0.0.2:0")
    assert serve["lighthouse"].startswith("127.0.0.2:") and serve["store"].startswith("127.0.0.2:"), serve
    first = [group(0, serve, 1), group(1, serve, 0, MESHFOLD_LIVE_KILL="1:0:3")]
    start = time.monotonic()
    # replica 0 trains step 3 alone (it waits for replica 1), then checkpoints and exits 75
    at_3, stopped = lose_the_lighthouse(run_dir, first, server, tmp_path / f"r0-{serve['store']}.log", 3, 3)

    server, serve = spawn_lighthouse("127.0.0.3:0", 5.0, 30.0, store="127.0.0.3:0")
    codes = exit_codes([group(0, serve, 0), group(1, serve, 0)], server)
    print(f"two-host drill: step 3 after {at_3 - start:.1f} s, exit 75 {stopped - at_3:.1f} s after the lighthouse's "
          f"loss, the restart took {time.monotonic() - stopped:.1f} s")
    assert codes == [0, 0], [(tmp_path / f"r{r}-{serve['store']}.log").read_text()[-2000:] for r in (0, 1)]
    assert "resumed from" in (tmp_path / f"r0-{serve['store']}.log").read_text()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), records
    assert [r["replicas"] for r in records] == [2, 2, 1, 2, 2, 2], records
    _assert_losses(records, Trainer(from_dict(tiny_config(str(tmp_path / "ref"), train={"steps": steps}))))
