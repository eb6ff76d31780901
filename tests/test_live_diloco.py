"""Live recovery's cross-replica communicator and low-communication training under
``train.live_recovery`` (docs/resilience.md): the abortable group (``train/abortable.py``),
Streaming DiLoCo / DiLoCo workers as failure domains, and tensor parallelism inside a
replica group."""

import copy
import json
import os
import threading
import time
from datetime import timedelta

import pytest
import tomli_w
import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.config import from_dict, validate
from meshfold.errors import ConfigError
from meshfold.data.dataset import GlobalBatchSampler
from meshfold.lowcomm.feature import WorkerSampler
from meshfold.testing import free_port, run_on, tiny_config, train_collect
from meshfold.train.abortable import AbortableGroup, CommAborted
from meshfold.train.live_watch import destroy
from meshfold.train.quorum import spawn_lighthouse
from meshfold.train.trainer import Trainer
from tests.test_live import _run_live, _traces, exit_codes, lose_the_lighthouse, spawn_group


def _abort_on_own_timeout(port: int) -> dict:
    """Rank 1 stops answering after one good all-reduce (it waits in the store, its sockets
    open); rank 0's next all-reduce on a group with a 2 s timeout (the backend's own: 62 s)
    raises ``CommAborted`` and the group is aborted, every later call raising at once. Then
    both ranks build fresh groups and all-reduce again, 12 times, each aborted and destroyed
    as a quorum change does: the process lived on and keeps no sockets of old groups."""
    rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    group = AbortableGroup(dist.PrefixStore("g1", store), rank, 2, 2.0, "cpu")
    t = torch.ones(4, dtype=torch.float64)
    comm.group_all_reduce(t, group, None)
    out = {"first": t.tolist()}
    if rank == 0:
        try:
            comm.group_all_reduce(torch.ones(4, dtype=torch.float64), group, None)
        except CommAborted as err:
            out["error"] = str(err)
        out["aborted"] = group.aborted
        try:
            comm.group_broadcast(torch.ones(1, dtype=torch.float64), 0, group, None)
        except CommAborted as err:
            out["later"] = str(err)
        store.set("rank0-gave-up", "1")
    else:
        store.wait(["rank0-gave-up"])  # never answers the second all-reduce
    group.abort()
    closer = threading.Thread(target=destroy, args=(group,))
    closer.start()
    closer.join(timeout=120)
    out["fresh"], out["fds"] = [], []
    for i in range(12):  # quorum changes: each group aborted and destroyed, its sockets closed
        fresh = AbortableGroup(dist.PrefixStore(f"g2/{i}", store), rank, 2, 60.0, "cpu")
        t = torch.full((2,), float(rank + 1), dtype=torch.float64)
        comm.group_all_reduce(t, fresh, None)
        out["fresh"].append(t.tolist())
        fresh.abort()
        closer = threading.Thread(target=destroy, args=(fresh,))
        closer.start()
        del fresh
        closer.join(timeout=120)
        out["fds"].append(len(os.listdir("/proc/self/fd")))
    return out


def test_abortable_group_aborts_on_its_own_timeout_and_the_process_lives():
    got = run_on(2, _abort_on_own_timeout, free_port())
    assert [g["first"] for g in got] == [[2.0] * 4] * 2
    r0 = got[0]
    assert "did not complete within its 2 s timeout" in r0["error"], r0
    assert r0["aborted"] and "was aborted" in r0["later"], r0
    for g in got:  # the same processes, new groups; no growth in open file descriptors
        assert g["fresh"] == [[3.0, 3.0]] * 12 and g["fds"][-1] <= g["fds"][3], g


# ---------------------------------------------------------------- Streaming DiLoCo workers

