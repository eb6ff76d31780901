"""Worker-death messages: one line each, complete, and true for the mode the run is in
(plain launch with or without restarts left, live recovery), naming the worker that died
and the restart ("restart 1 of N") where the launcher restarts."""

import logging

import pytest

from meshfold.config import TrainConfig
from meshfold.launch import RestartReporter
from meshfold.train import fault
from meshfold.train.fault import FaultMonitor, PeerLostError, after_worker_loss, job_restart_note
from meshfold.train.live import replica_restart_note
from meshfold.train.progress import Progress

GLOO = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41236; "
        "Check the logs of the remote worker for the reason it exited (it may have crashed or been killed)")


def _restarts(monkeypatch, done, allowed):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(done))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(allowed))


@pytest.mark.parametrize("live", [False, True])
def test_peer_lost_line_is_complete_and_says_what_happens(monkeypatch, live):
    _restarts(monkeypatch, 0, 3)
    # what build_live does in a replica group's process
    monkeypatch.setattr(fault, "_restart_note", replica_restart_note if live else job_restart_note)
    monitor = FaultMonitor(TrainConfig(live_recovery=live), rank=0, world=1, progress=Progress())
    err = monitor.peer_lost(RuntimeError(GLOO + "\nsecond line"))
    text = str(err)
    assert isinstance(err, PeerLostError) and "\n" not in text
    assert text.startswith("rank 0: lost the connection to a peer (it crashed or was killed) at step 1")
    assert text.endswith(f"(backend said: {GLOO})")  # whole, not cut mid-word
    if live:
        assert "restart from the last checkpoint" not in text and "checkpoint" not in text
        assert "replica group's agent restarts the group (restart 1 of 3)" in text
    else:
        assert "the launcher restarts all workers from the last checkpoint (restart 1 of 3)" in text


def test_a_peer_lost_at_the_step_boundary_is_named(monkeypatch):
    """A peer killed while the others are in a boundary collective (the stop agreement,
    evaluation, a checkpoint) is named like one lost in the step: gloo's "Connection reset by
    peer" became PeerLostError there too (it once surfaced raw from the stop agreement)."""
    _restarts(monkeypatch, 0, 1)
    monkeypatch.setattr(fault, "_restart_note", job_restart_note)
    monitor = FaultMonitor(TrainConfig(), rank=0, world=1, progress=Progress())
    reset = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:26315: "
             "Connection reset by peer. This is typically caused by a remote worker hanging")
    with pytest.raises(PeerLostError, match=r"lost the connection to a peer .*\(restart 1 of 1\)"):
        with monitor.boundary():
            raise RuntimeError(reset)
    with pytest.raises(ValueError):  # anything else passes through unchanged
        with monitor.boundary():
            raise ValueError("not a peer")
    with pytest.raises(RuntimeError, match="^disk full$"):
        with monitor.boundary():
            raise RuntimeError("disk full")


def test_after_worker_loss_without_restarts_left(monkeypatch):
    _restarts(monkeypatch, 1, 1)
    assert after_worker_loss() == ("no restart left (--max-restarts 1); run the same command again to "
                                   "resume from the last checkpoint")
    assert "the other groups train on without it" in replica_restart_note(1, 1)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")  # plain torchrun --max-restarts 0, or no launcher
    assert after_worker_loss().startswith("no restart left (--max-restarts 0)")


def _agent_logs(reporter, exitcode, local_rank, left, allowed):
    """The two records torch's elastic agent logs when a worker fails and it restarts."""
    reporter.handle(logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, "api.py", 1,
                                      "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                                      (exitcode, local_rank, 1234, "python"), None))
    reporter.handle(logging.LogRecord("torch.distributed.elastic.agent.server.api", logging.INFO, "api.py", 2,
                                      "[%s] Worker group %s. %s/%s attempts left; will restart worker group",
                                      ("default", "FAILED", left, allowed), None))


def test_launcher_names_the_dead_worker_and_the_restart(capsys):
    _agent_logs(RestartReporter(2), -9, 1, 3, 3)
    assert capsys.readouterr().err.splitlines() == [
        "meshfold: launcher: rank 1 died (killed by SIGKILL); restarting all 2 workers from the last checkpoint "
        "(restart 1 of 3)"]
    live = RestartReporter(2, group="replica group 1")
    _agent_logs(live, 1, 0, 2, 3)
    assert capsys.readouterr().err.splitlines() == [
        "meshfold: launcher: replica group 1: rank 0 died (exit code 1); restarting the group's 2 workers "
        "(restart 2 of 3); they rejoin the running groups from a peer"]
