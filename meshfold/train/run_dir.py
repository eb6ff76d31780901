"""The run directory, made safe to reuse: one run at a time in it (``RunLock``), a record of
what the run is (``run.json``: model shape, data identity, and the settings that may change
on resume), and its I/O failures as one line naming the path and the cause.

Resuming a run directory with another model shape or another data set would silently
start over (every checkpoint "skipped", then replaced) or load weights into the wrong
model; ``check_resume`` refuses both with one line naming the keys that differ and how to
start a new run from those weights on purpose (``train.init_from``). What may change on
resume (the layout, the process count, the learning-rate schedule, the global batch) is
logged when it does (docs/checkpoints.md, "What is safe").

A run directory holds one run: a new run (nothing to resume) on a directory that holds
another run's metrics writes to a fresh numbered folder beside it (``beside``), so
``meshfold plot`` and TensorBoard never draw two runs as one.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import socket
import sys
import time
from pathlib import Path

from meshfold.errors import ConfigError

RECORD = "run.json"
LOCK = ".lock"

# [train] keys whose change on resume is allowed and logged; the layout is [parallel] plus the world size.
RESUMABLE_TRAIN = ("lr", "min_lr_ratio", "warmup_steps", "steps", "global_batch", "micro_batch")
# [model] keys that name things rather than shape them.
MODEL_LABELS = ("preset",)


class RunDirError(RuntimeError):
    """A run directory that cannot be used (locked, unwritable, full): one line."""


def _log(message: str) -> None:
    print(f"meshfold: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- I/O failures


def describe_os_error(err: OSError, path: Path | str | None = None) -> str:
    """``PATH: cause`` for an OSError, with the cause a user acts on (no space left,
    read-only file system, not a directory, ...)."""
    where = err.filename or path or "?"
    cause = err.strerror or str(err)
    if err.errno == errno.EFBIG:
        cause += f" (the file size limit, ulimit -f, is {_fsize_limit()})"
    return f"{where}: {cause}"


def _fsize_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"


def explain_write_failure(path: Path, err: BaseException) -> str:
    """Why writing under ``path`` failed, as one line. torch's writer reports a failed write
    as a position mismatch (``inline_container.cc: unexpected pos``) without the errno: look
    at the file system (space left, file size limit) to name the real cause."""
    if isinstance(err, OSError) and err.errno is not None:
        return describe_os_error(err, path)
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"{path}: a write failed with the file size limit (ulimit -f) at {soft} bytes ({_short(err)})"
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    if free is not None and free < 64 << 20:
        return f"{path}: no space left on device ({free} bytes free; {_short(err)})"
    if not os.access(probe, os.W_OK):
        return f"{path}: not writable ({_short(err)})"
    return f"{path}: {_short(err)}"


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def prepare_run_dir(path: Path) -> Path:
    """Create ``path`` if needed and check that it is a writable folder; one line if not."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"train.run_dir = {str(path)!r} is a file, not a folder; choose another train.run_dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot create train.run_dir: {describe_os_error(err, path)}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunDirError(f"train.run_dir = {str(path)!r} is not writable (read-only or another user's); "
                          f"choose another train.run_dir")
    return path


def holds_a_run(path: Path) -> bool:
    """Whether ``path`` holds another run's metrics (its metrics.jsonl or TensorBoard events)."""
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    return any((path / "tensorboard").glob("events.out.tfevents.*"))


def beside(path: Path) -> Path:
    """The first free numbered folder next to ``path`` (``runs/debug-2``, ``-3``, ...),
    created here so that two runs starting at once never pick the same one."""
    n = 2
    while True:
        candidate = path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            n += 1
        except OSError as err:
            raise RunDirError(f"cannot create a new run directory beside {path}: {describe_os_error(err, candidate)}") \
                from None


