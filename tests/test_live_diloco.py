"""Live recovery's cross-replica communicator and low-communication training under
``train.live_recovery`` (docs/resilience.md): the abortable group (``train/abortable.py``),
Streaming DiLoCo / DiLoCo workers as failure domains, and tensor parallelism inside a
replica group."""

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.testing import free_port, run_on
from meshfold.train.abortable import AbortableGroup, CommAborted
from meshfold.train.live_watch import destroy


def _abort_on_own_timeout(port: int) -> dict:
    """Rank 1 stops answering after one good all-reduce (it waits in the store, its sockets
    open); rank 0's next all-reduce on a group with a 2 s timeout (the backend's own: 62 s)
    raises ``CommAborted`` and the group is aborted, every later call raising at once. Then
    both ranks build a fresh group and all-reduce again: the process lived on."""
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
    fresh = AbortableGroup(dist.PrefixStore("g2", store), rank, 2, 60.0, "cpu")
    t = torch.full((2,), float(rank + 1), dtype=torch.float64)
    comm.group_all_reduce(t, fresh, None)
    out["fresh"], out["pid"] = t.tolist(), os.getpid()
    return out


def test_abortable_group_aborts_on_its_own_timeout_and_the_process_lives():
    got = run_on(2, _abort_on_own_timeout, free_port())
    assert [g["first"] for g in got] == [[2.0] * 4] * 2
    r0 = got[0]
    assert "did not complete within its 2 s timeout" in r0["error"], r0
    assert r0["aborted"] and "was aborted" in r0["later"], r0
    assert [g["fresh"] for g in got] == [[3.0, 3.0]] * 2  # the same processes, a new group
