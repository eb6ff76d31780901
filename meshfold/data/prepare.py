"""``meshfold prepare SOURCE... --tokenizer TOK --out DIR [--workers N]``: tokenise corpora
once into a prepared dataset (format: ``data/prepared.py``).

Streaming end to end: documents are read one at a time (``data/sources.py``), sent in
chunks to tokeniser worker processes (at most a few chunks in flight, so memory is flat
in corpus size), and written in order into shards of about ``--shard-tokens`` tokens.
Every finished shard is recorded in the manifest at once; an interrupted run is resumed
by running the same command again: finished shards are kept, reading restarts after the
last document they hold (each shard records where: file index, document index in it), and
the half-written shard (a temporary file) is redone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress, TextColumn, TimeElapsedColumn
from tokenizers import Tokenizer

from meshfold.errors import ConfigError
from meshfold.data.prepared import (DTYPES, FORMAT, MANIFEST, TOKENIZER, VERSION, ShardWriter, atomic_write_bytes,
                                    read_manifest, token_dtype, write_manifest)
from meshfold.data.sources import source_units, unit_digest, unit_docs
from meshfold.data.tokenizer import EOS, PAD, load_tokenizer, special_id, tokenizer_sha256

DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard
CHUNK_DOCS = 1024  # at most this many documents per task sent to a worker,
CHUNK_CHARS = 1 << 20  # and about this much text (tasks of similar cost, whatever the documents' sizes)

# --------------------------------------------------------------------------- workers

_TOK: Tokenizer | None = None
_EOS = 0
_DTYPE = "uint16"


def _init_worker(tok_json: str, eos: int, dtype: str) -> None:
    global _TOK, _EOS, _DTYPE
    _TOK, _EOS, _DTYPE = Tokenizer.from_str(tok_json), eos, dtype


def _encode(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of every document each followed by EOS, their lengths)."""
    encoded = _TOK.encode_batch(docs)  # as tokenize_corpus: the tokenizer's own specials (a BOS) kept
    lengths = np.fromiter((len(e.ids) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    out = np.empty(int(lengths.sum()), dtype=DTYPES[_DTYPE])
    pos = 0
    for e, n in zip(encoded, lengths.tolist()):
        out[pos: pos + n - 1] = e.ids
        out[pos + n - 1] = _EOS
        pos += n
    return out, lengths


def _chunks(docs: Iterable[tuple[tuple[int, int], str]], size: int,
            chars: int = CHUNK_CHARS) -> Iterator[tuple[list, list[str]]]:
    """(positions, texts) in chunks of at most ``size`` documents or about ``chars`` characters."""
    pos, texts, n = [], [], 0
    for p, d in docs:
        pos.append(p)
        texts.append(d)
        n += len(d)
        if len(texts) == size or n >= chars:
            yield pos, texts
            pos, texts, n = [], [], 0
    if texts:
        yield pos, texts


def _encoded_stream(chunks: Iterator[tuple[list, list[str]]], tok: Tokenizer, eos: int, dtype: str, workers: int):
    """(positions, tokens, lengths) per chunk, in input order; ``workers`` > 1 tokenises in
    that many processes with at most 2 chunks per worker in flight (back-pressure: flat
    memory). Only the texts travel to the workers."""
    if workers <= 1:
        _init_worker(tok.to_str(), eos, dtype)
        for pos, texts in chunks:
            yield (pos, *_encode(texts))
        return
    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process (inherited at spawn)
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok.to_str(), eos, dtype))
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    with pool:
        pending: deque = deque()
        for pos, texts in chunks:
            pending.append((pos, pool.apply_async(_encode, (texts,))))
            if len(pending) >= 2 * workers:
                pos0, res = pending.popleft()
                yield (pos0, *res.get())
        while pending:
            pos0, res = pending.popleft()
            yield (pos0, *res.get())


def _documents(units: list[Path], field: str, start: tuple[int, int]) -> Iterator[tuple[tuple[int, int], str]]:
    """((unit, index in unit), text) from position ``start`` on: files before it are not
    opened, documents before it in its file are read past."""
    for u in range(start[0], len(units)):
        skip = start[1] if u == start[0] else 0
        for k, doc in enumerate(islice(unit_docs(units[u], field), skip, None), skip):
            yield (u, k), doc


# --------------------------------------------------------------------------- driver


def _source_records(units: list[Path]) -> list[dict]:
    return [{"path": str(u), "bytes": sum(f.stat().st_size for f in u.rglob("*") if f.is_file()) if u.is_dir()
             else u.stat().st_size, "sha256": unit_digest(u)} for u in units]


def _start(out: Path, base: dict) -> dict:
    """A new manifest, or the one of an interrupted run of the same inputs to resume."""
    if (out / MANIFEST).is_file():
        m = read_manifest(out)
        same = all(m.get(k) == base[k] for k in ("tokenizer_sha256", "sources", "text_field", "dtype"))
        if not same:
            what = "finished" if m.get("complete") else "partly prepared"
            raise ConfigError(f"--out {out} holds a {what} dataset from other sources, tokenizer or text field; "
                              f"choose a new --out (nothing there was changed)")
        for stray in out.glob(".shard-*.tmp"):  # the shard an interruption cut short
            stray.unlink()
        return m
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not a prepared dataset; choose a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    return {**base, "shards": [], "tokens": 0, "docs": 0, "complete": False}


