"""Live recovery's launch policy (``train.live_recovery``; docs/resilience.md), registered
in ``cli.py``'s ``LAUNCH_POLICIES``: a replica group's process runs its inner layout
(``train/live.py::replica_config``), ``--nproc N`` starts one elastic agent per replica
group with the Lighthouse (``train/quorum.py``) and the store between them (``launch_live``), and a plain
``torchrun`` of such a run is refused."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import torch.distributed as dist

from meshfold.config import validate
from meshfold.launch import EXIT_STOPPED, launch_local
from meshfold.train import live
from meshfold.train.quorum import spawn_lighthouse
from meshfold.train.run_dir import RunLock, prepare_run_dir

LIVE_RESTARTS = 3  # restarts per replica group when --max-restarts is not given


class LiveLaunch:
    """The policy ``cli.run_train`` asks (see ``cli.PlainLaunch`` for the protocol)."""

    @staticmethod
    def applies(cfg) -> bool:
        return cfg.train.live_recovery

    @staticmethod
    def worker_config(cfg):
        """One replica group's process (launched with ``MESHFOLD_LIVE_REPLICA``): its inner layout."""
        replica = live.replica_env()
        if replica is None:
            return cfg
        return live.replica_config(cfg, replica[0])

    @staticmethod
    def launch(nproc: int, argv: list[str], cfg, max_restarts: int) -> int | None:
        """``--nproc N``: one agent per replica group; with ``MESHFOLD_LIVE_REPLICA`` set (a group
        started on its own host), this group's agent (None: one process, no restarts: in-process)."""
        env = live.replica_env()
        if env is not None:  # one replica group started on its own (a host of a multi-host job): its agent
            return launch_local(nproc, argv, max_restarts, group=f"replica group {env[0]}") if nproc > 1 or max_restarts else None
        replicas = live.replica_count(cfg)
        validate(live.replica_config(cfg, 0), nproc // replicas)  # what each group runs
        return launch_live(nproc, argv, replicas, cfg.train, max_restarts or LIVE_RESTARTS)

    @staticmethod
    def refusal(cfg, world: int) -> str | None:
        if live.replica_env() is None and world > 1:
            return ("train.live_recovery needs its launcher: meshfold train --nproc N (one torchrun agent per "
                    "replica group with MESHFOLD_LIVE_* set; docs/resilience.md), not a plain torchrun")
        return None


POLICY = LiveLaunch


def launch_live(nproc: int, argv: list[str], replicas: int, train, max_restarts: int) -> int:
    """One elastic agent per replica group (each a world of its own, restarted alone: a
    failed worker restarts its group, not the job), the Lighthouse (a child process) and the
    store the cross-replica groups meet through. The launcher holds the run directory's lock
    for the whole job: the replica groups share that directory."""
    lock = RunLock(prepare_run_dir(Path(train.run_dir)))
    lock.acquire()
    host = os.environ.get(live.ENV_HOST, "127.0.0.1")
    lighthouse, address = spawn_lighthouse(f"{host}:0", train.live_heartbeat_timeout_s, train.live_join_timeout_s)
    try:
        return _launch_live(nproc, argv, replicas, host, address["lighthouse"], max_restarts)
    finally:
        lighthouse.kill()
        lighthouse.wait()
        lock.release()


def _launch_live(nproc: int, argv: list[str], replicas: int, host: str, lighthouse: str, max_restarts: int) -> int:
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    per = nproc // replicas
    env = {live.ENV_REPLICAS: str(replicas), live.ENV_LIGHTHOUSE: lighthouse, live.ENV_STORE: f"{host}:{store.port}"}
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Forked, not spawned: the agents need nothing but this process's imports.
    ctx = multiprocessing.get_context("fork")
    agents = [ctx.Process(target=_replica_agent, args=(dict(env, **{live.ENV_REPLICA: str(r)}), per, argv, max_restarts),
                          name=f"meshfold-replica-{r}") for r in range(replicas)]
    for a in agents:
        a.start()
    for a in agents:
        a.join()
    codes = [a.exitcode for a in agents]
    if all(c == EXIT_STOPPED for c in codes):
        return EXIT_STOPPED  # stopped with a checkpoint (a signal, the lighthouse lost): a worker said so
    failed = [r for r, c in enumerate(codes) if c != 0]
    if failed:
        print(f"meshfold: replica group(s) {failed} of {replicas} failed for good (exit codes "
              f"{[codes[r] for r in failed]}) after --max-restarts {max_restarts}", file=sys.stderr)
        return 2 if all(c == 2 for c in codes) else 1
    return 0


def _replica_agent(env: dict, nproc: int, argv: list[str], max_restarts: int) -> None:
    """One replica group's elastic agent (a forked child of ``launch_live``): it restarts its
    own workers, up to ``max_restarts`` times, and never the other groups'."""
    os.environ.update(env)
    sys.exit(launch_local(nproc, argv, max_restarts, group=f"replica group {env[live.ENV_REPLICA]}"))
