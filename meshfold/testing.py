"""Run a function on N real gloo processes, reusing the processes across tests.

Starting N Python processes that import torch costs seconds; a test suite with dozens of
multi-process tests would spend minutes on it. ``world(n).run(fn, *args)`` keeps one pool
of n workers per size (one process group each) and runs ``fn(*args)`` on every rank,
returning the per-rank results. ``fn`` must be importable (module level). The workers are
forked from a forkserver that imported this module (torch, the trainer) once, so a pool
starts in a fraction of a second instead of each worker importing torch again (about
4 CPU-seconds each: 25 s for 8 workers on 2 cores).

A failure on any rank raises ``WorkerError`` with that rank's traceback; the pool is then
discarded (its peers may be stuck in a collective) and the next call starts a fresh one.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

from meshfold import comm
from meshfold.comm import reset_ledger
from meshfold.config import from_dict
from meshfold.train.trainer import Trainer


class WorkerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks: mp.Queue, results: mp.Queue, timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # What is loaded now (torch, meshfold) lives as long as the worker: out of the collector's
    # sight, the collection after each task only walks that task's objects.
    gc.freeze()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if comm.strict():  # MESHFOLD_STRICT=1 (tests/conftest.py), inherited from the parent's environment
        comm.install_strict_p2p_guard()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            reset_ledger()
            torch.manual_seed(0)
            out = fn(*args, **kwargs)
            _destroy_task_groups()
            results.put((rank, True, out, _transport_threads()))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc(), 0))
    comm.barrier()
    dist.destroy_process_group()


def _destroy_task_groups() -> None:
    """Destroy the groups a task made (meshes, sub-groups), keeping the default one. Each gloo
    group owns a transport thread that wakes every 10 ms while the group lives: kept, they
    reached ~450 threads per worker and most of two cores in system time between tests."""
    if not dist.is_initialized():
        return
    comm.barrier()  # every rank is done with them (a peer may still be reading our last send)
    _clear_dtensor_caches()
    gc.collect()  # the task's modules and meshes, which hold the groups
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _transport_threads() -> int:
    """gloo transport threads alive in this process (some outlive their destroyed groups)."""
    count = 0
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().startswith("gloo_tcp")
        except OSError:  # the thread ended meanwhile
            pass
    return count


def _clear_dtensor_caches() -> None:
    """DTensor's caches (sharding propagation, redistribution planners, mesh topology) keep the
    meshes they first saw, and with them their groups; meshes compare by layout, so a later
    task's equal mesh would even be handed an earlier task's, whose groups are gone."""
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own cache
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_redistribute_planner_cache()
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed.tensor") or module is None:
            continue
        for value in list(vars(module).values()):
            holders = [value] + (list(vars(value).values()) if isinstance(value, type) else [])
            for fn in holders:
                fn = getattr(fn, "__func__", fn)  # staticmethod
                if not isinstance(fn, type) and callable(getattr(fn, "cache_clear", None)):
                    fn.cache_clear()


class WorldPool:
    # 300 s per call: a fresh CI machine can be twice as slow as a developer's, and a busy one
    # slower still; a real hang still fails, only later.
    def __init__(self, world: int, timeout_s: float = 300.0):
        # The forkserver has run nothing but imports (no process group, no threads); the first
        # user's preload list wins (meshfold/dryrun.py's preloads itself, which imports the trainer).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        self.world = world
        self.timeout_s = timeout_s
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results, timeout_s),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False
        self.transport_threads = 0  # the most any worker holds after its last task

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out: list[Any] = [None] * self.world
        errors = []
        for _ in range(self.world):
            try:
                rank, ok, value, threads = self.results.get(timeout=timeout or self.timeout_s)
                self.transport_threads = max(self.transport_threads, threads)
            except queue.Empty:
                self.close(force=True)
                raise WorkerError(f"{fn.__name__} on {self.world} ranks did not finish within "
                                  f"{timeout or self.timeout_s:.0f} s") from None
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
                # Peers may now wait forever in a collective: stop collecting.
                break
        if errors:
            self.close(force=True)
            rank, tb = errors[0]
            raise WorkerError(f"rank {rank} of {self.world} failed in {fn.__name__}:\n{tb}")
        return out

    def close(self, force: bool = False) -> None:
        self.broken = True
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[int, WorldPool] = {}
# Workers are replaced once they hold this many gloo transport threads: each wakes every
# 10 ms (about 0.1 % of a core, idle), and some outlive their destroyed groups (about 4 per
# trainer built), so a pool kept for the whole suite would slow every later test.
RECYCLE_AT_TRANSPORT_THREADS = 32


def world(n: int) -> WorldPool:
    pool = _POOLS.get(n)
    alive = pool is not None and not pool.broken and all(p.is_alive() for p in pool.procs)
    if pool is None or not alive or pool.transport_threads >= RECYCLE_AT_TRANSPORT_THREADS:
        if pool is not None:
            pool.close(force=not alive)
        pool = _POOLS[n] = WorldPool(n)
    return pool


def run_on(n: int, fn: Callable, *args, **kwargs) -> list[Any]:
    return world(n).run(fn, *args, **kwargs)


@atexit.register
def _shutdown() -> None:
    for pool in _POOLS.values():
        if not pool.broken:
            pool.close()


# --------------------------------------------------------------------------- equivalence


def save_random_hf_model(folder, config, dtype: torch.dtype = torch.float64, seed: int = 0):
    """A ``transformers`` causal LM built from ``config`` (a transformers config), in
    ``dtype``, saved to ``folder`` and returned. transformers starts norms at 1 and biases
    at 0, where a swapped or dropped weight would not show: norms are drawn from
    U(0.5, 1.5), biases (and buffers such as DeepSeek's routing-correction bias) from
    N(0, 0.25)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point():
                continue
            if "norm" in name:
                t.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                t.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model


def tiny_config(run_dir: str, **sections) -> dict:
    """A float64 config small enough for many multi-process tests on 2 CPU cores.
    ``sections`` update the defaults, e.g. ``parallel={"tp": 2}``."""
    base = {
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 320, "seq_len": 16},
        "parallel": {"dp_shard": -1},
        "train": {"steps": 5, "global_batch": 8, "lr": 1e-2, "dtype": "float64", "run_dir": run_dir,
                  "progress": False, "tensorboard": False, "warmup_steps": 1},
        "data": {"max_docs": 40, "val_docs": 0},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return base


def train_collect(cfg_dict: dict) -> dict | None:
    """Train on this process (group) and return, on global rank 0, the losses and the
    unsharded parameters and last-step gradients."""
    import torch.distributed as dist

    trainer = Trainer(from_dict(cfg_dict))
    trainer.capture_grads = True
    losses = trainer.fit()
    params, grads = trainer.full_state(), trainer.last_grads
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {"losses": losses, "params": params, "grads": grads}


def train_segment(cfg_dict: dict, stop: int, save: bool = True) -> dict | None:
    """Resume (train.resume = auto) from the run directory, train up to step ``stop``,
    checkpoint there (unless ``save`` is False). Global rank 0 returns the step it resumed
    at, the losses of the steps it ran and the final unsharded parameters."""
    import torch.distributed as dist

    tr = Trainer(from_dict(cfg_dict))
    start = tr.checkpointer.resume() or 0
    losses = []
    while tr.step < stop:
        with tr.fault.step():
            losses.append(tr.train_step())
    if save:
        tr.checkpointer.save()
    tr.checkpointer.close()
    tr.fault.close()
    params = tr.full_state()
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {"start": start, "losses": losses, "params": params}


def train_chain(chain: list, cfg_for: Callable) -> tuple[list[int], list[float], dict]:
    """Train through ``chain`` = [(world, [parallel], stop step)], each segment resuming the
    previous one's checkpoint from ``cfg_for(world, parallel)``'s run directory and saving for the
    next (the last does not). Returns the step each segment resumed at, every step's loss
    and the last segment's unsharded parameters."""
    starts, losses, got = [], [], None
    last = chain[-1][2]
    for world, parallel, stop in chain:
        cfg, save = cfg_for(world, parallel), stop < last
        got = run_on(world, train_segment, cfg, stop, save=save)[0] if world > 1 else train_segment(cfg, stop, save)
        starts.append(got["start"])
        losses += got["losses"]
    return starts, losses, got["params"]


def one_step_report(cfg_dict: dict) -> dict:
    """This rank's parameter bytes (float64 local pieces) and the collectives of one real
    training step, as the communication layer recorded them (what ``meshfold dry-run``
    predicts for the same layout)."""
    trainer = Trainer(from_dict(cfg_dict))
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 8 for p in trainer.model.parameters())
    trainer.ledger.pop_step()
    trainer.train_step()
    return {"param_bytes": local, "collectives": trainer.ledger.pop_step_collectives()}


def assert_runs_match(ref: dict, got: dict, rtol: float = 1e-9, atol: float = 1e-11) -> None:
    """Losses step by step, then every parameter and gradient, within the tolerances."""
    import torch

    ref_losses, got_losses = torch.tensor(ref["losses"]), torch.tensor(got["losses"])
    torch.testing.assert_close(got_losses, ref_losses, rtol=rtol, atol=atol, msg=lambda m: f"losses: {m}")
    for kind in ("grads", "params"):
        assert set(got[kind]) == set(ref[kind]), f"{kind}: names differ: {set(got[kind]) ^ set(ref[kind])}"
        for name, value in ref[kind].items():
            torch.testing.assert_close(got[kind][name], value, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name, k=kind: f"{k} of {n}: {m}")
