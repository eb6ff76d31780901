"""The files of a checkpoint folder, and nothing about what the state means: publishing
a finished folder atomically (the manifest of sizes and SHA-256s, one ``rename``),
validating one before use, and DCP's reader and writer made safe (metadata as JSON, plain
values loaded weights-only: nothing a user hands in is unpickled). ``checkpoint.py`` says
what goes into a checkpoint and when."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from meshfold.train.renamed_keys import joined_shape, old_keys

# DCP warns on every save and load outside a process group that it assumes one process;
# a single-process run (and convert, btm) means exactly that: one line per checkpoint of noise.
warnings.filterwarnings("ignore", category=UserWarning,
                        message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the "
                                r"intent is to (save|load) in a single process")

MANIFEST = "meshfold.json"
DCP_JSON = "dcp_metadata.json"  # DCP's metadata as JSON: what loading reads (never the pickled .metadata)
HASHES = "_sha256.json"  # per-rank sidecar "__<rank>_sha256.json", merged into the manifest
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and what is wrong."""


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step-"):
        return None
    try:
        return int(name[5:])
    except ValueError:
        return None


def published(ckpt_root: Path) -> list[Path]:
    """Published checkpoint folders, newest first (no validation)."""
    if not ckpt_root.is_dir():
        return []
    found = [(step_of(p), p) for p in ckpt_root.iterdir() if p.is_dir() and step_of(p) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def validate_checkpoint(path: Path, expected_shapes: dict[str, tuple] | None = None,
                        share: tuple[int, int] = (0, 1)) -> dict:
    """The manifest of ``path`` if it is complete, intact and (given ``expected_shapes``,
    key -> global shape) fits this model; else ``CheckpointError`` saying what is wrong.
    ``share`` = (k, n): hash only every n-th file from the k-th (the ranks of a resume split
    the hashing between them); sizes are checked for every file."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{path}: no {MANIFEST} (partial or foreign checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: {MANIFEST} is unreadable ({err})") from None
    k, n = share
    for i, (name, info) in enumerate(sorted(files.items())):
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{path}: file {name} is missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: file {name} has {size} bytes, the manifest says {info['bytes']} "
                                  f"(truncated or overwritten)")
        if i % n == k and sha256_of(f) != info["sha256"]:
            raise CheckpointError(f"{path}: file {name} does not match its SHA-256 (corrupted bytes)")
    if expected_shapes:
        meta = read_dcp_metadata(path).state_dict_metadata
        for key, shape in expected_shapes.items():
            got = meta.get(key)
            found = old_keys(key, meta) if got is None else None
            if found is not None:  # saved before the tensor was joined from these (renamed_keys.py)
                joined = joined_shape(*found, meta)
                if joined is not None and joined == tuple(shape):
                    continue
                raise CheckpointError(
                    f"{path}: {key} is saved as {', '.join(found[0])}, which do not join into its shape "
                    f"{tuple(shape)}; check the [model] section against {path / MANIFEST}")
            if got is None:
                raise CheckpointError(f"{path}: has no tensor {key} (saved from a different model)")
            if isinstance(got, TensorStorageMetadata) and tuple(got.size) != tuple(shape):
                raise CheckpointError(
                    f"{path}: {key} has shape {tuple(got.size)} in the checkpoint but {tuple(shape)} in this "
                    f"model; check the [model] section against {path / MANIFEST}"
                )
    return manifest


# ---------------------------------------------------------------------------- no pickle
# DCP pickles its metadata (.metadata) and loads plain values with an unrestricted torch.load:
# a checkpoint someone hands us could run code. meshfold writes the metadata again as JSON
# and reads only that, and loads plain values with weights_only=True (tensors, numbers,
# strings, lists, dicts), so a tampered file is refused, never executed.

_LAYOUTS = {str(x): x for x in (torch.strided, torch.sparse_coo)}
_MEMORY = {str(x): x for x in (torch.contiguous_format, torch.channels_last, torch.preserve_format)}


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{DCP_JSON}: unknown dtype {name!r}")
    return value


def metadata_to_json(md: Metadata) -> dict:
    entries = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            p = m.properties
            entries[fqn] = {"tensor": {
                "dtype": str(p.dtype), "layout": str(p.layout), "requires_grad": p.requires_grad,
                "memory_format": str(p.memory_format), "pin_memory": p.pin_memory, "size": list(m.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}}
        else:
            entries[fqn] = {"bytes": {}}
    storage = [{"fqn": idx.fqn, "offset": None if idx.offset is None else list(idx.offset), "index": idx.index,
                "path": info.relative_path, "start": info.offset, "length": info.length,
                "transforms": None if info.transform_descriptors is None else list(info.transform_descriptors)}
               for idx, info in (md.storage_data or {}).items()]
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    return {"version": md.version, "state_dict_metadata": entries, "storage_data": storage,
            "planner_data": {k: list(v) for k, v in planner.items()}}


def metadata_from_json(data: dict) -> Metadata:
    entries = {}
    for fqn, e in data["state_dict_metadata"].items():
        if "tensor" in e:
            t = e["tensor"]
            props = TensorProperties(dtype=_dtype(t["dtype"]), layout=_LAYOUTS[t["layout"]],
                                     requires_grad=bool(t["requires_grad"]),
                                     memory_format=_MEMORY[t["memory_format"]], pin_memory=bool(t["pin_memory"]))
            entries[fqn] = TensorStorageMetadata(props, torch.Size(t["size"]),
                                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(z))
                                                  for o, z in t["chunks"]])
        else:
            entries[fqn] = BytesStorageMetadata()
    storage = {}
    for s in data["storage_data"]:
        idx = MetadataIndex(s["fqn"], None if s["offset"] is None else torch.Size(s["offset"]), s["index"])
        storage[idx] = _StorageInfo(str(s["path"]), int(s["start"]), int(s["length"]), s["transforms"])
    return Metadata(state_dict_metadata=entries, storage_data=storage, version=data.get("version"),
                    planner_data={k: tuple(v) for k, v in data.get("planner_data", {}).items()},
                    storage_meta=StorageMeta())


def read_dcp_metadata(path: Path) -> Metadata:
    f = Path(path) / DCP_JSON
    if not f.exists():
        raise CheckpointError(f"{path}: no {DCP_JSON} (saved by an older meshfold; its pickled .metadata is not "
                              f"read)")
    try:
        return metadata_from_json(json.loads(f.read_text()))
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: {DCP_JSON} is unreadable ({type(err).__name__}: {err})") from None


class SafeWriter(FileSystemWriter):
    """DCP's file writer, plus: each rank hashes the files it wrote, right after writing
    them (all ranks in parallel), into ``__<rank>_sha256.json``; the coordinator also
    writes the metadata as JSON."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        results = fut.wait()
        names = sorted({r.storage_data.relative_path for r in results})
        hashes = {n: {"bytes": (Path(self.path) / n).stat().st_size, "sha256": sha256_of(Path(self.path) / n)}
                  for n in names}
        prefix = plan.storage_data.prefix  # "__<rank>_"
        write_json(Path(self.path) / f"{prefix.rstrip('_')}{HASHES}", hashes)
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)
        write_json(Path(self.path) / DCP_JSON, metadata_to_json(metadata))


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        return read_dcp_metadata(Path(self.path))


