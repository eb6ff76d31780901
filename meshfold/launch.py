"""Starting processes: ``--nproc N`` runs N local workers through torchrun's elastic
launcher; under ``torchrun`` (or Slurm + torchrun) the usual environment is read instead."""

from __future__ import annotations

import datetime
import logging
import os
import sys
import uuid

import torch
import torch.distributed as dist

from meshfold import comm


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


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


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run ``python -m meshfold ARGV`` in ``nproc`` local processes; returns an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # One thread per worker unless the user says otherwise: N processes share the cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"meshfold-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "meshfold", *argv)
    except ChildFailedError as err:
        ranks = sorted(err.failures)
        first = err.failures[ranks[0]]
        if all(f.exitcode == 2 for f in err.failures.values()):
            return 2  # a configuration error: rank 0 has already said it in one line
        print(f"meshfold: {len(ranks)} of {nproc} processes failed (ranks {ranks}); first exit code "
              f"{first.exitcode}", file=sys.stderr)
        return 1
    return 0