# ---------------------------------------------------------------------------- the lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive lock on a run directory, held for the whole run by one process (rank 0).

    ``flock`` on ``RUN_DIR/.lock``: the kernel releases it when the holder dies, however it
    dies, so a lock left by a crashed run is stale by construction and is taken over (and
    said so). The file names the holder (host, PID, start time) for the refusal line. Where
    ``flock`` is not supported (some network file systems), the holder's PID is checked
    when it runs on this host."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None

    def holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        import fcntl

        previous = self.holder()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise RunDirError(f"cannot lock the run directory: {describe_os_error(err, self.path)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(self._refusal(previous)) from None
        except OSError:  # no flock here: trust a live holder on this host
            if previous and previous.get("host") == socket.gethostname() and _alive(int(previous.get("pid", 0))) \
                    and int(previous.get("pid", 0)) != os.getpid():
                os.close(fd)
                raise RunDirError(self._refusal(previous)) from None
        if previous.get("pid") and previous.get("pid") != os.getpid():
            _log(f"run directory {self.path.parent}: taking over a stale lock of "
                 f"{previous.get('host')}:{previous.get('pid')} (that run is gone)")
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        except OSError as err:
            os.close(fd)
            raise RunDirError(f"cannot lock the run directory: {describe_os_error(err, self.path)}") from None
        self.fd = fd

    def _refusal(self, holder: dict) -> str:
        who = f"{holder.get('host', '?')}:{holder.get('pid', '?')}"
        since = holder.get("since")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
        return (f"train.run_dir = {str(self.path.parent)!r} is in use by another run (process {who}{when}); "
                f"wait for it to finish, stop it, or choose another train.run_dir")

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            os.close(self.fd)  # closing releases the flock
            self.fd = None


# ---------------------------------------------------------------------------- what the run is


def run_record(cfg, data_identity: dict, world: int) -> dict:
    d = cfg.to_dict()
    return {"model": {k: v for k, v in d["model"].items() if k not in MODEL_LABELS},
            "data": data_identity,
            "train": {k: d["train"][k] for k in RESUMABLE_TRAIN},
            "parallel": d["parallel"], "world": world}


def read_record(run_dir: Path) -> dict | None:
    path = run_dir / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunDirError(f"{path} is unreadable ({err}); it records what this run is: restore it, or choose "
                          f"another train.run_dir") from None


def write_record(run_dir: Path, record: dict) -> None:
    path = run_dir / RECORD
    part = path.with_name(RECORD + ".part")
    try:
        part.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(part, path)
    except OSError as err:
        part.unlink(missing_ok=True) if part.parent.is_dir() else None
        raise RunDirError(f"cannot write the run record: {explain_write_failure(path, err)}") from None


def _differences(old: dict, new: dict, section: str) -> list[str]:
    return [f"{section}.{k} {old[k]!r} -> {new[k]!r}" for k in sorted(set(old) & set(new)) if old[k] != new[k]]


def check_resume(run_dir: Path, saved: dict, now: dict, newest: str | None) -> list[str]:
    """Refuse (``ConfigError``) a resume whose model shape or data differ from the run's
    record; return the allowed changes (to log)."""
    hard = _differences(saved.get("model", {}), now["model"], "model")
    hard += _differences(saved.get("data", {}), now["data"], "data")
    if hard:
        start = f"{run_dir}/checkpoints/{newest}" if newest else f"{run_dir}/checkpoints/step-N"
        raise ConfigError(
            f"train.run_dir = {str(run_dir)!r} holds a run of another model or data set ({'; '.join(hard)}); "
            f"resuming would mix them. Restore those settings to resume, or start a new run from its weights on "
            f"purpose: --set train.run_dir=NEW --set train.init_from={start} (nothing was changed)")
    soft = _differences(saved.get("train", {}), now["train"], "train")
    if saved.get("parallel") != now["parallel"] or saved.get("world") != now["world"]:
        soft.append(f"layout: {saved.get('world')} processes -> {now['world']} "
                    f"({', '.join(_differences(saved.get('parallel', {}), now['parallel'], 'parallel')) or 'same [parallel]'})")
    return soft
