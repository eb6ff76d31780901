"""Live recovery's long fault drills (issue #41; docs/resilience.md), each through the real
CLI on gloo processes, float64, strict mode, and each judged on invariants only, never on a
duration: every step logged once; each step's sequences, over the replicas, exactly that
step's global batch (each trained once); every loss equal to a one-process float64 run of
the same sequences within 1e-9 (relative); every replica's parameters bitwise equal (SHA-1
of each rank's local shard) at every step it committed; the departures and rejoins the
drill causes are in metrics.jsonl's events.

    python benchmarks/live_faults.py                      # every drill once, a table, the JSON
    python benchmarks/live_faults.py --repeat 3 --only stop60_3x2,two_at_once
    python benchmarks/live_faults.py --list

Writes benchmarks/results/live_faults.json (each run: passed, wall seconds on this machine,
replicas per step, events). The netlab drill needs root (network namespaces, ``meshfold
netlab``); without it, it is reported as skipped with the reason. The short versions that
run in the test suite are in tests/test_live_faults.py (they share ``run_drill``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshfold.config import from_dict  # noqa: E402
from meshfold.data.dataset import GlobalBatchSampler  # noqa: E402
from meshfold.lowcomm.netlab import NetLab, available  # noqa: E402
from meshfold.testing import tiny_config  # noqa: E402
from meshfold.train.quorum import spawn_lighthouse  # noqa: E402
from meshfold.train.trainer import Trainer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GLOBAL_BATCH = 12  # divisible by 2 and 3 replicas of 1 or 2 shards


@dataclass
class Drill:
    """One fault drill: the layout, the faults (``MESHFOLD_LIVE_*``), what must follow."""

    name: str
    what: str
    replicas: int
    shards: int = 1
    steps: int = 6
    env: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    departed: tuple = ()  # replicas with a departure event (at least once)
    rejoined: tuple = ()  # replicas with a rejoin event
    per_step: list | None = None  # `replicas` of every step, where the drill forces it


DRILLS = {d.name: d for d in [
    Drill("stop60_3x2", "(a) 3 replicas x 2 ranks: replica 2's rank 1 SIGSTOPped in step 3 for 60 s; "
          "the others drop it, train step 3 alone, wait for it at the boundary; SIGCONT: it rejoins",
          3, 2, env={"MESHFOLD_LIVE_STOP": "2:1:3:60"},
          train={"live_rejoin_wait_s": 300.0, "live_heartbeat_timeout_s": 3.0, "collective_timeout_s": 300.0},
          departed=(2,), rejoined=(2,), per_step=[3, 3, 2, 3, 3, 3]),
    Drill("stop60_2x2", "(b) the same with 2 replicas x 2 ranks: replica 1's rank 1 stopped 60 s",
          2, 2, env={"MESHFOLD_LIVE_STOP": "1:1:3:60"},
          train={"live_rejoin_wait_s": 300.0, "live_heartbeat_timeout_s": 3.0, "collective_timeout_s": 300.0},
          departed=(1,), rejoined=(1,), per_step=[2, 2, 1, 2, 2, 2]),
    Drill("quorum_kill", "(c) 3 x 1: replica 2 killed right after the first quorum named it, before its "
          "group formed (the others' rendezvous would wait for it the whole collective timeout)",
          3, env={"MESHFOLD_LIVE_KILL": "2:0:1:quorum"}, train={"live_rejoin_wait_s": 300.0},
          departed=(2,), rejoined=(2,)),
    Drill("heal_source_kill", "(d) 3 x 1: replica 2 killed in step 3; when it rejoins, the heal source "
          "(replica 0) is killed after the first tensor: replica 1 goes on, both come back",
          3, env={"MESHFOLD_LIVE_KILL": "2:0:3,0:0:*:heal"}, train={"live_rejoin_wait_s": 300.0},
          departed=(0, 2), rejoined=(0, 2)),
    Drill("heal_joiner_kill", "(d) 3 x 1: replica 2 killed in step 3, and its restart killed in the middle "
          "of its heal; its second restart rejoins", 3,
          env={"MESHFOLD_LIVE_KILL": "2:0:3,2:0:*:heal:1"}, train={"live_rejoin_wait_s": 300.0},
          departed=(2,), rejoined=(2,)),
    Drill("two_at_once", "(e) 3 x 2: replicas 1 and 2 killed in the same step 3 (one rank each); "
          "replica 0 goes on alone, both rejoin", 3, 2,
          env={"MESHFOLD_LIVE_KILL": "1:0:3,2:1:3"}, train={"live_rejoin_wait_s": 300.0},
          departed=(1, 2), rejoined=(1, 2)),
    Drill("stale_quorum_2x1", "2 x 1: replica 0 stopped in step 2 until replica 1 logged step 3 alone; "
          "then replica 1 stopped in step 4 for 8 s: replica 0, back, must not take the Lighthouse's "
          "quorum of itself to train steps 2-3 again (the commit fence); it waits and is healed", 2, steps=6,
          env={"MESHFOLD_LIVE_STOP": "0:0:2:120:3,1:0:4:8"},
          train={"live_heartbeat_timeout_s": 3.0, "live_join_timeout_s": 1.0, "live_rejoin_wait_s": 0.0,
                 "collective_timeout_s": 60.0},
          departed=(0,), rejoined=(0,)),
]}


def drill_config(d: Drill, run_dir: Path) -> dict:
    return tiny_config(str(run_dir), parallel={"dp_replicate": d.replicas, "dp_shard": d.shards},
                       train={"steps": d.steps, "global_batch": GLOBAL_BATCH, "live_recovery": True, **d.train})


def reference_losses(steps: int, ref_dir: Path) -> list[float]:
    """The one-process float64 run of the same seed and global batches."""
    return Trainer(from_dict(tiny_config(str(ref_dir), train={"steps": steps, "global_batch": GLOBAL_BATCH}))).fit()


def traces(run_dir: Path) -> dict[tuple[int, int], list[dict]]:
    """(replica, rank) -> the steps it committed (MESHFOLD_LIVE_TRACE), every attempt."""
    out = {}
    for path in run_dir.glob("live-trace-r*-rank*.jsonl"):
        replica, rank = (int(x) for x in path.stem[len("live-trace-r"):].split("-rank"))
        out[(replica, rank)] = [r for r in map(json.loads, path.read_text().splitlines()) if not r["healed"]]
    return out


def check_invariants(run_dir: Path, steps: int, shards: int, ref: list[float]) -> list[dict]:
    """The invariants every drill holds (module docstring); returns the metrics records."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), [r["step"] for r in records]
    got = [r["loss"] for r in records]
    for g, want in zip(got, ref, strict=True):
        assert abs(g - want) <= 1e-9 * abs(want), ("losses", got, ref)
    tr = traces(run_dir)
    sampler = GlobalBatchSampler(len(Trainer(from_dict(tiny_config(str(run_dir.parent / "ref-data")))).data.train),
                                 GLOBAL_BATCH, 0)
    for step in range(1, steps + 1):
        expected = sorted(sampler.next().tolist())
        for rank in range(shards):
            done = [rec for (_, k), recs in tr.items() if k == rank for rec in recs if rec["step"] == step]
            trained = sorted(i for rec in done for i in rec["indices"])
            assert trained == expected, ("exactly once", step, rank, trained, expected)
            assert len({rec["params"] for rec in done}) == 1, ("bitwise", step, rank, done)
    return records


