"""Live recovery's fault drills at the quorum and in the heal (issue #41, drills c and d), the
short version: one run of 2 replica groups x 1 process (gloo, float64, strict mode, the real
CLI) with two faults injected at the named points of ``train/live_drill.py``. The long drills
(a 60 s SIGSTOP at 3 x 2 and 2 x 2, two replicas killed at once, the heal source killed mid-heal,
a link cut between network namespaces) are ``benchmarks/live_faults.py``, which this shares its run and
its checks with. Only invariants are asserted, never a duration: steps logged once, each
step's global batch trained exactly once, losses equal to the one-process float64 run within
1e-9, replicas bitwise equal at every step they committed, the departures and rejoins there."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.live_faults import Drill, run_drill  # noqa: E402

from meshfold.train.live_drill import Faults  # noqa: E402


def test_kill_after_the_quorum_and_of_the_joiner_mid_heal(tmp_path):
    """2 replica groups x 1 process. Replica 1 is killed right after the first quorum named
    it, before that quorum's group formed: replica 0 abandons the rendezvous once replica 1's
    beat stops or its restart shows in it (unwatched, it waited the whole collective timeout,
    then died) and trains step 1 again, alone or with the restart if that was back first. Replica 1's restart is killed in the middle of its heal (after the first tensor):
    replica 0 trains on; the second restart rejoins with replica 0's state. Steps once each,
    every step's batch exactly once, losses equal the one-process run, replicas bitwise equal."""
    drill = Drill("quorum_and_joiner", "", 2, steps=4, env={"MESHFOLD_LIVE_KILL": "1:0:1:quorum,1:0:*:heal:1"},
                  train={"live_rejoin_wait_s": 300.0}, departed=(1,), rejoined=(1,))
    res = run_drill(drill, tmp_path)
    assert ("departure", 1, 1) in res["events"], res  # step 1 by replica 0 alone, or with a fast restart
    seen = " ".join(res["seen_as"])  # the watched rendezvous (a dead member, or one restarted since), not a timeout
    assert "stopped heartbeating" in seen or "restarted since the quorum" in seen, res
    print(f"quorum + joiner mid-heal drill: {res}")


def test_a_stale_replica_never_trains_a_committed_step_again(tmp_path):
    """2 replica groups x 1 process (the commit fence, train/live_fence.py). Replica 0 is
    stopped in step 2 until replica 1 has logged step 3 alone; replica 1 is then stopped in
    step 4 for 8 s. Replica 0, back and alone with the Lighthouse (replica 1 is silent), gets a
    quorum of itself at step 1: before the fence it trained steps 2 and 3 again (metrics.jsonl
    read 1, 2, 3, 2, 3, 4, 5, 6, 4); now it waits while replica 1 may be alive and is healed
    from it. Every step once, every batch once, losses equal the one-process run. Whether
    the two stops overlap depends on the machine's speed; the invariants hold either way."""
    from benchmarks.live_faults import DRILLS

    res = run_drill(DRILLS["stale_quorum_2x1"], tmp_path)
    print(f"stale quorum drill: {res}")


def test_drill_points_are_named(monkeypatch, tmp_path):
    """A kill spec names a point of live_drill.POINTS and an attempt; anything else is one line."""
    monkeypatch.setenv("MESHFOLD_LIVE_KILL", "1:0:*:heal:1,1:0:3")
    assert Faults(1, 0, 1, str(tmp_path)).kill_at == {"heal": "*"}
    assert Faults(1, 0, 0, str(tmp_path)).kill_at == {"exchange": "3"}
    monkeypatch.setenv("MESHFOLD_LIVE_KILL", "1:0:3:nowhere")
    with pytest.raises(ValueError, match="POINT one of"):
        Faults(1, 0, 0, str(tmp_path))
