"""The prepared-dataset format: tokenised documents in memory-mappable shards.

A prepared dataset is a folder (written by ``meshfold prepare``; any tool may write it)::

    manifest.json      what is there (below); written last, atomically
    tokenizer.json     the Hugging Face ``tokenizers`` file the tokens come from
    shard-00000.bin    tokens, little-endian uint16 (vocabulary <= 65536) or uint32:
                       documents back to back, each ending with the EOS token
    shard-00000.idx    little-endian int64, docs + 1 document offsets into the shard's
                       tokens: document d is tokens[idx[d]:idx[d+1]]; idx[0] = 0 and
                       idx[-1] = the shard's token count
    shard-00001.bin ...

``manifest.json``: ``{"format": "meshfold-prepared", "version": 1, "dtype": "uint16",
"vocab_size", "eos_id", "pad_id", "tokenizer_sha256" (sha256 of tokenizer.json's bytes),
"tokens", "docs", "complete" (false while ``prepare`` is still running), "shards": [{"name",
"tokens", "docs", "sha256" (of the .bin), "next" (writers' resume point: [source file
index, document index in it] after the shard's last document)}], "sources": [{"path", "bytes", "sha256"}],
"text_field"}``. Only shards listed in the manifest exist for readers; a shard is written
under a temporary name and renamed into place when whole, so an interrupted writer never
leaves a partial shard a reader could take.

Reading costs O(shards) memory and time: every file is memory-mapped, sizes and the
offsets' end points are checked, nothing is read whole (``verify`` hashes everything).
Training checks every shard's SHA-256 and token ids once (``verify_shards``): in full
before the first step when the data set is small, else on a background thread (each
process its share) while training runs, the trainer stopping with the finding's line.
A verified shard leaves a stamp (its path, size, mtime, inode and hash) in the cache, so
later runs only re-check shards that changed.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshfold.errors import ConfigError

FORMAT = "meshfold-prepared"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
OFFSET_DTYPE = np.dtype("<i8")
SYNC_VERIFY_BYTES = 256 << 20  # data sets up to this size are verified before the first step
_VERIFY_ERRORS: dict[str, str] = {}  # folder -> what a background verifier found (the trainer raises it)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_prepared(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_manifest(folder: Path, manifest: dict) -> None:
    atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(folder: str | Path) -> dict:
    folder = Path(folder).expanduser()
    path = folder / MANIFEST
    if not path.is_file():
        raise ConfigError(f"{folder} is not a prepared dataset (no {MANIFEST}); make one with `meshfold prepare`")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg}); re-run `meshfold prepare` into a new folder") from None
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise ConfigError(f"{path}: format {m.get('format')!r} version {m.get('version')!r}; this meshfold reads "
                          f"{FORMAT!r} version {VERSION}")
    return m


class ShardWriter:
    """Writes one shard under temporary names; ``finish`` renames it into place."""

    def __init__(self, folder: Path, name: str, dtype: str):
        self.folder, self.name, self.dtype = folder, name, DTYPES[dtype]
        self.tmp_bin = folder / f".{name}.bin.tmp"
        self.fh = self.tmp_bin.open("wb")
        self.hash = hashlib.sha256()
        self.offsets = [0]

    @property
    def tokens(self) -> int:
        return self.offsets[-1]

    @property
    def docs(self) -> int:
        return len(self.offsets) - 1

    def add(self, docs: list[np.ndarray]) -> None:
        """Documents, each already ending with EOS."""
        for d in docs:
            self.offsets.append(self.offsets[-1] + len(d))
        data = np.concatenate(docs).astype(self.dtype).tobytes() if docs else b""
        self.fh.write(data)
        self.hash.update(data)

    def finish(self) -> dict:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        atomic_write_bytes(self.folder / f"{self.name}.idx", np.asarray(self.offsets, dtype=OFFSET_DTYPE).tobytes())
        os.replace(self.tmp_bin, self.folder / f"{self.name}.bin")
        return {"name": self.name, "tokens": self.tokens, "docs": self.docs, "sha256": self.hash.hexdigest()}

    def abandon(self) -> None:
        self.fh.close()
        self.tmp_bin.unlink(missing_ok=True)


@dataclass
class Shard:
    tokens: np.ndarray  # memmap (or array), one entry per token
    offsets: np.ndarray  # memmap (or array), docs + 1 entries


def _random_access(arr: np.memmap) -> np.memmap:
    """Training reads short windows at random places: tell the kernel not to read ahead
    (a fault would otherwise pull in up to megabytes around each window)."""
    mm = getattr(arr, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return arr


def open_shards(folder: str | Path, manifest: dict | None = None, verify: bool = False) -> list[Shard]:
    """Memory-map every shard of a prepared dataset, checking sizes and offsets' end points
    (``verify``: also every shard's sha256). A problem is one line naming the file."""
    folder = Path(folder).expanduser()
    m = manifest or read_manifest(folder)
    if not m.get("complete", False):
        raise ConfigError(f"{folder}: `meshfold prepare` has not finished here; run it again to complete it")
    dtype = DTYPES.get(m.get("dtype"))
    if dtype is None:
        raise ConfigError(f"{folder / MANIFEST}: dtype {m.get('dtype')!r}; expected one of {sorted(DTYPES)}")
    shards = []
    for s in m["shards"]:
        bin_path, idx_path = folder / f"{s['name']}.bin", folder / f"{s['name']}.idx"
        for path, want in ((bin_path, s["tokens"] * dtype.itemsize), (idx_path, (s["docs"] + 1) * 8)):
            if not path.is_file():
                raise ConfigError(f"{path} is missing; the dataset is damaged: re-run `meshfold prepare`")
            size = path.stat().st_size
            if size != want:
                raise ConfigError(f"{path} has {size} bytes but the manifest says {want}: the shard is truncated "
                                  f"or corrupt; re-run `meshfold prepare` into a new folder")
        if s["tokens"] == 0:
            continue
        tokens = _random_access(np.memmap(bin_path, dtype=dtype, mode="r"))
        offsets = _random_access(np.memmap(idx_path, dtype=OFFSET_DTYPE, mode="r"))
        if offsets[0] != 0 or offsets[-1] != s["tokens"] or tokens[-1] != m["eos_id"]:
            raise ConfigError(f"{idx_path}: document offsets do not match {bin_path.name}: the shard is corrupt; "
                              f"re-run `meshfold prepare` into a new folder")
        if verify:
            if file_sha256(bin_path) != s["sha256"]:
                raise ConfigError(f"{bin_path}: sha256 differs from the manifest: the shard is corrupt")
            if np.any(np.diff(offsets) <= 0):
                raise ConfigError(f"{idx_path}: document offsets are not increasing: the shard is corrupt")
        shards.append(Shard(tokens, offsets))
    if not shards:
        raise ConfigError(f"{folder}: the prepared dataset holds no tokens")
    return shards


# ---------------------------------------------------------------------------- verification at train time


def _verify_one(bin_path: Path, s: dict, dtype: np.dtype, vocab: int) -> str | None:
    """One pass over a shard: its SHA-256 against the manifest and its largest token id
    against the vocabulary; the problem as one line, or None."""
    h, top = hashlib.sha256(), -1
    with bin_path.open("rb") as fh:
        while chunk := fh.read(1 << 22):  # a multiple of both token sizes
            h.update(chunk)
            top = max(top, int(np.frombuffer(chunk, dtype=dtype).max()))
    if h.hexdigest() != s["sha256"]:
        return (f"{bin_path}: sha256 differs from the manifest: the shard changed after `meshfold prepare` "
                f"(corrupt bytes); re-run `meshfold prepare` into a new folder")
    if top >= vocab:
        return (f"{bin_path}: token id {top} is outside the vocabulary ({vocab} ids in {bin_path.parent / MANIFEST}): "
                f"the shard is corrupt or was written with another tokenizer; re-run `meshfold prepare`")
    return None


def verify_shards(folder: str | Path, m: dict, stamp_dir: Path | None = None, rank: int = 0,
                  world: int = 1) -> None:
    """Check every shard's bytes (SHA-256) and token ids (below the vocabulary) once. Shards
    with a stamp in ``stamp_dir`` (verified before, unchanged since) are skipped. Up to
    ``SYNC_VERIFY_BYTES`` in all: now, raising the first problem; more: on a background
    thread, this process taking every ``world``-th shard from the ``rank``-th, findings kept
    for ``check_verified``."""
    folder = Path(folder).expanduser()
    dtype, vocab = DTYPES[m["dtype"]], int(m["vocab_size"])
    _VERIFY_ERRORS.pop(str(folder), None)
    todo, size = [], 0
    for s in m["shards"]:
        if not s["tokens"]:
            continue
        path = folder / f"{s['name']}.bin"
        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{s['sha256']}:{vocab}"
                             .encode()).hexdigest()[:32]
        stamp = stamp_dir / key if stamp_dir is not None else None
        if stamp is not None and stamp.exists():
            continue
        todo.append((path, s, stamp))
        size += st.st_size

    def run(items) -> str | None:
        for path, s, stamp in items:
            problem = _verify_one(path, s, dtype, vocab)
            if problem:
                _VERIFY_ERRORS[str(folder)] = problem
                return problem
            if stamp is not None:
                try:
                    stamp.parent.mkdir(parents=True, exist_ok=True)
                    stamp.touch()
                except OSError:
                    pass  # an unwritable cache only costs a re-check next time

    if size <= SYNC_VERIFY_BYTES:
        problem = run(todo)
        if problem:
            _VERIFY_ERRORS.pop(str(folder), None)
            raise ConfigError(problem)
    elif todo[rank::world]:
        threading.Thread(target=run, args=(todo[rank::world],), daemon=True, name="meshfold-verify").start()


def check_verified() -> None:
    """Raise the first problem a shard verification found (one line naming the file)."""
    if _VERIFY_ERRORS:
        raise ConfigError(next(iter(_VERIFY_ERRORS.values())))