def summary(records: list[dict]) -> dict:
    events = [e for r in records for e in r.get("events", [])]
    return {"replicas": [r["replicas"] for r in records],
            "events": [(e["event"], e["replica"], e["step"]) for e in events if e["event"] != "join"],
            "seen_as": sorted({e.get("seen_as", "")[:120] for e in events if e["event"] == "departure"} - {""})}


def check_events(d: Drill, records: list[dict]) -> None:
    events = [e for r in records for e in r.get("events", [])]
    gone = {e["replica"] for e in events if e["event"] == "departure"}
    back = {e["replica"] for e in events if e["event"] == "rejoin"}
    assert gone >= set(d.departed) and back >= set(d.rejoined), ("events", summary(records))
    if d.per_step is not None:
        assert [r["replicas"] for r in records] == d.per_step, ("replicas", summary(records))


def run_drill(d: Drill, work: Path, ref: list[float] | None = None) -> dict:
    """``meshfold train --nproc R*S`` with the drill's faults, then every check. Raises
    AssertionError (with what failed) or returns the run's summary."""
    run_dir = work / "run"
    (work / "live.toml").write_text(tomli_w.dumps(drill_config(d, run_dir)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHFOLD_STRICT="1", MESHFOLD_LIVE_TRACE="1", **d.env)
    start = time.monotonic()
    with (work / "out.log").open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "meshfold", "train", str(work / "live.toml"),
                               "--nproc", str(d.replicas * d.shards)], cwd=ROOT, env=env, stdout=log, stderr=log,
                              timeout=900)
    wall = time.monotonic() - start
    assert proc.returncode == 0, ("exit", proc.returncode, (work / "out.log").read_text()[-3000:])
    records = check_invariants(run_dir, d.steps, d.shards, ref or reference_losses(d.steps, work / "ref"))
    check_events(d, records)
    return {"wall_s": round(wall, 1), **summary(records)}


