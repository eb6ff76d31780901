"""Live recovery's launch policy (``train.live_recovery``; docs/resilience.md), registered
in ``cli.py``'s ``LAUNCH_POLICIES``: a replica group's process runs its inner layout
(``train/live.py::replica_config``), ``--nproc N`` starts one elastic agent per replica
group with the quorum server and the store between them (``launch_live``), and a plain
``torchrun`` of such a run is refused."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import torch.distributed as dist

from meshfold.config import validate
from meshfold.launch import launch_local
from meshfold.train import live
from meshfold.train.quorum import QuorumClient, QuorumServer
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
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return live.replica_config(cfg, replica[0], attempt)

    @staticmethod
    def launch(nproc: int, argv: list[str], cfg, max_restarts: int) -> int | None:
        """``--nproc N``: one agent per replica group (None: a replica group's own agent,
        which starts its workers as a plain launch does)."""
        if live.replica_env() is not None:
            return None
        replicas = live.replica_count(cfg)
        validate(live.replica_config(cfg, 0, 0), nproc // replicas)  # what each group runs
        return launch_live(nproc, argv, replicas, cfg.train.live_rejoin_wait_s, max_restarts or LIVE_RESTARTS,
                           Path(cfg.train.run_dir))

    @staticmethod
    def refusal(cfg, world: int) -> str | None:
        if live.replica_env() is None and world > 1:
            return ("train.live_recovery needs its launcher: meshfold train --nproc N (one torchrun agent per "
                    "replica group with MESHFOLD_LIVE_* set; docs/resilience.md), not a plain torchrun")
        return None


POLICY = LiveLaunch


def launch_live(nproc: int, argv: list[str], replicas: int, rejoin_wait_s: float, max_restarts: int,
                run_dir: Path) -> int:
    """One elastic agent per replica group (each a world of its own, restarted alone: a
    failed worker restarts its group, not the job), the quorum server and the store the
    cross-replica groups meet through, here in the launcher. The launcher holds the run
    directory's lock for the whole job: the replica groups share that directory."""
    lock = RunLock(prepare_run_dir(run_dir))
    lock.acquire()
    try:
        return _launch_live(nproc, argv, replicas, rejoin_wait_s, max_restarts)
    finally:
        lock.release()


def _launch_live(nproc: int, argv: list[str], replicas: int, rejoin_wait_s: float, max_restarts: int) -> int:
    server = QuorumServer(replicas, rejoin_wait_s)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    per = nproc // replicas
    env = {live.ENV_REPLICAS: str(replicas), live.ENV_QUORUM: server.address, live.ENV_STORE: f"127.0.0.1:{store.port}"}
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
    server.close()
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
    # This agent tells the quorum server it is alive, so the group is waited for while it restarts.
    agent = QuorumClient(os.environ[live.ENV_QUORUM], int(env[live.ENV_REPLICA]), agent=True)
    try:
        code = launch_local(nproc, argv, max_restarts, group=f"replica group {env[live.ENV_REPLICA]}")
    finally:
        agent.close()
    sys.exit(code)
