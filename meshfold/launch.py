"""Starting processes: ``--nproc N`` runs N local workers through torchrun's elastic
launcher; under ``torchrun`` (or Slurm + torchrun) the usual environment is read instead.

Signals (docs/checkpoints.md, "What is safe"): the launcher passes SIGTERM, SIGINT and
SIGUSR1 on to its workers once (torchrun's agent does it; SIGUSR1 is added to the signals it
handles), gives them ``STOP_GRACE_S`` to finish the step and write a checkpoint, and exits
``EXIT_STOPPED``. A worker dies with its launcher (``die_with_parent``), so a launcher killed
with SIGKILL never leaves workers training on in the run directory."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import uuid

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.train.checkpoint_files import CheckpointError
from meshfold.train.run_dir import RunDirError, describe_os_error
from meshfold.train.stop import EXIT_STOPPED, Stopped, StopRequest

__all__ = ["EXIT_STOPPED", "CheckpointError", "RunDirError", "Stopped", "StopRequest", "describe_os_error",
           "die_with_parent", "env_world_size", "init_distributed", "launch_local", "shutdown_distributed",
           "under_torchrun"]

# torch's deprecation notices for the collectives meshfold's comm layer calls (the names
# both gloo and NCCL take): rank 0 shows each once, the other ranks none (one line per run).
STOP_GRACE_S = 300  # seconds the workers get to finish the step and checkpoint after a signal
PR_SET_PDEATHSIG = 1


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def die_with_parent() -> None:
    """Under a launcher (torchrun, ``--nproc``): have the kernel SIGKILL this worker when its
    launcher dies, however it dies (Linux ``PR_SET_PDEATHSIG``); if the launcher is already
    gone, exit now."""
    if not under_torchrun() or not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:  # re-parented before the call took effect
        os._exit(1)


def init_distributed(timeout_s: float = 600.0) -> None:
    if dist.is_initialized() or env_world_size() == 1:
        return
    if comm.strict():  # MESHFOLD_STRICT=1: tagged p2p refused, as NCCL would mis-match it
        comm.install_strict_p2p_guard()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if backend == "nccl":  # bound to this rank's GPU: NCCL's communicator starts eagerly, not at the first collective
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    # After an elastic restart the agent's store still holds the dead workers' gloo
    # addresses under the same keys; a per-attempt prefix keeps the new ones apart.
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"meshfold/attempt-{restart}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)


def shutdown_distributed(clean: bool = True) -> None:
    """After a clean run, barrier first: a rank tearing down gloo while a peer still talks
    to it aborts. After a failure peers may never arrive, so just tear down."""
    if dist.is_initialized():
        try:
            if clean:
                comm.barrier()
        finally:
            dist.destroy_process_group()


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0, group: str = "") -> int:
    """Run ``python -m meshfold ARGV`` in ``nproc`` local processes; returns an exit code.
    ``group``: what these processes are, for the restart line (live recovery: "replica group 1")."""
    return _launch_local(nproc, argv, max_restarts, group)


def _died(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class RestartReporter(logging.Handler):
    """torch's elastic agent logs the worker that failed first and the restarts left, at
    levels meshfold hides with the rest of its chatter: say them as one line per restart."""

    def __init__(self, nproc: int, group: str = ""):
        super().__init__(logging.INFO)
        self.nproc, self.group = nproc, group
        self.first: tuple[int, int] | None = None  # (local rank, exit code) of the first failure

    def emit(self, record: logging.LogRecord) -> None:
        message, args = str(record.msg), record.args or ()
        if message.startswith("failed (exitcode:") and len(args) >= 2:
            self.first = (args[1], args[0])
        elif "will restart worker group" in message and len(args) >= 4:
            left, allowed = int(args[2]), int(args[3])
            print(self.line(allowed - left + 1, allowed), file=sys.stderr, flush=True)
            self.first = None

    def line(self, restart: int, allowed: int) -> str:
        where = f"{self.group}: " if self.group else ""
        who = f"rank {self.first[0]} died ({_died(self.first[1])})" if self.first else "a worker failed"
        if self.group:  # live recovery: the group restarts alone and heals from a running one
            return (f"meshfold: launcher: {where}{who}; restarting the group's {self.nproc} workers (restart "
                    f"{restart} of {allowed}); they rejoin the running groups from a peer")
        return (f"meshfold: launcher: {who}; restarting all {self.nproc} workers from the last checkpoint "
                f"(restart {restart} of {allowed})")


def _launch_local(nproc: int, argv: list[str], max_restarts: int = 0, group: str = "") -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):  # torch sets the children's levels itself
        logging.getLogger(name).setLevel(logging.CRITICAL)
    reporter = RestartReporter(nproc, group)
    for name, level in (("torch.distributed.elastic.agent.server.api", logging.INFO),  # "will restart"
                        ("torch.distributed.elastic.multiprocessing.api", logging.ERROR)):  # the first failure
        log = logging.getLogger(name)
        log.setLevel(level)
        log.handlers, log.propagate = [reporter], False
    # One thread per worker unless the user says otherwise: N processes share the cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"meshfold-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        monitor_interval=0.5, shutdown_timeout=STOP_GRACE_S,
        signals_to_handle="SIGTERM,SIGINT,SIGUSR1,SIGHUP,SIGQUIT",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "meshfold", *argv)
    except SignalException as err:
        # The agent passed the signal on and waited for the workers (rank 0 said whether
        # the checkpoint was written); a second signal lands here at once.
        if not group:  # a live replica group's launcher says it once for all groups (live_launch.py)
            print(f"meshfold: launcher: stopped by {signal.Signals(err.sigval).name}", file=sys.stderr)
        return EXIT_STOPPED
    except ChildFailedError as err:
        ranks = sorted(err.failures)
        if all(f.exitcode == 2 for f in err.failures.values()):
            return 2  # a configuration error: rank 0 has already said it in one line
        if all(f.exitcode == EXIT_STOPPED for f in err.failures.values()):
            return EXIT_STOPPED  # stopped on a signal with a checkpoint: rank 0 said so
        first_rank = min(ranks, key=lambda r: err.failures[r].timestamp)
        where = f"{group}: " if group else ""
        print(f"meshfold: {where}{len(ranks)} of {nproc} processes failed (ranks {ranks}); rank {first_rank} "
              f"failed first ({_died(err.failures[first_rank].exitcode)}); no restart left (--max-restarts "
              f"{max_restarts})", file=sys.stderr)
        return 1
    return 0