# --------------------------------------------------------------------------- netlab

NETLAB_CUT_S = 30.0


def run_netlab(work: Path, ref: list[float] | None = None) -> dict:
    """Two "hosts" as network namespaces of the netlab (nodes 0 and 1, one replica group of
    one process each, started as a multi-host job does: ``MESHFOLD_LIVE_REPLICA``), the
    Lighthouse and the store in a third (node 2). Once step 2 is logged, node 1's link is cut
    (its bridge port down: packets vanish, nothing is refused) for 30 s, then restored.
    Where the cut lands in a step's exchange, replica 0 drops replica 1 (its beat stops),
    trains that step alone and waits for it at the next boundary (live_rejoin_wait_s): a
    departure, then a rejoin with replica 0's state; where it lands at a step boundary, the
    Lighthouse drops replica 1 from the quorum and replica 0 waits for it there: no step is
    trained without it, so no event. Either way replica 1 trains the last step with replica 0."""
    ok, why = available()
    if not ok:
        raise RuntimeError(f"skipped: {why}")
    steps = 8
    run_dir = work / "run"
    cfg = tiny_config(str(run_dir), parallel={"dp_replicate": 2},
                      train={"steps": steps, "global_batch": GLOBAL_BATCH, "live_recovery": True,
                             "live_rejoin_wait_s": 300.0, "live_heartbeat_timeout_s": 5.0,
                             "collective_timeout_s": 300.0})
    (work / "live.toml").write_text(tomli_w.dumps(cfg))
    start = time.monotonic()
    with NetLab(nodes=3, rate_mbit=1000) as lab:
        server = lab.popen(2, [sys.executable, "-m", "meshfold.train.quorum", "--bind", f"{lab.addr(2)}:0",
                               "--store", f"{lab.addr(2)}:0", "--heartbeat-timeout-s", "5"],
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
        serve = dict(server.stdout.readline().split() for _ in range(2))
        groups = []
        for r in (0, 1):
            env = dict(os.environ, PYTHONPATH=str(ROOT), MESHFOLD_STRICT="1", MESHFOLD_LIVE_TRACE="1",
                       MESHFOLD_LIVE_REPLICA=str(r), MESHFOLD_LIVE_REPLICAS="2",
                       MESHFOLD_LIVE_LIGHTHOUSE=serve["lighthouse"], MESHFOLD_LIVE_STORE=serve["store"],
                       MESHFOLD_LIVE_HOST=lab.addr(r))
            log = (work / f"r{r}.log").open("w")
            groups.append(lab.popen(r, [sys.executable, "-m", "meshfold", "train", str(work / "live.toml"),
                                        "--nproc", "1", "--max-restarts", "2"], env=env, stdout=log, stderr=log,
                                    cwd=ROOT))
        _wait_for(lambda: _logged(run_dir, 2), groups, 600)
        subprocess.run(["ip", "-n", lab.hub, "link", "set", "p1", "down"], check=True)
        cut = time.monotonic()
        time.sleep(NETLAB_CUT_S)
        subprocess.run(["ip", "-n", lab.hub, "link", "set", "p1", "up"], check=True)
        codes = [g.wait(timeout=900) for g in groups]
        assert codes == [0, 0], ("exit", codes, [(work / f"r{r}.log").read_text()[-2000:] for r in (0, 1)])
        server.kill()
    wall = time.monotonic() - start
    records = check_invariants(run_dir, steps, 1, ref or reference_losses(steps, work / "ref"))
    last = [r for r in traces(run_dir)[(1, 0)] if r["step"] == steps]
    assert last and last[0]["members"] == [0, 1], ("replica 1 back for the last step", summary(records))
    gone = [e for r in records for e in r.get("events", []) if e["event"] == "departure"]
    landed = "in an exchange: dropped, rejoined" if gone else "at a boundary: waited for"
    if gone:
        check_events(Drill("netlab", "", 2, departed=(1,), rejoined=(1,)), records)
    return {"wall_s": round(wall, 1), "cut_after_s": round(cut - start, 1), "cut_landed": landed, **summary(records)}


def _logged(run_dir: Path, step: int) -> bool:
    try:
        return any(json.loads(x).get("step") == step for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    except (OSError, ValueError):
        return False


def _wait_for(cond, procs, bound_s: float) -> None:
    end = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < end, f"not reached in {bound_s} s"
        assert all(p.poll() is None for p in procs), ("a group ended early", [p.poll() for p in procs])
        time.sleep(0.2)


def main(argv=None) -> int:
    names = list(DRILLS) + ["netlab_link_cut"]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated drills of {names}")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each drill in a row (default 1)")
    ap.add_argument("--out", default=str(RESULTS / "live_faults.json"))
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for n in names:
            print(f"{n:18s} {DRILLS[n].what if n in DRILLS else run_netlab.__doc__.split(chr(10))[0]}")
        return 0
    chosen = [n for n in args.only.split(",") if n] or names
    if unknown := sorted(set(chosen) - set(names)):
        ap.error(f"unknown drill(s) {unknown}; choose from {names}")
    runs = []
    refs: dict[int, list[float]] = {}
    tmp = tempfile.mkdtemp(prefix="live-faults-")  # kept: each run's logs (out.log) and run directory
    print(f"runs in {tmp}", flush=True)
    if True:
        for name in chosen:
            for i in range(args.repeat):
                work = Path(tmp) / f"{name}-{i}"
                work.mkdir()
                steps = DRILLS[name].steps if name in DRILLS else 8
                if steps not in refs:
                    refs[steps] = reference_losses(steps, Path(tmp) / f"ref-{steps}")
                start = time.monotonic()
                try:
                    res = run_drill(DRILLS[name], work, refs[steps]) if name in DRILLS else run_netlab(work, refs[steps])
                    res["passed"] = True
                except (AssertionError, RuntimeError, subprocess.TimeoutExpired) as err:
                    res = {"passed": False, "skipped": str(err).startswith("skipped"),
                           "error": str(err)[:1500], "wall_s": round(time.monotonic() - start, 1)}
                res.update(drill=name, run=i + 1, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           load=round(os.getloadavg()[0], 1))
                runs.append(res)
                print(json.dumps(res), flush=True)
    print(f"\n{'drill':18s} {'passed':>7s} {'wall s':>8s}  replicas per step / events")
    for r in runs:
        print(f"{r['drill']:18s} {str(r['passed']):>7s} {r['wall_s']:8.1f}  "
              f"{r.get('replicas', '')} {r.get('events', r.get('error', '')[:80])}")
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {"runs": []}
    old["runs"] = [r for r in old["runs"] if r["drill"] not in chosen] + runs
    out.write_text(json.dumps(old, indent=1) + "\n")
    return 0 if all(r["passed"] or r.get("skipped") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
