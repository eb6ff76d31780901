"""Live recovery's fault drills at the quorum and in the heal (issue #41, drills c and d), the
short versions: one run of 3 replica groups x 1 process (gloo, float64, strict mode, the real
CLI) with two faults injected at the named points of ``train/live_drill.py``. The long drills
(a 60 s SIGSTOP at 3 x 2, two replicas killed at once, the joiner killed mid-heal, a link cut
between network namespaces) are ``benchmarks/live_faults.py``, which this shares its run and
its checks with. Only invariants are asserted, never a duration: steps logged once, each
step's global batch trained exactly once, losses equal to the one-process float64 run within
1e-9, replicas bitwise equal at every step they committed, the departures and rejoins there."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.live_faults import Drill, run_drill  # noqa: E402

from meshfold.train.live_drill import Faults  # noqa: E402


def test_kill_after_the_quorum_and_of_the_heal_source_mid_heal(tmp_path):
    """Replica 2 is killed right after the first quorum named it, before that quorum's group
    formed: replicas 0 and 1 abandon the rendezvous when its beat stops (it would otherwise
    wait the collective timeout) and train step 1 without it. When replica 2's restart
    rejoins, the heal source (replica 0) is killed after the first tensor: replica 1 (up to
    date) trains on, the joiner (its state now partial) restarts again, and both come back
    with replica 1's state."""
    drill = Drill("quorum_and_heal_source", "", 3, steps=5, env={"MESHFOLD_LIVE_KILL": "2:0:1:quorum,0:0:*:heal"},
                  train={"live_rejoin_wait_s": 300.0}, departed=(0, 2), rejoined=(0, 2))
    res = run_drill(drill, tmp_path)
    assert ("departure", 2, 1) in res["events"], res
    print(f"quorum + heal-source drill: {res}")


def test_drill_points_are_named(monkeypatch, tmp_path):
    """A kill spec names a point of live_drill.POINTS and an attempt; anything else is one line."""
    monkeypatch.setenv("MESHFOLD_LIVE_KILL", "1:0:*:heal:1,1:0:3")
    assert Faults(1, 0, 1, str(tmp_path)).kill_at == {"heal": "*"}
    assert Faults(1, 0, 0, str(tmp_path)).kill_at == {"exchange": "3"}
    monkeypatch.setenv("MESHFOLD_LIVE_KILL", "1:0:3:nowhere")
    with pytest.raises(ValueError, match="POINT one of"):
        Faults(1, 0, 0, str(tmp_path))
