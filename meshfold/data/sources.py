"""Document sources: plain text files or folders, JSONL, Parquet, Hugging Face datasets saved
to disk, and a default corpus that exists on every machine (this Python's standard library).

Every source yields documents in a fixed order, so the same seed gives the same data on any
machine with the same files."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from meshfold.config import ConfigError, DataConfig

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text", ""}


def default_corpus_files() -> list[Path]:
    """The top-level modules of the running Python's standard library (~4.7 MB on 3.11)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _jsonl_docs(path: Path, field: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if field not in record:
                raise ConfigError(
                    f"{path}:{lineno}: no field {field!r}; set data.text_field to one of {sorted(record)}"
                )
            docs.append(str(record[field]))
    return docs


def _parquet_docs(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise ConfigError("reading Parquet needs pyarrow: pip install 'meshfold[data]'") from None
    table = pq.read_table(path)
    if field not in table.column_names:
        raise ConfigError(f"{path}: no column {field!r}; set data.text_field to one of {table.column_names}")
    return [str(t) for t in table.column(field).to_pylist()]


def _is_hf_dataset_dir(path: Path) -> bool:
    return (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()


def _hf_docs(path: Path, field: str) -> list[str]:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        raise ConfigError("reading a saved Hugging Face dataset needs `datasets`: pip install 'meshfold[data]'") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else sorted(ds)[0]
        ds = ds[split]
    if field not in ds.column_names:
        raise ConfigError(f"{path}: no column {field!r}; set data.text_field to one of {ds.column_names}")
    return [str(t) for t in ds[field]]


def _file_docs(path: Path, field: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_docs(path, field)
    if suffix == ".parquet":
        return _parquet_docs(path, field)
    return [_read_text(path)]


def load_documents(cfg: DataConfig) -> list[str]:
    """All documents of ``data.source`` in a deterministic order (empty ones dropped)."""
    if cfg.source == "default":
        docs = [_read_text(p) for p in default_corpus_files()]
    else:
        path = Path(cfg.source).expanduser()
        if not path.exists():
            raise ConfigError(f"data.source = {cfg.source!r} does not exist; give a file, a folder or 'default'")
        if path.is_dir() and _is_hf_dataset_dir(path):
            docs = _hf_docs(path, cfg.text_field)
        elif path.is_dir():
            docs = []
            for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
                if file.suffix.lower() in TEXT_SUFFIXES | {".jsonl", ".parquet"}:
                    docs.extend(_file_docs(file, cfg.text_field))
        else:
            docs = _file_docs(path, cfg.text_field)
    docs = [d for d in docs if d.strip()]
    if cfg.max_docs:
        docs = docs[: cfg.max_docs]
    if not docs:
        raise ConfigError(f"data.source = {cfg.source!r} holds no non-empty documents")
    return docs
