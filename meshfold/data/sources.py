"""Document sources: plain text files or folders, JSONL, Parquet, Hugging Face datasets saved
to disk, and a default corpus that exists on every machine (this Python's standard library).

Every source yields documents in a fixed order, so the same seed gives the same data on any
machine with the same files. Reading streams (one JSONL line, one Parquet row group, one
slice of a saved dataset at a time): ``meshfold prepare`` never holds a corpus in memory.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from meshfold.data.config import DataConfig
from meshfold.errors import ConfigError

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text", ""}


def default_corpus_files() -> list[Path]:
    """The top-level modules of the running Python's standard library (~4.7 MB on 3.11)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def _not_text(path: Path, err: UnicodeDecodeError, where: str = "") -> ConfigError:
    return ConfigError(f"{path}{where}: not UTF-8 text (byte {err.start}: {err.reason}); a binary file or another "
                       f"encoding: convert it to UTF-8 or leave it out of the source")


def _read_text(path: Path) -> str:
    """A text document, decoded strictly: a binary file or another encoding is refused
    rather than trained on as replacement characters."""
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise ConfigError(f"{path}: a binary file (NUL bytes), not text; leave it out of the source")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_text(path, err) from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_text(path, err, f":{lineno}") from None


def _jsonl_docs(path: Path, field: str) -> Iterator[str]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{lineno}: not valid JSON ({err.msg}); fix or remove that line") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{lineno}: a JSON {type(record).__name__}, expected an object "
                              f"with a {field!r} field")
        if field not in record:
            raise ConfigError(
                f"{path}:{lineno}: no field {field!r}; set data.text_field (or --text-field) "
                f"to one of {sorted(record)}"
            )
        if not isinstance(record[field], str):
            raise ConfigError(f"{path}:{lineno}: field {field!r} is a {type(record[field]).__name__}, "
                              f"not text; choose a text field with data.text_field (or --text-field)")
        yield record[field]


def _parquet_docs(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise ConfigError("reading Parquet needs pyarrow: pip install 'meshfold[data]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise ConfigError(f"{path}: not a readable Parquet file ({err})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ConfigError(f"{path}: no column {field!r}; set data.text_field (or --text-field) to one of {names}")
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            yield "" if text is None else str(text)


def _is_hf_dataset_dir(path: Path) -> bool:
    return (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()


def _hf_docs(path: Path, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        raise ConfigError("reading a saved Hugging Face dataset needs `datasets`: pip install 'meshfold[data]'") from None
    ds = datasets.load_from_disk(str(path))  # memory-mapped Arrow files, not loaded
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else sorted(ds)[0]
        ds = ds[split]
    if field not in ds.column_names:
        raise ConfigError(f"{path}: no column {field!r}; set data.text_field (or --text-field) to one of "
                          f"{ds.column_names}")
    for start in range(0, len(ds), 1024):
        for text in ds[start: start + 1024][field]:
            yield "" if text is None else str(text)


def _file_docs(path: Path, field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_docs(path, field)
    elif suffix == ".parquet":
        yield from _parquet_docs(path, field)
    else:
        yield _read_text(path)


def source_units(source: str) -> list[Path]:
    """The files (or saved-dataset folders) of one source, in reading order."""
    if source == "default":
        return default_corpus_files()
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"source {source!r} does not exist; give a file, a folder or 'default'")
    if path.is_dir() and _is_hf_dataset_dir(path):
        return [path]
    if path.is_dir():
        return [p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".")
                and p.suffix.lower() in TEXT_SUFFIXES | {".jsonl", ".parquet"}
                and not any(q.name.startswith(".") for q in p.relative_to(path).parents if q.name)]
    return [path]


def unit_docs(unit: Path, field: str) -> Iterator[str]:
    """Non-empty documents of one file or saved dataset."""
    docs = _hf_docs(unit, field) if unit.is_dir() else _file_docs(unit, field)
    return (d for d in docs if d.strip())


def unit_digest(unit: Path) -> str:
    """sha256 of a file's bytes (of every file, in order, for a saved-dataset folder), streamed."""
    h = hashlib.sha256()
    files = sorted(p for p in unit.rglob("*") if p.is_file()) if unit.is_dir() else [unit]
    for f in files:
        h.update(str(f.relative_to(unit) if unit.is_dir() else f.name).encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def iter_documents(source: str, field: str = "text") -> Iterator[str]:
    for unit in source_units(source):
        yield from unit_docs(unit, field)


def load_documents(cfg: DataConfig) -> list[str]:
    """All documents of ``data.source`` in a deterministic order (empty ones dropped), in
    memory: for the small corpora whose tokenizer is trained on the fly."""
    if cfg.source != "default" and not Path(cfg.source).expanduser().exists():
        raise ConfigError(f"data.source = {cfg.source!r} does not exist; give a file, a folder or 'default'")
    docs = []
    for doc in iter_documents(cfg.source, cfg.text_field):
        docs.append(doc)
        if cfg.max_docs and len(docs) >= cfg.max_docs:
            break
    if not docs:
        raise ConfigError(f"data.source = {cfg.source!r} holds no non-empty documents")
    return docs
