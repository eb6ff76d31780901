"""The training loop: data -> (parallelised) model -> loss -> optimizer, with metrics.

One ``Trainer`` per process. It works without ``torch.distributed`` (one process, the
reference every parallel layout is tested against) and inside any process group whose
size matches ``[parallel]``.

Loss normalisation is exact for any layout: every rank divides its token-loss *sum* by the
number of valid tokens in the *global* batch and multiplies by the number of ranks that
average gradients, so the averaged gradient equals the one-process gradient of the mean
loss over the global batch.

What the trainer runs in (``Surroundings``) is built by the trainer unless its caller hands
it over: ``meshfold dry-run`` builds the same ``Trainer`` on a fake process group and fake
tensors, with its mesh, a data set without a corpus and an observer feature of its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.comm import ledger
from meshfold.config import Config, dump_toml, validate
from meshfold.data.dataset import IGNORE_INDEX, GlobalBatchSampler, build_data, make_sampler, rank_slice
from meshfold.data.loader import Prefetcher, peek
from meshfold.data.prepared import check_verified
from meshfold.device import resolve_device, resolve_dtypes
from meshfold.mesh import ParallelDims, build_mesh
from meshfold.models.llama import Transformer
from meshfold.models.counts import flops_per_token
from meshfold.parallel.parallelize import parallelize
from meshfold.parallel.cp.batch import shard_for_context_parallel
from meshfold.parallel.dp.plan import uses_ddp, uses_grad_reducer
from meshfold.parallel.loss import cross_entropy_sum, vocab_parallel_loss
from meshfold.parallel.materialize import build_on_meta
from meshfold.optim.lr_schedule import build_scheduler
from meshfold.optim.registry import build_optimizer
from meshfold.parallel.pp.executor import Pipeline
from meshfold.data.tokenizer import tokenizer_sha256
from meshfold.errors import ConfigError
from meshfold.train.checkpoint import Checkpointer
from meshfold.train.checkpoint_files import published
from meshfold.train.run_dir import (RunDirError, RunLock, beside, check_resume, explain_write_failure, holds_a_run,
                                    prepare_run_dir, read_record, run_record, write_record)
from meshfold.train.stop import StopAtBoundary, Stopped, StopRequest
from meshfold.train.engine import LocalEngine, PipelineEngine, StepEngine
from meshfold.train.fault import FaultMonitor
from meshfold.train.feature import Features, RunParts
from meshfold.train.registry import FEATURES
from meshfold.train.progress import Progress
from meshfold.train.metrics import (MetricsLogger, device_peak_flops, model_flops_utilization, peak_memory_bytes,
                                    process_base_bytes)


@dataclasses.dataclass(frozen=True)
class Surroundings:
    """What a ``Trainer`` runs in, where its caller provides it; the defaults are a real run's."""

    dims: ParallelDims | None = None  # the mesh (None: built over the process group)
    data: Any = None  # the run's data, ``.train``/``.val``/``.tokenizer`` (None: built from [data])
    features: tuple = ()  # feature factories added after the registered ones (train/registry.py)
    kernel_device: str | None = None  # the device type kernels are picked for (None: the run's device's)
    # False where collectives return at once without data (torch's fake process group): no
    # timeouts or watchdog (train/fault.py), no object collectives (the pipeline timeline)
    collectives_wait: bool = True