def _fragment_of(name: str, fragments: int) -> int:
    """Streaming DiLoCo's split, written out: block l -> l mod P, embeddings -> 0, the rest -> P - 1."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) % fragments
    return 0 if name.startswith(("tok_embeddings", "pos_embeddings")) else fragments - 1


def _streaming_reference(cfg: dict, outages: list[tuple[int, int]], stale_rule: bool = True) -> list[float]:
    """One process, no process group: the two workers' inner steps (two Trainers without
    [lowcomm], each on its slice of the W x B batch) and Streaming DiLoCo's outer step written
    out here, with the membership the live run had: for each (kill, heal) of ``outages``,
    worker 1 does not train steps kill..heal; after step ``heal`` (the exchange it rejoined at,
    which it added nothing to, or the checkpoint it resumed from) it holds worker 0's whole
    state (parameters, AdamW, scheduler, sampler) and adds nothing to the first exchange of
    each fragment not exchanged at ``heal``. Returns worker 0's losses (what metrics.jsonl logs)."""
    kills, heals = {k for k, _ in outages}, {h for _, h in outages}
    lc, t = cfg["lowcomm"], cfg["train"]
    H, P, tau, alpha = lc["inner_steps"], lc["fragments"], lc["overlap_steps"], lc.get("mixing", 0.5)
    mu, lr = lc.get("outer_momentum", 0.9), lc.get("outer_lr", 0.7)
    workers = []
    for w in range(2):
        one = copy.deepcopy(cfg)
        one["lowcomm"] = {}
        one["train"] = {k: v for k, v in t.items() if not k.startswith("live_")}
        one["train"]["run_dir"] = t["run_dir"] + f"-ref{w}"
        one["data"]["prefetch"] = 0
        tr = Trainer(from_dict(one))
        tr.sampler = WorkerSampler(len(tr.data.train), t["global_batch"], 2, w, t.get("seed", 0))
        workers.append(tr)

    def params(tr, p):
        return [x for n, x in tr.model.named_parameters() if _fragment_of(n, P) == p]

    def read(tr, p):
        return torch.cat([x.detach().reshape(-1) for x in params(tr, p)]).clone()

    def write(tr, p, flat):
        with torch.no_grad():
            for x, chunk in zip(params(tr, p), flat.split([x.numel() for x in params(tr, p)])):
                x.copy_(chunk.view_as(x))

    phi = [read(workers[0], p) for p in range(P)]
    momentum = [torch.zeros_like(x) for x in phi]
    offsets = [(p * H) // P for p in range(P)]
    alive, stale, pending, losses = {0, 1}, set(), {}, []
    for step in range(1, t["steps"] + 1):
        if step in kills:
            alive.discard(1)
        for w in sorted(alive):
            loss = workers[w].train_step()
            if w == 0:
                losses.append(loss)
        for p in range(P):
            if step % H == offsets[p]:
                adding = [w for w in sorted(alive) if not (w == 1 and p in stale)]
                pending[p] = (step + tau, sum(phi[p] - read(workers[w], p) for w in adding) / len(adding))
                stale.discard(p)
        last = step >= t["steps"]
        for p in sorted(pending):
            due, delta = pending[p]
            if due <= step or last:
                del pending[p]
                momentum[p].mul_(mu).add_(delta)
                phi[p].sub_(delta + mu * momentum[p], alpha=lr)
                mix = 0.0 if last else alpha
                for w in alive:
                    write(workers[w], p, mix * read(workers[w], p) + (1 - mix) * phi[p])
        if step in heals:
            src, dst = workers
            with torch.no_grad():
                for a, b in zip(dst.model.parameters(), src.model.parameters()):
                    a.copy_(b)
            dst.optimizer.load_state_dict(copy.deepcopy(src.optimizer.state_dict()))
            dst.scheduler.load_state_dict(src.scheduler.state_dict())
            dst.sampler.load_state_dict(src.sampler.state_dict())
            dst.step = step
            alive.add(1)
            stale = {p for p in range(P) if step % H != offsets[p] and stale_rule}
    return losses


# ---------------------------------------------------------------- model parallelism inside a replica

_ALL_INNER = pytest.mark.skipif(os.environ.get("MESHFOLD_LIVE_INNER") != "all",
                                reason="about a minute each: the suite runs tp 2 (the same heal, per rank); "
                                       "MESHFOLD_LIVE_INNER=all runs pp 2 and cp 2 too")


@pytest.mark.parametrize("inner", ["tp", pytest.param("pp", marks=_ALL_INNER), pytest.param("cp", marks=_ALL_INNER)])
def test_model_parallel_replica_killed_rejoins_and_losses_match(tmp_path, inner):
    """2 replica groups x (tp 2 | pp 2 | cp 2) (4 gloo processes, float64): rank 1 of replica 1
    SIGKILLed in step 3 after its backward. Its group restarts and rejoins with replica 0's
    shards or stages (each rank heals from the same rank of the source, on its own standalone group);
    steps 1..5 once each; every rank of the rejoined group bitwise equal to its peer from its
    rejoin on; every step's global batch trained exactly once, so every loss equals the
    one-process float64 run's within 1e-9 (relative)."""
    steps = 5
    cfg = tiny_config(str(tmp_path / "run"), parallel={"dp_replicate": 2, inner: 2, "dp_shard": 1},
                      train={"steps": steps, "live_recovery": True, "live_rejoin_wait_s": 300.0})
    records, events, took = _run_live(tmp_path, cfg, "1:1:3")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    rejoin = [e for e in events if e["event"] == "rejoin"]
    assert [e["replica"] for e in rejoin] == [1] and "state from replica 0" in rejoin[0]["cause"], events
    back = rejoin[0]["step"]
    traces = _traces(tmp_path / "run")
    for rank in (0, 1):
        for step in range(back, steps + 1):
            assert traces[(1, rank)][step]["params"] == traces[(0, rank)][step]["params"], (rank, step)
    reference = Trainer(from_dict(tiny_config(str(tmp_path / "ref"))))
    sampler = GlobalBatchSampler(len(reference.data.train), 8, 0)
    for step in range(1, steps + 1):  # exactly once: the replicas' slices are the step's global batch
        expected = sampler.next().tolist()
        trained = [i for (replica, r), t in traces.items() if r == 0 and step in t for i in t[step]["indices"]]
        assert sorted(trained) == sorted(expected), step
    ref = reference.fit()
    got = [r["loss"] for r in records]
    for a, b in zip(got, ref, strict=True):
        assert abs(a - b) <= 1e-9 * abs(b), (got, ref)
    print(f"live recovery, {inner} 2 in 2 replicas: {took:.1f} s (replica 1 back at step {back})")


def test_streaming_diloco_lighthouse_lost_kill_and_live_heal_losses_match(tmp_path):
    """2 Streaming DiLoCo workers x 1 process, float64; H = 4, 2 fragments (fragment 1
    exchanged at steps 2, 6, 10, fragment 0 at 4, 8), overlap 1 step, full precision; the
    multi-host launch (the Lighthouse and the store served by ``python -m
    meshfold.train.quorum``, each worker's group started on its own).

    1. Worker 1 killed in step 3, no restart left; worker 0 reaches fragment 0's exchange of
       step 4 and waits there for it (live_rejoin_wait_s). The Lighthouse is killed: the
       exchange finishes as a quorum of worker 0 alone, step 4 is logged, and at the next step
       boundary worker 0 writes its step-4 checkpoint and exits 75 with one line (before this
       change: exit 1 with a traceback).
    2. A new Lighthouse and both groups again: both resume from step 4 (worker 1 from worker
       0's checkpoint). Worker 1 is killed in step 5; its agent restarts it and it rejoins at
       fragment 1's exchange of step 6, receiving worker 0's parameters, AdamW, scheduler and
       sampler, the global copy, outer momentum, fragment 1's pending mean and its due step,
       and the outer step count (broadcasts, no pickle); it is bitwise equal to worker 0 then.

    Compared: steps 1..10 once in metrics.jsonl; each step's count of workers whose phase
    went into that step's exchange; every loss (worker 0's, as logged) equal within 1e-9
    (relative) to ``_streaming_reference`` with the same membership: worker 1 lost in steps
    3-4 and 5-6, given worker 0's state after steps 4 and 6. The reference without the
    stale-fragment rule differs (> 1e-6): the rule is what the run did."""
    run_dir, steps = tmp_path / "run", 10
    lowcomm = {"method": "streaming", "workers": 2, "inner_steps": 4, "fragments": 2, "overlap_steps": 1,
               "quant_bits": 32}
    cfg = tiny_config(str(run_dir), lowcomm=lowcomm, train={"steps": steps, "live_recovery": True,
                                                            "live_rejoin_wait_s": 600.0})
    (tmp_path / "live.toml").write_text(tomli_w.dumps(cfg))

    def group(replica: int, serve: dict, restarts: int, **env):
        return spawn_group(tmp_path, replica, serve, restarts, MESHFOLD_LIVE_TRACE="1", **env)

    start = time.monotonic()
    server, serve = spawn_lighthouse("127.0.0.1:0", 5.0, 30.0, store="127.0.0.1:0")
    first = [group(0, serve, 1), group(1, serve, 0, MESHFOLD_LIVE_KILL="1:0:3")]
    # (replica 0 finishes the outer exchange of step 4 as a quorum of one, then checkpoints)
    lose_the_lighthouse(run_dir, first, server, tmp_path / f"r0-{serve['store']}.log", 3, 4)

    server, serve = spawn_lighthouse("127.0.0.1:0", 5.0, 30.0, store="127.0.0.1:0")
    codes = exit_codes([group(0, serve, 0), group(1, serve, 1, MESHFOLD_LIVE_KILL="1:0:5")], server)
    logs = [(tmp_path / f"r{r}-{serve['store']}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], [x[-2000:] for x in logs]
    assert all("resumed from" in x for x in logs)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), records
    # worker 0 alone at 4 (lighthouse lost) and 6 (worker 1 rejoining); at 8 worker 1's fragment 0 is stale
    assert [r["replicas"] for r in records] == [2, 2, 2, 1, 2, 1, 2, 1, 2, 2], records
    assert [r.get("outer_step") for r in records] == [None, None, 1, None, 2, None, 3, None, 4, 5], records
    rejoin = [e for r in records for e in r.get("events", []) if e["event"] == "rejoin"]
    assert [(e["replica"], e["step"]) for e in rejoin] == [(1, 7)], rejoin
    healed = [json.loads(x) for x in (run_dir / "live-trace-r1-rank0.jsonl").read_text().splitlines()]
    healed = [r for r in healed if r["healed"]]
    survivor = {r["step"]: r for r in map(json.loads, (run_dir / "live-trace-r0-rank0.jsonl").read_text().splitlines())}
    assert [r["step"] for r in healed] == [6] and healed[0]["params"] == survivor[6]["params"]
    cfg["train"]["run_dir"] = str(tmp_path / "ref")
    ref = _streaming_reference(cfg, [(3, 4), (5, 6)])
    got = [r["loss"] for r in records]
    for a, b in zip(got, ref, strict=True):
        assert abs(a - b) <= 1e-9 * abs(b), (got, ref)
    cfg["train"]["run_dir"] = str(tmp_path / "other")
    other = _streaming_reference(cfg, [(3, 4), (5, 6)], stale_rule=False)
    assert max(abs(a - b) for a, b in zip(got, other)) > 1e-6, (got, other)
    print(f"live Streaming DiLoCo drill: {time.monotonic() - start:.1f} s")


def test_streaming_under_live_recovery_refusals_are_one_line(tmp_path):
    """What Streaming DiLoCo under live recovery does not do (the 4-bit exchange, two fragments
    in one step, a replayed phase) is refused before any process starts."""
    def cfg(**lowcomm):
        lc = {"method": "streaming", "workers": 2, "inner_steps": 4, "fragments": 2, "quant_bits": 32, **lowcomm}
        return from_dict(tiny_config(str(tmp_path), lowcomm=lc, train={"live_recovery": True}))

    validate(cfg(), 2)  # the supported form
    with pytest.raises(ConfigError, match=r"set lowcomm.quant_bits = 32 \(got 4\)"):
        validate(cfg(quant_bits=4), 2)
    with pytest.raises(ConfigError, match=r"lowcomm.fragments = 2 <= lowcomm.inner_steps = 1"):
        validate(cfg(inner_steps=1, overlap_steps=0), 2)
    with pytest.raises(ConfigError, match=r'built for lowcomm.method = "diloco" or "streaming"'):
        validate(cfg(method="noloco"), 2)
    replay = from_dict(tiny_config(str(tmp_path), lowcomm={"method": "streaming", "workers": 2, "inner_steps": 4,
                                                           "fragments": 2, "quant_bits": 32},
                                   train={"live_recovery": True, "live_replay_phase": True}))
    with pytest.raises(ConfigError, match=r"train.live_replay_phase replays a DiLoCo worker's phase"):
        validate(replay, 2)


def test_diloco_replayed_phase_is_exactly_once_and_matches_the_fault_free_run(tmp_path):
    """``train.live_replay_phase``: 2 DiLoCo workers x 1 process, outer step every 2 steps,
    worker 1 killed in step 3. Its agent restarts it; it loads its own phase start (step 2,
    written after the outer step) and replays steps 3-4 while worker 0 waits at the exchange of
    step 4; both then add their outer gradients as if nothing had happened: every sequence
    trained once, `replicas` 2 at every step, and every loss equal (1e-9, relative) to the
    fault-free 2-process run's, also after the outer step the replay fed (steps 5, 6)."""
    lowcomm = {"method": "diloco", "workers": 2, "inner_steps": 2}
    cfg = tiny_config(str(tmp_path / "run"), lowcomm=lowcomm,
                      train={"steps": 6, "live_recovery": True, "live_rejoin_wait_s": 300.0,
                             "live_replay_phase": True})
    records, events, took = _run_live(tmp_path, cfg, "1:0:3", nproc=2)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r.get("outer_step") for r in records] == [None, 1, None, 2, None, 3]
    assert [r["replicas"] for r in records] == [2] * 6, records
    rejoin = [e for e in events if e["event"] == "rejoin"]
    assert [(e["replica"], e["step"]) for e in rejoin] == [(1, 5)] and "was up to date" in rejoin[0]["cause"], events
    traces = _traces(tmp_path / "run")
    survivor, replayed = traces[(0, 0)], traces[(1, 0)]
    assert [(s, replayed[s]["attempt"]) for s in sorted(replayed)] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1)]
    for step in (2, 4, 6):  # theta = phi after every outer step, on both
        assert replayed[step]["params"] == survivor[step]["params"], step
    ref = run_on(2, train_collect, tiny_config(str(tmp_path / "ref"), lowcomm=lowcomm, train={"steps": 6}))[0]
    got = [r["loss"] for r in records]
    for a, b in zip(got, ref["losses"], strict=True):
        assert abs(a - b) <= 1e-9 * abs(b), (got, ref["losses"])
    print(f"live DiLoCo with a replayed phase: {took:.1f} s")


