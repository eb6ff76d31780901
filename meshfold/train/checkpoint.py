"""Distributed checkpoints: save, validate, publish atomically, resume into any layout.

What a checkpoint holds (``RUN_DIR/checkpoints/step-N/``, written with
``torch.distributed.checkpoint`` (DCP), one ``.distcp`` file per rank plus ``.metadata``):

- ``model.<fqn>``: parameters by their *model* names (``layers.3.attention.wq.weight``),
  never by wrapper names, taken with ``get_state_dict`` so FSDP2/HSDP DTensors, DDP-wrapped
  and plain tensors all map to the same keys. DCP stores each shard with its global offsets,
  so a checkpoint saved under one ``[parallel]`` loads under another (resharding).
- ``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>`` and ``optim.param_groups.<fqn>.<key>``:
  the optimizer, flattened by parameter name (layout-independent). Each optimizer owns
  what it saves and how it reads it back in another layout (``optim/state.py``'s
  protocol): AdamW as DCP flattens it; ZeRO-1 ranks each the state they own, whole
  parameters (``optim/zero_one.py``) or the rectangular boxes of their flat segment
  (``optim/sharded.py``, ``Chunks``); 1-bit Adam adds its step count.
- ``scheduler``, ``sampler`` (data-loader position), ``step``, ``rng.rank<R>`` (this
  rank's RNG states) and ``extra.<name>``: state of components registered with
  ``Checkpointer.register(name, obj)`` (anything with ``state_dict``/``load_state_dict``,
  e.g. the low-communication outer optimizer).
- ``meshfold.json`` (the manifest): step, layout, model shape, and size + SHA-256 of every
  file. A checkpoint is *published* only once complete: DCP writes into
  ``checkpoints/.tmp-step-N``; each rank hashes the files it wrote as soon as they are
  written (all ranks in parallel, ``SafeWriter``); rank 0 merges those hashes into the
  manifest, fsyncs and renames the folder to ``step-N`` (one atomic ``rename``). Older
  checkpoints are removed only after a newer one is published, so a failed save (full
  disk) never costs the last good one.
- ``dcp_metadata.json``: DCP's metadata as JSON. Loading reads this, never the pickled
  ``.metadata``, and loads plain values with ``torch.load(weights_only=True)``: nothing in
  a checkpoint is unpickled, so a tampered file is refused with one line, never executed.

On resume (``train.resume = auto``) every rank walks the published checkpoints newest
first: it checks every file's size, hashes its share of the files (rank k: every n-th
from the k-th) and checks its own model tensors' shapes; the first checkpoint no rank
objects to is loaded by all. Each one skipped is reported (by the rank that found the
fault) with what is wrong.

Modules: ``checkpoint_files.py`` (the folder on disk: manifest, validation, atomic
publishing, the pickle-free reader and writer), ``renamed_keys.py`` (checkpoints from
before a rename), and each optimizer's own checkpoint state (``meshfold/optim``); this
one assembles the state and decides when to save, what to resume from and how to load it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from meshfold import comm
from meshfold.optim.state import CheckpointState, CheckpointStateError, ParamNames, state_of
from meshfold.parallel.ep.expert_tp import checkpoint_view, restore_placements
from meshfold.optim.zero_state import Chunks
from meshfold.train.checkpoint_files import (
    CheckpointError,
    SafeWriter,
    publish,
    published,
    read_dcp_metadata,
    first_failure,
    root_cause,
    safe_load,
    step_of,
    validate_checkpoint,
    write_manifest,
)
from meshfold.train.progress import Progress
from meshfold.train.renamed_keys import joinable, read_old_names
from meshfold.train.run_dir import describe_os_error, explain_write_failure

# Optimizer flags that describe the implementation, not the state: keep this run's.
_IMPL_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _log(message: str) -> None:
    print(f"meshfold: checkpoint: {message}", file=sys.stderr, flush=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        comm.barrier()


def _flag_device() -> torch.device:
    """Where the default group's small flags live: the GPU under NCCL, else the host."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _any_rank(flag: bool, group=None) -> bool:
    """True on every rank if it is True on any (one max all-reduce of a device flag)."""
    if _world() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device())
    comm.all_reduce(t, group or dist.group.WORLD, "ckpt", op="max")
    return bool(t.item())  # outside the step: a checkpoint decision every rank must share