class Trainer:
    def __init__(self, cfg: Config, surroundings: Surroundings = Surroundings()):
        env = self.surroundings = surroundings
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.cfg = cfg = validate(cfg, self.world)
        self.announce_split = self.rank == 0  # print the pipeline's stage split (one rank)
        t = cfg.train
        self.device = resolve_device(t.device)
        self.param_dtype, self.autocast_dtype = resolve_dtypes(t.dtype, self.device)
        workers = cfg.lowcomm.n_workers
        self.dims: ParallelDims = env.dims if env.dims is not None else build_mesh(cfg.parallel, workers,
                                                                                  self.device.type)
        self.run_dir = Path(t.run_dir)
        self.ledger = ledger()

        self.data = env.data
        if self.data is None:  # rank 0 tokenises (and caches) first so the others only read the cache
            if self.rank == 0:
                self.data = build_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len)
            self.barrier()
            if self.rank != 0:
                self.data = build_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len)
        self.prefetcher = Prefetcher(self.make_local_batch, cfg.data.prefetch, self.device)  # data.prefetch ahead
        self.use_doc_mask = cfg.data.pack and cfg.data.doc_mask
        self.progress = Progress()  # the step counter, shared explicitly with checkpointer and fault monitor
        # Features (train/feature.py): optional parts built by the registered factories
        # (train/registry.py) from their config section and the run's parts, never from the
        # trainer; the trainer calls their hooks.
        self.parts = RunParts(cfg, self.dims, self.device, self.param_dtype, self.rank, self.world, self.data,
                              self.progress, Features())
        self.features = self.parts.features.build(FEATURES + tuple(env.features), cfg, self.parts)
        self.batch_source = self.features.batch_source()
        self.sampler = make_sampler(self.data.train, t.global_batch, t.seed)  # a mixture's draws by weight

        self.loss_fn = self.build_loss()
        self.process_base_bytes = process_base_bytes(self.device)  # before the model: not what the planner models
        self.engine = self.build_engine()  # one step: LocalEngine, or PipelineEngine when parallel.pp > 1
        self.model, self.model_parts = self.engine.model, self.engine.parts
        self.pipeline = getattr(self.engine, "pipe", None)  # the pipeline executor (parallel.pp > 1)
        self.optimizer = self.build_optimizer(env.kernel_device or self.device.type)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.grad_reducers = self.dims.size("dp_cp")
        self.flops_per_token = flops_per_token(cfg.model, cfg.model.seq_len)
        self.peak_flops = device_peak_flops(self.device, t.peak_tflops)  # None: unknown GPU, no MFU
        self.losses: list[float] = []
        # This step's fields for metrics.jsonl (data wait, the engine's, MoE, the features' after_step).
        self.step_metrics: dict = {}
        self.capture_grads = False  # tests: keep the last step's unsharded gradients
        self.last_grads: dict[str, torch.Tensor] = {}
        # The features' hooks, once everything they wrap exists.
        self.parts.model, self.parts.model_parts, self.parts.engine = self.model, self.model_parts, self.engine
        self.features.attach(self.parts)
        self.step_fn = self.features.wrap_step(self._train_step)  # e.g. until a quorum of replicas commits it
        self.sampler = self.features.wrap_sampler(self.sampler)
        self.optimizer, self.scheduler = self.features.wrap_optimizer(self.optimizer, self.scheduler)
        # Checkpoints (train/checkpoint.py; components add state with checkpointer.register(name, obj))
        # and fault handling: NaN guard, stragglers, collective timeouts (train/fault.py). Both get
        # the objects they read, once the features have wrapped them, and the run's Progress.
        self.checkpointer = Checkpointer(cfg, self.model_parts, self.optimizer, self.scheduler, self.sampler,
                                         self.progress)
        self.fault = FaultMonitor(t, self.rank, self.world, self.progress, self.checkpointer,
                                  collectives_wait=env.collectives_wait)
        if not self.features.world_collectives:
            self.fault.every = 0  # a feature promises no collective over all ranks: no straggler check
        self.features.register_state(self.checkpointer)
        self.stop: StopRequest | None = None  # the CLI's signal handler (train/stop.py); None in-process
        self.lock: RunLock | None = None
        self.record: dict = {}
        self.resume_changes: list[str] = []

    @property
    def step(self) -> int:
        """Optimizer steps completed (held by ``self.progress``)."""
        return self.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.progress.step = value

    # ------------------------------------------------------------------ setup

    def build_loss(self):
        """The token-loss sum of a batch's logits: ``cross_entropy_sum``, or its
        vocabulary-parallel form when the logits arrive split over tp; the features' loss
        terms around it (``wrap_loss``: multi-token prediction's depths, computed the same way)."""
        base = (vocab_parallel_loss(self.dims, self.cfg) if self.dims.distributed and self.dims.enabled("tp")
                else cross_entropy_sum)
        return self.features.wrap_loss(base)

    def build_engine(self) -> StepEngine:
        """This rank's model (or pipeline stages) and the step engine that runs it."""
        torch.manual_seed(self.cfg.train.seed)
        cfg, dims = self.cfg, self.dims
        if cfg.parallel.pp > 1:  # only this rank's stage(s): meshfold/parallel/pp/
            pipe = Pipeline(cfg, dims, self.device, self.param_dtype, self.autocast_dtype or self.param_dtype,
                            announce=self.announce_split)
            return PipelineEngine(pipe, cfg, dims, self.device, self.autocast_dtype, self.loss_fn, self.use_doc_mask,
                                  write_timeline=self.rank == 0, forward_inputs=self.features.forward_inputs(),
                                  timeline=self.surroundings.collectives_wait)
        # Built on the meta device: parallelize shards it there and allocates only this
        # rank's pieces, filled with the one-process initial values (parallel/materialize.py).
        model = self.features.prepare_model(build_on_meta(lambda: Transformer(cfg.model), self.param_dtype))
        model = parallelize(model, cfg, dims, self.device, comm_hook=self.features.comm_hook())
        return LocalEngine(model, cfg, dims, self.device, self.autocast_dtype, self.loss_fn, self.use_doc_mask,
                           forward_inputs=self.features.forward_inputs())

    def build_optimizer(self, device_type: str) -> torch.optim.Optimizer:
        """AdamW, ZeRO-1 sharded over dp_shard_cp where ``parallel.zero = 1`` shards it.
        Under bf16 compute ZeRO-1 gathers bf16 parameters straight into the step's compute
        weights (``optim/sharded.py::ShardedAdamW``), except where a feature reads or writes
        the fp32 parameters between steps or replaces the optimizer (``touches_master_weights``:
        low-communication methods, 1-bit Adam, live recovery): those keep the fp32 gather."""
        cfg, t = self.cfg, self.cfg.train
        features_touch_masters = self.features.touches_master_weights
        return build_optimizer(
            self.model, t, self.dims, device_type,
            zero_one=cfg.parallel.zero == 1 and uses_ddp(self.dims) and self.dims.size("dp_shard_cp") > 1,
            sharded=uses_grad_reducer(self.dims) and self.dims.enabled("tp"),
            weights=None if features_touch_masters else self.engine.weights)

    def barrier(self) -> None:
        if dist.is_initialized() and self.world > 1:
            comm.barrier()

    # ------------------------------------------------------------------ one step

    def local_batch(self) -> dict[str, torch.Tensor]:
        if self.batch_source is not None:  # a feature supplies the batches (data.balance)
            return self.batch_source.local_batch(self.device)
        global_indices = self.sampler.next()
        upcoming = peek(self.sampler, self.cfg.data.prefetch) if self.cfg.data.prefetch else []
        batch = self.prefetcher.get(global_indices, upcoming)
        self.step_metrics["data_wait_s"] = self.prefetcher.wait_s
        self.step_metrics.update(self.features.after_batch())  # e.g. a mixture's tokens per source
        return batch

    def make_local_batch(self, global_indices) -> dict[str, torch.Tensor]:
        """This rank's slice of a global batch, on the host (runs in the prefetch thread)."""
        local = rank_slice(global_indices, self.dims.rank("dp"), self.dims.size("dp"))
        batch = self.data.train.batch(local)
        top = int(batch["inputs"].max()) if batch["inputs"].numel() else 0  # host, off the step's path
        if top >= self.cfg.model.vocab_size:  # a corrupt shard the verification has not reached yet
            check_verified()
            raise ConfigError(f"token id {top} in the training data ({self.cfg.data.source}) is outside "
                              f"model.vocab_size = {self.cfg.model.vocab_size}: a shard is corrupt; re-run "
                              f"`meshfold prepare` into a new folder")
        return shard_for_context_parallel(batch, self.cfg, self.dims)  # cp: this rank's slice + positions

    def micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return self.engine.micro_batches(batch)

    def all_reduce_sum(self, value: torch.Tensor, dim: str = "dp_cp") -> torch.Tensor:
        if self.dims.distributed and self.dims.size(dim) > 1:
            comm.all_reduce(value, self.dims.group(dim), None)  # control scalars: not counted as traffic
        return value

    def forward_loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """The token-loss sum of one micro-batch (no pipeline)."""
        return self.engine.forward_loss(mb)

    def strict_scope(self):
        """Strict mode (MESHFOLD_STRICT=1, the test suite): tensors created without device=
        inside the step are tracked as host tensors, refused by the comm layer as NCCL would
        (meshfold/comm.py). Not under torch.compile, which traces through the mode."""
        return comm.strict_scope(enabled=not self.cfg.train.compile)

    def train_step(self) -> float:
        with self.strict_scope():
            return self.step_fn()  # the features' wrap_step around _train_step

    def _train_step(self) -> float:
        batch = self.local_batch()
        self.features.before_step()  # e.g. a step redone (live recovery) starts its own losses
        global_tokens = self.all_reduce_sum((batch["labels"] != IGNORE_INDEX).sum())  # the loss's denominator
        micro = self.features.micro_batches(self.micro_batches(batch))
        loss_sum = self.engine.step(micro, global_tokens, self.step + 1)  # gradients accumulated and reduced
        self.step_metrics.update(self.engine.pop_metrics())
        # e.g. over the replica groups that took part (live recovery; raises to redo the step)
        loss_sum, global_tokens = self.features.reduce(loss_sum, global_tokens)
        self.last_grad_norm = self.engine.clip_grad_norm(self.cfg.train.grad_clip)
        if self.capture_grads and self.step + 1 >= self.cfg.train.steps:  # (the last step's only: a
            self.last_grads = self.full_state(grads=True)  # gather of every gradient)
        if self.fault.update_allowed(self.last_grad_norm):  # non-finite grad norm: skip the update
            self.optimizer.step()
        self.step_metrics.update(self.features.after_update())  # e.g. MoE load, imbalance, dropped; bias update
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.all_reduce_sum(loss_sum) / global_tokens.double()
        late = self.features.device_metrics(global_tokens)  # device values, e.g. mtp_loss
        self.step += 1
        self.step_metrics.update(self.features.after_step(self.step))  # e.g. the outer step when due
        loss = float(loss)
        self.step_metrics.update({k: float(v) for k, v in late.items()})  # read after the loss: no second wait
        return loss

    # ------------------------------------------------------------------ loop

    @torch.no_grad()
    def evaluate(self) -> float | None:
        with self.strict_scope():
            return self._evaluate()

    def _evaluate(self) -> float | None:
        if self.data.val is None:
            return None
        t = self.cfg.train
        self.model.eval()
        # The same held-out sequences whatever the layout: a batch of what one optimizer step
        # of the whole run sees (global_batch per worker x workers), every worker scoring
        # its own model on all of them.
        size = min(t.global_batch * self.dims.size("worker"), len(self.data.val))
        sampler = GlobalBatchSampler(len(self.data.val), size, seed=12345)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for _ in range(t.eval_batches):
            idx = rank_slice(sampler.next(), self.dims.rank("dp"), self.dims.size("dp"))
            batch = shard_for_context_parallel(self.data.val.batch(idx), self.cfg, self.dims)
            batch = {k: v.to(self.device) for k, v in batch.items()}
            total += self.engine.evaluate(batch)
            tokens += (batch["labels"] != IGNORE_INDEX).sum()
        self.model.train()
        return float(self.all_reduce_sum(total) / self.all_reduce_sum(tokens))

    def write_run_dir(self) -> None:
        if self.rank == 0:
            path = self.run_dir / "config.toml"
            try:
                path.write_text(dump_toml(self.cfg))
            except OSError as err:
                raise RunDirError(f"cannot write the run's config: {explain_write_failure(path, err)}") from None

    def data_identity(self) -> dict:
        """What makes two data sets the same for a resume: the tokenizer and the training
        sequences (count, and the corpus's tokens)."""
        train = self.data.train
        corpus = getattr(train, "corpus", None)
        return {"tokenizer_sha256": tokenizer_sha256(self.data.tokenizer), "train_sequences": len(train),
                **({"train_tokens": int(corpus.n_tokens)} if corpus is not None else {})}

    def open_run_dir(self) -> None:
        """Before anything is written: the run directory is a writable folder, this run holds
        its lock, and (resuming) it holds a run of this model and data. Rank 0 checks; every
        rank raises the same one-line error."""
        problem = None
        # The features' run-directory policy (e.g. live replicas share one the launcher locks,
        # and a restarted replica heals from a peer, not from disk).
        if self.rank == 0:
            try:
                prepare_run_dir(self.run_dir)
                if self.features.holds_run_lock:
                    self.lock = RunLock(self.run_dir)
                    self.lock.acquire()
                self.record = run_record(self.cfg, self.data_identity(), self.world)
                if self.features.checks_resume:
                    self.resume_changes = self.check_record()
                if self.features.holds_run_lock and not self.resumes() and holds_a_run(self.run_dir):
                    self.move_to(beside(self.run_dir))  # one run per directory: never append to another's
                    self.lock = RunLock(self.run_dir)
                    self.lock.acquire()
            except (RunDirError, ConfigError) as err:
                problem = (type(err).__name__, str(err))
            except Exception as err:  # noqa: BLE001 - the other ranks wait on this answer: never leave them hanging
                problem = ("RunDirError", f"{self.run_dir}: {type(err).__name__}: {err}")
        if dist.is_initialized() and self.world > 1:
            problem, run_dir = comm.broadcast_object((problem, str(self.run_dir)))  # start-up, once
            if run_dir != str(self.run_dir):
                self.move_to(Path(run_dir))
        if problem is not None:
            self.release_lock()
            kind, message = problem
            if self.rank != 0:
                message = "rank 0 refused the run directory (see its line)"
            raise (ConfigError if kind == "ConfigError" else RunDirError)(message)

    def resumes(self) -> bool:
        """This run continues the run directory's checkpoints (``train.resume = auto``)."""
        return self.cfg.train.resume == "auto" and bool(published(self.run_dir / "checkpoints"))

    def move_to(self, run_dir: Path) -> None:
        """Write this run to ``run_dir`` instead (rank 0 says where, once)."""
        if self.rank == 0:
            self.release_lock()
            print(f"meshfold: {self.run_dir} holds another run's metrics and no checkpoint to resume; "
                  f"this run writes to {run_dir}", file=sys.stderr, flush=True)
        self.run_dir = run_dir
        self.cfg.train.run_dir = str(run_dir)
        self.checkpointer.root = run_dir / "checkpoints"

    def check_record(self) -> list[str]:
        """Rank 0: compare with the run directory's record (or, for a run directory from
        before records, with its newest checkpoint's manifest)."""
        ckpts = published(self.run_dir / "checkpoints")
        if self.cfg.train.resume == "never" and ckpts:
            raise ConfigError(
                f"train.resume = never but train.run_dir = {str(self.run_dir)!r} holds checkpoints "
                f"({', '.join(p.name for p in ckpts[:3])}) that this run would replace; choose a new train.run_dir "
                f"(with train.init_from = {ckpts[0]} to start from its weights)")
        saved = read_record(self.run_dir)
        if saved is None and ckpts:
            try:
                manifest = json.loads((ckpts[0] / "meshfold.json").read_text())
                saved = {"model": manifest.get("model", {})}
            except (OSError, ValueError):
                saved = None
        if saved is None or self.cfg.train.resume == "never" or not ckpts:
            return []  # nothing to resume: a fresh start, whatever ran here before
        return check_resume(self.run_dir, saved, self.record, ckpts[0].name if ckpts else None)

    @property
    def writes_run_files(self) -> bool:
        """run.json and config.toml: written once per run (a feature may leave it to another
        process: under live recovery, replica 0)."""
        return self.features.writes_run_files

    def release_lock(self) -> None:
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.release()
            self.lock = None

    def build_report(self) -> dict:
        """This rank's share of the model as built (max over ranks): parameter count and
        bytes, and the process's peak resident memory so far."""
        numel = nbytes = 0
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            numel += local.numel()
            nbytes += local.numel() * local.element_size()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        stats = torch.tensor([numel, nbytes, rss], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.world > 1:
            comm.all_reduce(stats, None, "world", op="max")  # start-up, not a step
        return {"params_per_rank": int(stats[0]), "param_bytes_per_rank": int(stats[1]),
                "peak_rss_bytes": int(stats[2]), "world": self.world}

    def fit(self) -> list[float]:
        t = self.cfg.train
        if t.steps == 0:  # build, report, exit (a check that the layout fits)
            report = self.build_report()
            if self.rank == 0:
                print("meshfold: built: " + ", ".join(f"{k} {v}" for k, v in report.items()), flush=True)
            return []
        self.open_run_dir()  # a writable folder, locked by this run, of this model and data
        try:
            return self._fit()
        finally:
            self.release_lock()

    def _fit(self) -> list[float]:
        t = self.cfg.train
        self.checkpointer.resume(tidy=self.writes_run_files)  # train.resume / train.init_from; sets the step
        if self.rank == 0 and self.writes_run_files:
            if self.step and self.resume_changes:
                print(f"meshfold: resuming at step {self.step} with changes: {'; '.join(self.resume_changes)}",
                      file=sys.stderr, flush=True)
            write_record(self.run_dir, self.record)
            self.write_run_dir()
        logger = MetricsLogger(self.run_dir, t.steps, enabled=self.rank == 0, tensorboard=t.tensorboard,
                               progress=t.progress, start_step=self.step)
        logger = self.features.wrap_logger(logger)
        tokens_per_step = t.global_batch * self.cfg.model.seq_len * self.dims.size("worker")  # batch is per worker
        try:
            while self.step < t.steps:
                start = time.perf_counter()
                try:
                    with self.fault.step():  # straggler stamps; timeouts named
                        loss = self.train_step()
                except StopAtBoundary as err:  # e.g. live recovery's lighthouse lost: checkpoint, stop
                    self.stop_now(self.fault.healthy, cause=str(err))
                elapsed = time.perf_counter() - start
                self.losses.append(loss)
                if not math.isfinite(loss) and self.rank == 0:
                    print(f"meshfold: warning: non-finite loss at step {self.step}", flush=True)
                with self.fault.boundary():  # a peer lost in these collectives is named too
                    record = self.step_record(loss, elapsed, tokens_per_step)
                    if t.eval_every and self.step % t.eval_every == 0:
                        record["val_loss"] = self.evaluate()
                    if self.step % t.log_every == 0 or self.step == t.steps:
                        logger.log(record)
                    self.fault.after_step()  # NaN-guard rollback
                    check_verified()  # a shard a background verification found corrupt stops the run
                    healthy = self.fault.healthy and math.isfinite(loss)
                    if self.stop is not None and self.stop.agreed(self.device):
                        self.stop_now(healthy)
                    self.checkpointer.maybe_save(healthy)
            self.checkpointer.wait()
            if self.checkpointer.save_failure is not None:  # the run's last save: never exit 0 without it
                raise RunDirError(self.checkpointer.save_failure)
            self.features.close()
        finally:
            self.prefetcher.close()
            logger.close()
            self.checkpointer.close()
            self.fault.close()
        return self.losses

    def stop_now(self, healthy: bool, cause: str | None = None) -> None:
        """Every rank agreed to stop after this step (a signal, or ``cause``): write its checkpoint
        (unless the step was non-finite, or another process owns the run directory's files: a live
        replica other than 0) and raise ``Stopped``."""
        saved = failure = None
        if self.step != self.checkpointer.last_saved_step and healthy and self.writes_run_files:
            if self.checkpointer.save():
                self.checkpointer.wait()
        if self.checkpointer.save_failure is None and self.checkpointer.last_saved_step is not None:
            saved = str(self.checkpointer.root / f"step-{self.checkpointer.last_saved_step}")
        elif self.writes_run_files:
            failure = self.checkpointer.save_failure or "the last step was non-finite: no checkpoint written"
        raise Stopped(cause or self.stop.name, self.step, saved, failure)

    def step_record(self, loss: float, elapsed: float, tokens_per_step: int) -> dict:
        tokens_per_s = tokens_per_step / elapsed
        return {
            "step": self.step,
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(self.last_grad_norm),
            "step_time_s": elapsed,
            "tokens_per_s": tokens_per_s,
            "mfu": model_flops_utilization(self.flops_per_token * tokens_per_s, self.peak_flops, self.world),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "process_base_bytes": self.process_base_bytes,
            "comm_bytes": self.ledger.pop_step(),
            "comm_bytes_total": {k: int(round(v)) for k, v in sorted(self.ledger.total.items())},
            **self.pop_step_metrics(),
        }

    def pop_step_metrics(self) -> dict:
        out, self.step_metrics = {**self.step_metrics, **self.fault.pop_metrics()}, {}
        return out

    # ------------------------------------------------------------------ inspection

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded parameters (or their gradients) by model name, for tests and export
        (under pipeline parallel: gathered from every stage onto pp rank 0)."""
        return self.engine.full_state(grads)
