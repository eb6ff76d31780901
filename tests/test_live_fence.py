"""Live recovery's commit fence (train/live_fence.py) on a real TCPStore, and the lineage order
of ``quorum.decide``: no step applied by two quorums, a stale quorum waits while a replica that
committed newer steps beats (alive, or restarted and about to ask with its checkpoint), a new
lineage once they are silent for the collective timeout or in the quorum and behind, and every
member of a quorum reads the same verdict. The
end-to-end drill (two replicas, each stopped in turn) is in tests/test_live_faults.py."""

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from meshfold.train.live_fence import CommitFence
from meshfold.train.quorum import decide


@pytest.fixture()
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)


def fence(store, replica, beats, attempt=0, void_after_s=60.0):
    return CommitFence(store, replica, 2, attempt, lambda r: beats[r], void_after_s)


def quorum(members, step, epoch, created_ns, lighthouse="1"):
    return {"members": members, "step": step, "epoch": epoch, "created_ns": created_ns,
            "lighthouse_quorum": f"{lighthouse}.{created_ns}"}


def test_claims_once_per_step_and_co_members_share_it(store):
    beats = {0: (0, 0.1), 1: (0, 0.1)}
    a, b = fence(store, 0, beats), fence(store, 1, beats)
    assert a.claim(7, 1, "q1") and b.claim(7, 1, "q1")  # both members of group q1: the second finds it there
    assert not b.claim(7, 1, "q2")  # another group can never apply step 1 of lineage 7 again
    assert a.claim(7, 2, "q2") and a.head(7) == (2, "q2")  # the next step by whoever is there
    assert not a.claim(7, 2, "q3") and not a.claim(7, 1, "q3")
    assert a.claim(8, 1, "q4")  # another lineage has its own head
    assert store.get("live/held/7/0") == b"0 2" and store.get("live/held/7/1") == b"0 1"


def test_a_stale_quorum_waits_while_the_holder_beats_then_a_new_lineage(store, capsys):
    beats = {0: (0, 0.5), 1: (0, 0.5)}
    ahead = fence(store, 1, beats)
    assert ahead.claim(5, 1, "g") and ahead.claim(5, 2, "g") and ahead.claim(5, 3, "g")
    stale = fence(store, 0, beats)
    assert stale.settle(quorum([0], 1, 5, 900)) is None  # replica 1 holds steps 2-3 and beats: wait
    assert "step 2 through step 3 were committed by replica(s) [1]" in capsys.readouterr().out
    beats[1] = (0, 61.0)  # silent for longer than the collective timeout: gone, a new lineage
    d = quorum([0], 1, 5, 950)
    assert stale.settle(d) == 950 == d["epoch"]  # a new lineage from replica 0's state at step 1
    assert stale.claim(950, 2, "h")  # its step 2 is its own
    beats[1] = (1, 0.1)  # restarted: it beats again and will ask with its checkpoint, wait for it
    assert stale.settle(quorum([0], 1, 5, 990)) is None
    assert stale.settle(quorum([0, 1], 1, 5, 991)) == 991  # it came back behind: the steps beyond are lost
    assert stale.settle(quorum([0], 3, 5, 995)) == 5  # nothing committed beyond step 3: the same lineage
    assert stale.settle(quorum([0, 1], 0, -1, 999)) == 999  # every member from a checkpoint: a new lineage


def test_every_member_reads_the_same_verdict(store):
    """The first member's verdict stands for the quorum (compare-and-set): a member whose view
    of the holder differs still waits with the others."""
    holder = fence(store, 1, {0: (0, 0.1), 1: (0, 0.1)})
    assert holder.claim(3, 4, "g")
    first = fence(store, 0, {0: (0, 0.1), 1: (0, 0.1)})
    assert first.settle(quorum([0], 2, 3, 100)) is None
    other_view = CommitFence(store, 0, 2, 0, lambda r: (0, 99.0), 60.0)  # sees replica 1 as silent
    assert other_view.settle(quorum([0], 2, 3, 100)) is None  # the same Lighthouse quorum: the same verdict


def _participant(r, step, epoch=None):
    meta = {"step": step, "sampler": f"s{r}"} | ({} if epoch is None else {"epoch": epoch})
    return SimpleNamespace(replica_id=str(r), step=step, data=meta)


def test_decide_puts_a_newer_lineage_ahead_whatever_its_step():
    d = decide([_participant(0, 2, epoch=950), _participant(1, 3, epoch=5)], 2, None)
    assert (d["epoch"], d["step"], d["source"], d["heal"]) == (950, 2, 0, [1])
    assert d["meta"] == {"sampler": "s0"}
    d = decide([_participant(0, 2), _participant(1, 3)], 2, None)  # before any lineage: by step
    assert (d["epoch"], d["step"], d["source"], d["heal"]) == (-1, 3, 1, [0])
    d = decide([_participant(0, 3, epoch=5), _participant(1, 3, epoch=5)], 2, None)
    assert (d["source"], d["heal"]) == (0, [])
    d = decide([_participant(0, 3), _participant(1, 3, epoch=5)], 2, None)  # restarted at the newest step
    assert (d["epoch"], d["source"], d["heal"]) == (5, 1, [])
    d = decide([_participant(0, 3, epoch=4), _participant(1, 3, epoch=5)], 2, None)  # an older lineage
    assert (d["source"], d["heal"]) == (1, [0])


def test_diloco_exchanges_are_fenced_by_their_ordinal(store):
    """DiLoCo workers claim outer exchanges: ordinal step x fragments + fragment (live.py's
    ``next_commit``). A quorum about to make an exchange the head already holds waits."""
    beats = {0: (0, 0.1), 1: (0, 0.1)}

    def ordinal(d):
        return d["step"] * 2 + d["meta"]["fragment"]

    ahead = CommitFence(store, 1, 2, 0, lambda r: beats[r], 60.0, ordinal, lambda o: f"exchange {o}")
    assert ahead.claim(3, 4 * 2 + 1, "g")  # fragment 1's exchange at step 4
    stale = CommitFence(store, 0, 2, 0, lambda r: beats[r], 60.0, ordinal, lambda o: f"exchange {o}")
    assert stale.settle(quorum([0], 4, 3, 10) | {"meta": {"fragment": 1}}) is None  # made already: wait
    assert stale.settle(quorum([0], 5, 3, 11) | {"meta": {"fragment": 0}}) == 3  # the next one is free
    assert stale.claim(3, 5 * 2 + 0, "h") and not stale.claim(3, 4 * 2 + 1, "h")