class SafeLoadPlanner(DefaultLoadPlanner):
    """Plain values (counters, config, the sampler position) with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as err:  # noqa: BLE001 - anything not plain data is refused
            lines = [x.strip() for x in str(err).splitlines() if x.strip()] or [type(err).__name__]
            why = next((x for x in lines if "Unsupported global" in x), lines[0])[:120]
            raise CheckpointError(f"refusing {read_item.dest_index.fqn}: not plain data ({why}); the checkpoint "
                                  f"was tampered with or is foreign, nothing in it was run") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(sd: dict, path: Path, no_dist: bool = False) -> None:
    """``dcp.load`` through the JSON metadata and the weights-only planner; a refusal on
    any rank comes out as its one-line ``CheckpointError`` (DCP wraps it per rank)."""
    try:
        dcp.load(sd, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(), no_dist=no_dist)
    except dcp.CheckpointException as err:
        for failure in getattr(err, "failures", {}).values():
            failure = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(failure, CheckpointError):
                raise CheckpointError(f"{path}: {failure}") from None
        raise


def write_json(path: Path, data: dict) -> None:
    part = path.with_name(path.name + ".part")
    with part.open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(part, path)


def first_failure(err: BaseException) -> BaseException:
    """The lowest rank's underlying error of a DCP ``CheckpointException``, else ``err``."""
    failures = getattr(err, "failures", None)
    if failures:
        first = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))[1]
        return first[0] if isinstance(first, tuple) else first
    return err


def root_cause(err: BaseException) -> str:
    """The first rank's underlying error of a DCP ``CheckpointException`` (e.g. the
    OSError of a full disk), else the error itself, as one line."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, first = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        first = first[0] if isinstance(first, tuple) else first
        return f"rank {rank}: {type(first).__name__}: {str(first).splitlines()[0][:300]}"
    text = str(err).splitlines()[0][:300] if str(err) else ""
    return f"{type(err).__name__}: {text}"


def write_manifest(folder: Path, info: dict) -> None:
    """Write ``meshfold.json`` into a finished checkpoint folder: ``info`` plus the size and
    SHA-256 of every file, fsynced, through a rename (a reader sees all of it or nothing).
    The data files were hashed by the ranks that wrote them (``SafeWriter``): their
    sidecars are merged here and removed; only the few files with no sidecar entry (DCP's
    metadata) are hashed now."""
    files = {}
    sidecars = sorted(folder.glob(f"*{HASHES}"))
    for side in sidecars:
        files.update(json.loads(side.read_text()))
    for f in sorted(folder.iterdir()):
        if (f.is_file() and f.name != MANIFEST and f.name not in files and not f.name.endswith(".part")
                and f not in sidecars):
            files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_of(f)}
    files = dict(sorted(files.items()))
    manifest = {"format": FORMAT_VERSION, **info, "time": time.time(), "files": files}
    part = folder / (MANIFEST + ".part")
    with part.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(part, folder / MANIFEST)
    for side in sidecars:
        side.unlink()
    _fsync_dir(folder)


def publish(tmp: Path, final: Path) -> None:
    """Make a finished folder visible under its final name with one ``rename``; an
    existing folder of that name is moved aside first and removed after."""
    trash = None
    if final.exists():
        trash = final.parent / f".trash-{final.name}-{time.time_ns()}"
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