def prepare(sources: list[str], tokenizer: str | Tokenizer, out: str | Path, workers: int = 1,
            text_field: str = "text", shard_tokens: int = DEFAULT_SHARD_TOKENS, progress: bool = True,
            max_docs: int = 0, _stop_after_shards: int = 0) -> dict:
    """Prepare ``sources`` into ``out``; returns the manifest. Running it again on a
    finished folder does nothing; on an interrupted one, it resumes."""
    if not sources:
        raise ConfigError("give at least one SOURCE (a text file, folder, .jsonl, .parquet or saved HF dataset)")
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size()
    eos, pad = special_id(tok, EOS), special_id(tok, PAD)
    dtype = token_dtype(vocab)
    units = [u for s in sources for u in source_units(s)]
    out = Path(out).expanduser()
    base = {"format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": vocab, "eos_id": eos,
            "pad_id": pad, "tokenizer_sha256": tokenizer_sha256(tok), "text_field": text_field,
            "max_docs": max_docs, "sources": _source_records(units)}
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder")
    created = not out.exists() or not any(out.iterdir())  # this call makes the folder: it undoes it on failure
    m = _start(out, base)
    if m["complete"]:
        return m
    try:
        return _prepare_into(out, m, tok, units, text_field, eos, dtype, workers, shard_tokens, progress, max_docs,
                             sources, _stop_after_shards)
    except Exception:  # bad input, a full disk: no half --out that the next run would refuse
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _prepare_into(out: Path, m: dict, tok: Tokenizer, units: list[Path], text_field: str, eos: int, dtype: str,
                  workers: int, shard_tokens: int, progress: bool, max_docs: int, sources: list[str],
                  _stop_after_shards: int) -> dict:
    atomic_write_bytes(out / TOKENIZER, tok.to_str().encode())
    write_manifest(out, m)

    # Resume after the last finished shard's last document (not read again, not tokenised).
    start = tuple(m["shards"][-1]["next"]) if m["shards"] else (0, 0)
    docs = _documents(units, text_field, start)
    if max_docs:
        docs = islice(docs, max(max_docs - m["docs"], 0))

    bar = _Progress(out.name, m["tokens"], m["docs"]) if progress else None
    writer = None
    try:
        for pos, tokens, lengths in _encoded_stream(_chunks(docs, CHUNK_DOCS), tok, eos, dtype, workers):
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            first = 0
            while first < len(lengths):  # documents whole; a shard closes once it holds shard_tokens
                if writer is None:
                    writer = ShardWriter(out, f"shard-{len(m['shards']):05d}", dtype)
                room = shard_tokens - writer.tokens
                last = min(int(np.searchsorted(bounds, bounds[first] + room, side="left")), len(lengths))
                last = max(last, first + 1)
                writer.add([tokens[bounds[i]: bounds[i + 1]] for i in range(first, last)])
                first = last
                nxt = [pos[last - 1][0], pos[last - 1][1] + 1]  # where the next shard's documents start
                if writer.tokens >= shard_tokens:
                    _publish(out, m, {**writer.finish(), "next": nxt})
                    writer = None
                    if _stop_after_shards and len(m["shards"]) >= _stop_after_shards:  # tests: an interruption
                        return m
            if bar is not None:
                bar.update(len(tokens), len(lengths))
        if writer is not None and writer.docs:
            _publish(out, m, {**writer.finish(), "next": nxt})
            writer = None
    finally:
        if writer is not None:
            writer.abandon()
        if bar is not None:
            bar.close()
    if m["docs"] == 0:
        raise ConfigError(f"the sources {sources} hold no non-empty documents (text field {text_field!r})")
    m["complete"] = True
    write_manifest(out, m)
    return m


class _Progress:
    """One live line on stderr (a terminal, or MESHFOLD_PROGRESS=1): tokens, documents, tokens/s."""

    def __init__(self, name: str, tokens: int, docs: int):
        console = Console(file=sys.stderr)
        self.bar = Progress(TextColumn(f"[bold]prepare[/] {name}"), TextColumn("{task.fields[info]}"),
                            TimeElapsedColumn(), console=console,
                            disable=not console.is_terminal and not os.environ.get("MESHFOLD_PROGRESS"))
        self.tokens, self.docs, self.new, self.start = tokens, docs, 0, time.perf_counter()
        self.task = self.bar.add_task("prepare", total=None, info="")
        self.bar.start()

    def update(self, tokens: int, docs: int) -> None:
        self.tokens, self.docs, self.new = self.tokens + tokens, self.docs + docs, self.new + tokens
        rate = self.new / max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(self.task, info=f"{self.tokens / 1e6:,.2f}M tokens  {self.docs:,} docs  "
                                        f"{rate / 1e6:,.2f}M tokens/s")

    def close(self) -> None:
        self.bar.stop()


def _publish(out: Path, m: dict, shard: dict) -> None:
    m["shards"].append(shard)
    m["tokens"] += shard["tokens"]
    m["docs"] += shard["docs"]
    write_manifest(out, m)


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="tokenise corpora once into a sharded, memory-mapped dataset")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="text file or folder, .jsonl, .parquet, or a Hugging Face dataset saved to disk")
    p.add_argument("--tokenizer", required=True, metavar="TOK",
                   help="a tokenizer.json, or a model directory holding one")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (resumed if interrupted)")
    p.add_argument("--workers", type=int, default=1, help="tokeniser processes (default 1)")
    p.add_argument("--text-field", default="text", help="JSONL field / column holding the text (default text)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    p.add_argument("--max-docs", type=int, default=0, help="stop after this many documents (0 = all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    start = time.perf_counter()
    m = prepare(args.sources, args.tokenizer, args.out, args.workers, args.text_field, args.shard_tokens,
                progress=not args.quiet, max_docs=args.max_docs)
    secs = time.perf_counter() - start
    print(f"meshfold: prepared {m['docs']} documents, {m['tokens']} tokens ({m['dtype']}) in "
          f"{len(m['shards'])} shard(s) at {args.out} ({secs:.1f} s); train with --set data.source={args.out}")
    return 0