@contextmanager
def _one_line_refusal():
    """An optimizer state that cannot be checkpointed in this layout, as one line."""
    try:
        yield
    except CheckpointStateError as err:
        raise CheckpointError(str(err)) from None


def _stage(value: Any, buffers: dict, key: str = "") -> Any:
    """A private CPU copy of a state dict for an asynchronous save: tensors copied to CPU
    (DTensors keep their mesh and placements), everything else deep-copied. ``buffers``
    keeps the CPU tensors between saves (fresh 100s of MB cost page faults every time);
    the previous async save has finished before the next one stages, so reuse is safe."""
    if isinstance(value, dict):
        return {k: _stage(v, buffers, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, Chunks):
        return Chunks(value.shape, [(o, _stage(t, buffers, f"{key}.{i}")) for i, (o, t) in enumerate(value.chunks)])
    if not torch.is_tensor(value):
        return copy.deepcopy(value)
    local = value.to_local() if isinstance(value, DTensor) else value
    buf = buffers.get(key)
    if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
        buf = buffers[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu")
    buf.copy_(local.detach())
    if isinstance(value, DTensor):
        return DTensor.from_local(buf, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return buf


class _MergedChunks(torch.nn.Module):
    """Several pipeline chunks seen as one module with the full model's names: each chunk's
    ``layers`` entries (keyed by global index) and its embedding/norm/output. The state-dict
    helpers then map every optimizer parameter to its layout-independent name."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        for chunk in chunks:
            for name, child in chunk.named_children():
                if child is None:
                    continue
                if isinstance(child, torch.nn.ModuleDict):
                    if name not in self._modules:
                        self.add_module(name, torch.nn.ModuleDict())
                    self._modules[name].update(child)
                elif name in self._modules:
                    raise ValueError(f"two pipeline chunks both hold {name}")
                else:
                    self.add_module(name, child)


def _whole_model(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """The model chunks this rank holds (pipeline stages may hold several) as one module."""
    return parts[0] if len(parts) == 1 else _MergedChunks(parts)


def _per_group(state: dict, groups: int, path: Path) -> dict:
    """A scheduler's per-group lists (``base_lrs``, ``_last_lr``) cut to this run's number of
    parameter groups: expert parallel with zero 0/1 keeps the experts in groups of their own,
    so another layout's checkpoint may list more or fewer. Every group runs the one schedule
    of ``train.lr``, so any count of equal values fits any other."""
    out = dict(state)
    for key in ("base_lrs", "_last_lr"):
        values = out.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            if len(set(values)) != 1:
                raise CheckpointError(f"{path}: scheduler.{key} has {len(values)} different values for {groups} "
                                      f"parameter groups")
            out[key] = values[:1] * groups
    return out


class Checkpointer:
    """Saves and restores a run's whole state; see the module docstring. Its inputs are
    explicit (it never sees the Trainer): the run's config, the model chunks this rank
    holds, the optimizer, scheduler and sampler the run steps, and the run's ``Progress``
    (the step it saves, and sets when it loads a checkpoint)."""

    def __init__(self, cfg, parts: list[torch.nn.Module], optimizer, scheduler, sampler, progress: Progress):
        self.cfg, self.parts, self.progress = cfg, list(parts), progress
        self.optimizer, self.scheduler, self.sampler = optimizer, scheduler, sampler
        t = cfg.train
        self.every = t.checkpoint_every
        self.keep = t.keep_checkpoints
        self.use_async = t.async_checkpoint
        self.root = Path(t.run_dir) / "checkpoints"
        self.extras: dict[str, Any] = {}
        self.rank = _rank()
        self.last_saved_step: int | None = None
        # The last save's failure (one line), None once a save is published: a run whose last
        # save failed does not end with exit 0.
        self.save_failure: str | None = None
        # Steps never pruned: the checkpoint the NaN guard last rolled back to (known good).
        self.pinned: set[int] = set()
        self._skipped_unhealthy: int | None = None  # the step whose save was withheld (logged once)
        # Async: the upload and rank 0's publishing (hashing, manifest, rename, pruning)
        # run on this one background thread; ``_pending`` is its future.
        self._pending: Future | None = None
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="meshfold-ckpt") if self.use_async else None
        self._staging: dict[str, torch.Tensor] = {}  # CPU copies reused by every async save
        # Async saves talk over their own group so their collectives never interleave
        # with training collectives on the main group (gloo runs them in order).
        self._group = None
        if self.use_async and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------ extension point

    def register(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` (``state_dict()``/``load_state_dict()``) with every
        checkpoint under ``extra.<name>``. Tensors in it: DTensors are resharded; plain
        tensors are taken as identical on every rank (key them by rank if they are not)."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"checkpoint extra {name!r} needs state_dict() and load_state_dict()")
        self.extras[name] = obj

    # ------------------------------------------------------------------ state dicts

    def _model_state(self) -> dict[str, Any]:
        return get_model_state_dict(_whole_model(self.parts))

    def _optim(self) -> CheckpointState:
        """The optimizer's checkpoint state (``optim/state.py``): it decides what it saves,
        what it reads back in this layout and how it takes it in."""
        return state_of(self.optimizer)

    def _optim_state(self) -> dict[str, Any]:
        with _one_line_refusal():
            return self._optim().checkpoint_state(ParamNames(_whole_model(self.parts)))

    def _rng_state(self) -> dict[str, torch.Tensor]:
        out = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state()
        return out

    def state_dict(self) -> dict[str, Any]:
        sd = {
            # (expert tp's strided weights as DCP can write them: parallel/ep/expert_tp.py)
            "model": checkpoint_view(self._model_state()),
            "optim": checkpoint_view(self._optim_state()),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.progress.step,
            f"rng.rank{self.rank}": self._rng_state(),
        }
        for name, obj in self.extras.items():
            sd[f"extra.{name}"] = obj.state_dict()
        return sd

    def expected_shapes(self) -> dict[str, tuple]:
        """Global shape of every model tensor this rank holds (pipeline stages hold
        different layers; every rank checks its own): what a checkpoint must contain."""
        return {f"model.{k}": tuple(v.shape) for k, v in self._model_state().items() if torch.is_tensor(v)}

    # ------------------------------------------------------------------ saving

    def maybe_save(self, healthy: bool = True) -> None:
        """Called after every step: publish a finished async save; save if it is time. No
        checkpoint is written while steps are unhealthy (``healthy`` False: the last step
        was non-finite), so a rollback never lands on a broken step and the good
        checkpoints are not rotated out by broken ones."""
        self._poll()
        step = self.progress.step
        if self.every > 0 and step % self.every == 0 and step != self.last_saved_step:
            if not healthy:
                if self.rank == 0:
                    _log(f"not saving step {step}: its step was non-finite (the previous checkpoints are kept)")
                return
            self.save()

    def save(self) -> bool:
        """Checkpoint the current step. Returns False (after logging why) if writing failed;
        the previous good checkpoints are untouched in that case."""
        self.wait()
        step = self.progress.step
        tmp = self.root / f".tmp-step-{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        self._optim().before_checkpoint()
        sd = self.state_dict()
        self.last_saved_step = step
        try:
            if self.use_async:
                # Copy the state (the only part training waits for), then write it with a
                # plain DCP save on the background thread, over the spare group.
                self._pending = self._publisher.submit(self._save_async, _stage(sd, self._staging), tmp, step)
                return True
            dcp.save(sd, storage_writer=SafeWriter(str(tmp)))
        except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - a failed save must not end training
            self._failed(tmp, step, err)
            return False
        return self._publish(tmp, step)

    def _failed(self, tmp: Path, step: int, err: BaseException) -> None:
        first = first_failure(err)
        if isinstance(first, OSError) and first.errno:
            cause = describe_os_error(first, tmp)
        elif "unexpected pos" in str(first) or "PytorchStreamWriter" in str(first):
            cause = explain_write_failure(tmp, first)  # torch's writer hides the errno: name the cause
        else:
            cause = root_cause(err)
        good = [p.name for p in published(self.root)] if self.root.is_dir() else []
        self.save_failure = (f"saving step {step} failed ({cause}); the previous checkpoints are kept: "
                             f"{', '.join(good) or 'none yet'}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            _log(self.save_failure)

    def _publish(self, tmp: Path, step: int) -> bool:
        """Rank 0: merge the ranks' hashes into the manifest, rename into place, prune. All
        files are written when this runs (DCP's save returns after every rank finished).
        No collective follows: the other ranks go on training (their part is done and
        they return True); a rank 0 failure is logged by rank 0 and the previous
        checkpoints stay, so nothing waits on rank 0's rename."""
        if self.rank != 0:
            self.save_failure = None
            return True
        try:
            self._write_manifest(tmp, step)
            publish(tmp, self.root / f"step-{step}")  # replaces a step saved before a rollback
            self._prune()
        except OSError as err:
            self._failed(tmp, step, err)
            return False
        self.save_failure = None
        return True

    def _write_manifest(self, tmp: Path, step: int) -> None:
        cfg = self.cfg.to_dict()
        write_manifest(tmp, {
            "step": step,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "parallel": cfg["parallel"],
            "model": cfg["model"],
            "extras": sorted(self.extras),
        })

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        kept = 0
        for path in published(self.root):
            if step_of(path) in self.pinned:
                continue  # the known-good checkpoint of the NaN guard: never rotated out
            kept += 1
            if kept > self.keep:
                shutil.rmtree(path, ignore_errors=True)

    def _poll(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    def _save_async(self, staged: dict, tmp: Path, step: int) -> bool:
        """Background thread: write every rank's files, then publish (rank 0)."""
        try:
            dcp.save(staged, storage_writer=SafeWriter(str(tmp)), process_group=self._group)
        except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001
            self._failed(tmp, step, err)
            return False
        return self._publish(tmp, step)

    def wait(self) -> None:
        """Block until an async save in flight is written and published."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Finish an async save in flight and release its thread and group (a save after
        this is synchronous)."""
        self.wait()
        self.use_async = False
        self._staging = {}
        if self._publisher is not None:
            self._publisher.shutdown()
            self._publisher = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    # ------------------------------------------------------------------ loading

    def _validate_everywhere(self, path: Path) -> str | None:
        """Every rank checks the sizes, hashes its share of the files and checks its own
        tensors' shapes, in parallel; all agree. Returns this rank's error (None if it found
        none) and raises nothing; ``_any_rank`` says whether any rank found one."""
        try:
            validate_checkpoint(path, self.expected_shapes(), share=(self.rank, _world()))
        except CheckpointError as err:
            return str(err)
        return None

    def find_latest(self) -> Path | None:
        """The newest checkpoint that validates on every rank (each one skipped is reported
        by the rank that found the fault); every rank gets the same answer."""
        for path in published(self.root):  # every rank lists the same shared run directory
            error = self._validate_everywhere(path)
            if error:
                _log(f"skipping {path.name}: {error}" + (f" (found by rank {self.rank})" if _world() > 1 else ""))
            if not _any_rank(error is not None):
                return path
        return None

    def load(self, path: Path, restore_sampler: bool = True, strict_extras: bool = False) -> int:
        """Load every piece of state from ``path`` into the run's objects; sets and returns
        its step."""
        saved = read_dcp_metadata(path).state_dict_metadata
        meta_keys = set(saved) | joinable(saved)  # (and what it has under old names: renamed_keys.py)
        self._optim().before_load()  # (ZeRO-1 under bf16 frees the fp32 parameters between steps)
        sd = self.state_dict()
        # Keys this rank may ask for: its own RNG if the checkpoint has it, extras present.
        sd.pop(f"rng.rank{self.rank}")
        if any(k.startswith(f"rng.rank{self.rank}.") for k in meta_keys):
            sd[f"rng.rank{self.rank}"] = self._rng_state()
        for name in list(self.extras):
            if not any(k.startswith(f"extra.{name}") for k in meta_keys):
                if strict_extras:
                    raise CheckpointError(f"{path}: has no state for {name!r}")
                _log(f"{path.name} has no state for {name!r}; it starts fresh")
                sd.pop(f"extra.{name}")
            elif hasattr(self.extras[name], "load_template"):
                # What to load comes from the checkpoint (state created lazily, other layouts).
                prefix = f"extra.{name}."
                try:
                    sd[f"extra.{name}"] = self.extras[name].load_template(
                        {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)})
                except ValueError as err:
                    raise CheckpointError(f"{path}: {err}") from None
        optim = self._optim()
        model = _whole_model(self.parts)
        names = ParamNames(model)
        with _one_line_refusal():  # what this rank reads, in this layout, whatever layout wrote it
            originals = {"model": self._model_state(),
                         "optim": optim.checkpoint_template(names, {k[len("optim."):] for k in meta_keys
                                                                    if k.startswith("optim.")})}
        sd["optim"] = checkpoint_view(originals["optim"])
        put_back = read_old_names(sd, saved)  # a checkpoint from before a rename
        safe_load(sd, path)
        put_back()
        sd.update(restore_placements({k: sd[k] for k in originals}, originals))

        flags = [{k: g[k] for k in _IMPL_FLAGS if k in g} for g in self.optimizer.param_groups]
        with _one_line_refusal():
            optim.load_checkpoint_state(names, sd["optim"])
        set_model_state_dict(model, sd["model"])
        for group, kept in zip(self.optimizer.param_groups, flags):
            group.update(kept)
        optim.after_load()
        self.scheduler.load_state_dict(_per_group(sd["scheduler"], len(self.optimizer.param_groups), path))
        if restore_sampler:
            self.sampler.load_state_dict(sd["sampler"])
        rng = sd.get(f"rng.rank{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        for name, obj in self.extras.items():
            if f"extra.{name}" in sd:
                obj.load_state_dict(sd[f"extra.{name}"])
        self.progress.step = int(sd["step"])
        self.last_saved_step = self.progress.step
        return self.progress.step

    def load_model_only(self, path: Path) -> None:
        """``train.init_from``: parameters only (e.g. a converted Hugging Face model)."""
        error = self._validate_everywhere(path)
        if _any_rank(error is not None):
            raise CheckpointError(f"train.init_from: {error or f'{path} was refused by another rank (see its line)'}")
        self._optim().before_load()
        original = self._model_state()
        sd = {"model": checkpoint_view(original)}
        put_back = read_old_names(sd, read_dcp_metadata(path).state_dict_metadata)
        safe_load(sd, path)
        put_back()
        sd["model"] = restore_placements(sd["model"], original)
        set_model_state_dict(_whole_model(self.parts), sd["model"])
        self._optim().after_load()

    def resume(self, tidy: bool = True) -> int | None:
        """At the start of ``fit``: resume from the newest good checkpoint
        (``train.resume = auto``), else start from ``train.init_from`` if set. ``tidy``: this
        process owns the run directory's files (it trims metrics.jsonl and clears unpublished
        saves); false for a process sharing the directory with their owner (a live replica)."""
        t = self.cfg.train
        if t.resume == "auto":
            _barrier()  # a save of this job still being published by rank 0 is listed by all or none
            path = self.find_latest()
            candidates = published(self.root)
            if path is None and candidates:  # never start over on top of a run's checkpoints
                raise CheckpointError(
                    f"every checkpoint in {self.root} is unreadable ({', '.join(p.name for p in candidates)}; "
                    f"see the lines above); nothing was changed. Restore or move them aside to start over, or "
                    f"start a new run: --set train.run_dir=NEW")
            if path is not None:
                step = self.load(path)
                if self.rank == 0:
                    _log(f"resumed from {path} (step {step})")
                if self.rank == 0 and tidy:
                    self._trim_metrics(step)
                    self._clear_temporaries()
                return step
        if t.init_from:
            self.load_model_only(Path(t.init_from))
            if self.rank == 0:
                _log(f"initialised the model from {t.init_from}")
        return None

    def rollback(self) -> int | None:
        """Back to the newest good checkpoint, keeping the data position (the batches
        that produced non-finite values are not replayed). None if there is none."""
        self.wait()
        _barrier()  # rank 0 has published the last save before anyone lists the folder
        path = self.find_latest()
        if path is None:
            return None
        step = self.load(path, restore_sampler=False)
        self.pinned = {step}  # the known-good checkpoint: kept whatever keep_checkpoints says
        return step

    def _trim_metrics(self, step: int) -> None:
        """Drop metrics lines of steps after the resumed one (they will be redone)."""
        path = Path(self.cfg.train.run_dir) / "metrics.jsonl"
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:
                continue  # a line cut by the crash
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)

    def _clear_temporaries(self) -> None:
        for p in self.root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)