def test_diloco_stale_worker_never_applies_an_exchange_the_others_made(tmp_path):
    """The commit fence for DiLoCo workers (train/live_fence.py: they claim their outer
    exchanges). 2 workers x 1 process, an exchange every 2 steps: worker 0 is stopped in step 2
    until worker 1 has logged step 4 (its exchanges at steps 2 and 4 made alone); worker 1 is
    then stopped in step 5 for 8 s. Worker 0, back, reaches its step-2 exchange while worker 1 is
    silent, so the Lighthouse answers it alone: without the fence it made that exchange again
    and logged steps 2-4 a second time; now it waits, joins worker 1's step-6 exchange behind
    (adding nothing) and is healed. Every step logged once; both workers bitwise equal after
    their last exchange together."""
    cfg = tiny_config(str(tmp_path / "run"), lowcomm={"method": "diloco", "workers": 2, "inner_steps": 2},
                      train={"steps": 8, "live_recovery": True, "live_heartbeat_timeout_s": 3.0,
                             "live_join_timeout_s": 1.0, "collective_timeout_s": 60.0})
    records, events, took = _run_live(tmp_path, cfg, "", nproc=2, MESHFOLD_LIVE_STOP="0:0:2:120:4,1:0:5:8")
    assert [r["step"] for r in records] == list(range(1, 9)), [r["step"] for r in records]
    traces = _traces(tmp_path / "run")
    last = max(set(traces[(0, 0)]) & set(traces[(1, 0)]) & {2, 4, 6, 8})  # after an exchange: theta = phi
    assert last >= 6 and traces[(0, 0)][last]["params"] == traces[(1, 0)][last]["params"], last
    print(f"live DiLoCo stale worker: {took:.1f} s, replicas {[r['replicas'] for r in records]}, events "
          f"{[(e['event'], e['replica'], e['step']) for e in events]}")
