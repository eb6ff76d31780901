"""Tokenised corpora packed into fixed-length sequences, and a seeded, resumable sampler
that gives every data-parallel layout the same global batches.

A corpus is a stream of documents (each ending in EOS) over shards: in memory, or memory
maps of a prepared dataset (``data/prepared.py``, written by ``meshfold prepare``). Every
source goes through the prepared path: a raw ``data.source`` (and the default corpus) is
prepared into the cache on first use. Packing keeps document boundaries: ``doc_ids`` gives
every token its document, computed per window from the offsets (never a per-token array),
so attention can be masked per document and balancers can see lengths.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from meshfold.data.config import DataConfig
from meshfold.errors import ConfigError
from meshfold.data.prepare import prepare
from meshfold.data.prepared import (MANIFEST, TOKENIZER, Shard, is_prepared, open_shards, read_manifest,
                                    verify_shards)
from meshfold.data.mixture import MixtureDataset
from meshfold.data.sources import load_documents
from meshfold.data.tokenizer import (EOS, PAD, cache_root, check_vocab, corpus_digest, get_tokenizer, load_tokenizer,
                                     special_id, tokenizer_sha256)

IGNORE_INDEX = -100


class Corpus:
    """Documents back to back (each ending in EOS) over one or more shards: numpy arrays
    in memory, or memory maps of a prepared dataset (``data/prepared.py``).

    Seen as one token stream; a view (``subset``) covers a range of documents. Document
    boundaries come from the shards' offsets by binary search, so memory is O(shards),
    never per token (``offsets``/``doc_lengths`` materialise O(docs) for the balancer)."""

    def __init__(self, shards: list[Shard], eos_id: int, pad_id: int, docs: range | None = None):
        self.shards, self.eos_id, self.pad_id = shards, eos_id, pad_id
        self._tok_start = np.zeros(len(shards) + 1, dtype=np.int64)  # global token start of each shard
        self._doc_start = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum([int(s.offsets[-1]) for s in shards], out=self._tok_start[1:])
        np.cumsum([len(s.offsets) - 1 for s in shards], out=self._doc_start[1:])
        self.docs = docs if docs is not None else range(int(self._doc_start[-1]))
        self._t0 = self._doc_offset(self.docs.start)
        self._t1 = self._doc_offset(self.docs.stop)
        self._offsets: np.ndarray | None = None

    # -- global positions (whole stream) -------------------------------------------------------
    def _doc_offset(self, d: int) -> int:
        """Token position where global document ``d`` starts (``d`` = n: the end)."""
        if d >= self._doc_start[-1]:
            return int(self._tok_start[-1])
        s = int(np.searchsorted(self._doc_start, d, side="right")) - 1
        return int(self._tok_start[s] + self.shards[s].offsets[d - self._doc_start[s]])

    def _pieces(self, start: int, stop: int):
        """(shard, local start, local stop, global start) for the global token range."""
        s = int(np.searchsorted(self._tok_start, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self._tok_start[s + 1]))
            base = int(self._tok_start[s])
            yield s, start - base, end - base, start
            start, s = end, s + 1

    # -- this view ---------------------------------------------------------------------------
    @property
    def n_docs(self) -> int:
        return len(self.docs)

    @property
    def n_tokens(self) -> int:
        return self._t1 - self._t0

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of this view as int64."""
        parts = [self.shards[s].tokens[a:b] for s, a, b, _ in self._pieces(self._t0 + start, self._t0 + stop)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def doc_ids(self, start: int, stop: int) -> np.ndarray:
        """The document (index within this view) of every token in [start, stop), from the
        offsets of the few documents the range touches."""
        out = []
        for s, a, b, _ in self._pieces(self._t0 + start, self._t0 + stop):
            offs = self.shards[s].offsets
            first = int(np.searchsorted(offs, a, side="right")) - 1
            last = int(np.searchsorted(offs, b, side="left"))  # first boundary >= b
            bounds = np.clip(np.asarray(offs[first: last + 1], dtype=np.int64), a, b)
            ids = np.arange(first, first + len(bounds) - 1, dtype=np.int64) + self._doc_start[s] - self.docs.start
            out.append(np.repeat(ids, np.diff(bounds)))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def doc(self, d: int) -> np.ndarray:
        g = self.docs.start + d
        return self.read(self._doc_offset(g) - self._t0, self._doc_offset(g + 1) - self._t0)

    def subset(self, docs: range) -> "Corpus":
        return Corpus(self.shards, self.eos_id, self.pad_id,
                      range(self.docs.start + docs.start, self.docs.start + docs.stop))

    @property
    def offsets(self) -> np.ndarray:
        """Every document's start in this view (O(docs) memory; built once, on demand)."""
        if self._offsets is None:
            parts = [np.asarray(s.offsets[:-1], dtype=np.int64) + self._tok_start[i] for i, s in enumerate(self.shards)]
            everything = np.concatenate(parts + [self._tok_start[-1:]])
            self._offsets = everything[self.docs.start: self.docs.stop + 1] - self._t0
        return self._offsets

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def tokens(self) -> "TokenView":
        return TokenView(self)


class TokenView:
    """``corpus.tokens[a:b]`` without loading the corpus."""

    def __init__(self, corpus: Corpus):
        self.corpus = corpus

    def __len__(self) -> int:
        return self.corpus.n_tokens

    def __getitem__(self, sl: slice) -> np.ndarray:
        start, stop, step = sl.indices(len(self))
        return self.corpus.read(start, stop)[::step]


def TokenizedCorpus(tokens: np.ndarray, offsets: np.ndarray, eos_id: int, pad_id: int) -> Corpus:
    """An in-memory corpus: ``tokens`` of all documents, document d = tokens[offsets[d]:offsets[d+1]]."""
    return Corpus([Shard(np.asarray(tokens), np.asarray(offsets, dtype=np.int64))], eos_id, pad_id)


def tokenize_corpus(docs: list[str], tok: Tokenizer, cache_dir: str = "") -> TokenizedCorpus:
    eos, pad = special_id(tok, EOS), special_id(tok, PAD)
    key = hashlib.sha256(f"{corpus_digest(docs)}:{tok.to_str()}".encode()).hexdigest()[:16]
    cached = cache_root(cache_dir) / f"tokens-{key}.npz"
    if cached.exists():
        with np.load(cached) as z:
            return TokenizedCorpus(z["tokens"], z["offsets"], eos, pad)
    encoded = tok.encode_batch(docs)
    pieces = [np.asarray(e.ids + [eos], dtype=np.int32) for e in encoded]
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in pieces], out=offsets[1:])
    tokens = np.concatenate(pieces)
    tmp = cached.with_name(f".{cached.stem}.tmp{os.getpid()}.npz")
    np.savez(tmp, tokens=tokens, offsets=offsets)
    os.replace(tmp, cached)
    return TokenizedCorpus(tokens, offsets, eos, pad)


class SequenceDataset:
    """Fixed-length training sequences of ``seq_len + 1`` tokens (inputs and shifted labels).

    ``pack=True``: documents are concatenated (each ending in EOS) and cut into windows that
    overlap by one token, so no token is wasted; ``doc_ids`` records each token's document.
    ``pack=False``: one sequence per document, truncated or padded; padded labels are ignored.
    """

    def __init__(self, corpus: Corpus, seq_len: int, pack: bool = True, name: str = "data"):
        self.corpus, self.seq_len, self.pack, self.name = corpus, seq_len, pack, name
        if pack:
            self.n = (corpus.n_tokens - 1) // seq_len
        else:
            self.docs = np.flatnonzero(corpus.doc_lengths() >= 2)
            self.n = len(self.docs)
        if self.n == 0:
            raise ConfigError(
                f"the corpus ({corpus.n_tokens} tokens) is too small for one sequence of model.seq_len = "
                f"{seq_len}; use a larger data.source or a shorter seq_len"
            )

    def __len__(self) -> int:
        return self.n

    def get(self, idx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens[S+1], doc_ids[S+1], valid[S+1]) for sequence ``idx``."""
        S = self.seq_len
        if self.pack:
            a, b = idx * S, idx * S + S + 1
            return self.corpus.read(a, b), self.corpus.doc_ids(a, b), np.ones(S + 1, dtype=bool)
        d = int(self.docs[idx])
        doc = self.corpus.doc(d)[: S + 1]
        tokens = np.full(S + 1, self.corpus.pad_id, dtype=np.int64)
        tokens[: len(doc)] = doc
        valid = np.zeros(S + 1, dtype=bool)
        valid[: len(doc)] = True
        return tokens, np.full(S + 1, d, dtype=np.int64), valid

    def batch(self, indices) -> dict[str, torch.Tensor]:
        return collate([self.get(int(i)) for i in indices])


def collate(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    tokens = torch.from_numpy(np.stack([r[0] for r in rows]).astype(np.int64))
    doc_ids = torch.from_numpy(np.stack([r[1] for r in rows]).astype(np.int64))
    valid = torch.from_numpy(np.stack([r[2] for r in rows]))
    labels = tokens[:, 1:].clone()
    labels[~valid[:, 1:]] = IGNORE_INDEX
    return {"inputs": tokens[:, :-1], "labels": labels, "doc_ids": doc_ids[:, :-1]}


class GlobalBatchSampler:
    """Seeded epochs of sequence indices, cut into global batches.

    The global batch of a step depends only on (seed, step), never on the layout; each
    data-parallel rank takes its contiguous slice. Resumable through ``state_dict``.
    A trailing partial batch of an epoch is dropped (the next epoch reshuffles)."""

    def __init__(self, n: int, global_batch: int, seed: int):
        if global_batch > n:
            raise ConfigError(
                f"train.global_batch = {global_batch} is more than the {n} sequences in the corpus; "
                f"lower the batch or use more data"
            )
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.epoch, self.cursor = 0, 0
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, permutation): kept across state reloads

    def _permutation(self) -> torch.Tensor:
        if self._perm is None or self._perm[0] != self.epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = (self.epoch, torch.randperm(self.n, generator=gen))
        return self._perm[1]

    def next(self) -> torch.Tensor:
        if self.cursor + self.global_batch > self.n:
            self.epoch, self.cursor = self.epoch + 1, 0
        out = self._permutation()[self.cursor: self.cursor + self.global_batch]
        self.cursor += self.global_batch
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "n": self.n, "global_batch": self.global_batch,
                "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n", self.n) != self.n:
            raise ConfigError(
                f"the checkpoint's data loader saw {state['n']} sequences but this corpus has {self.n}; "
                f"resume with the same data.source, model.seq_len and tokenizer"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def rank_slice(global_indices: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    local = len(global_indices) // dp_size
    return global_indices[dp_rank * local: (dp_rank + 1) * local]


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: SequenceDataset  # or a MixtureDataset (data/mixture.py)
    val: SequenceDataset | None


def prepared_corpus(folder: str | Path, tok: Tokenizer | None, vocab_size: int,
                    stamp_dir: Path | None = None) -> tuple[Corpus, Tokenizer]:
    """Open a prepared dataset (memory maps), checking it against the tokenizer given
    (``data.tokenizer``; else its own ``tokenizer.json``) and the model's vocabulary, and
    its shards' bytes and token ids (``verify_shards``: once per shard and change)."""
    folder = Path(folder).expanduser()
    m = read_manifest(folder)
    if tok is not None and tokenizer_sha256(tok) != m["tokenizer_sha256"]:
        raise ConfigError(f"data.tokenizer is not the tokenizer {folder} was prepared with (sha256 differs); "
                          f"leave data.tokenizer empty to use {folder / TOKENIZER}, or prepare again with it")
    check_vocab(int(m["vocab_size"]), vocab_size)
    shards = open_shards(folder, m)
    verify_shards(folder, m, stamp_dir, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    if tok is None:
        tok = load_tokenizer(folder / TOKENIZER, f"{folder}/{TOKENIZER}")
        if tokenizer_sha256(tok) != m["tokenizer_sha256"]:
            raise ConfigError(f"{folder / TOKENIZER} does not match {folder / MANIFEST} (sha256 differs): "
                              f"the dataset is damaged; prepare it again")
    return Corpus(shards, int(m["eos_id"]), int(m["pad_id"])), tok


def cached_prepared(cfg: DataConfig, vocab_size: int) -> Path:
    """A raw ``data.source`` (or the default corpus), tokenised with the given or a
    trained-on-the-fly BPE and prepared into the cache once; later runs only map it."""
    docs = load_documents(cfg)  # small corpora only: the BPE is trained on them in memory
    tok = get_tokenizer(cfg.tokenizer, docs, vocab_size, cfg.cache_dir)
    key = hashlib.sha256(f"{corpus_digest(docs)}:{tokenizer_sha256(tok)}".encode()).hexdigest()[:16]
    final = cache_root(cfg.cache_dir) / f"prepared-{key}"
    if not is_prepared(final):
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        prepare([cfg.source], tok, tmp, workers=1, text_field=cfg.text_field, progress=False,
                max_docs=cfg.max_docs)
        try:
            os.rename(tmp, final)  # whole or not at all
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def split_corpus(corpus: Corpus, cfg: DataConfig, seq_len: int,
                 name: str) -> tuple[SequenceDataset, SequenceDataset | None]:
    """The last ``data.val_docs`` documents (at most a tenth) are held out for validation."""
    n_val = min(cfg.val_docs, corpus.n_docs // 10)
    train = SequenceDataset(corpus.subset(range(0, corpus.n_docs - n_val)), seq_len, cfg.pack, name)
    val = None
    if n_val:
        try:
            val = SequenceDataset(corpus.subset(range(corpus.n_docs - n_val, corpus.n_docs)), seq_len, cfg.pack, name)
        except ConfigError:
            val = None
    return train, val


def load_source(source: str, cfg: DataConfig, vocab_size: int) -> tuple[Corpus, Tokenizer]:
    """One source as a memory-mapped corpus (prepared into the cache first if raw)."""
    if is_prepared(source):
        tok = load_tokenizer(cfg.tokenizer, "data.tokenizer") if cfg.tokenizer else None
        corpus, tok = prepared_corpus(source, tok, vocab_size, cache_root(cfg.cache_dir) / "verified")
        if cfg.max_docs:
            corpus = corpus.subset(range(min(cfg.max_docs, corpus.n_docs)))
        return corpus, tok
    folder = cached_prepared(cfg, vocab_size)
    tok = load_tokenizer(folder / TOKENIZER)
    return prepared_corpus(folder, tok, vocab_size, cache_root(cfg.cache_dir) / "verified")


def build_data(cfg: DataConfig, vocab_size: int, seq_len: int) -> DataBundle:
    """Memory-map (preparing into the cache first if needed) and pack ``data.source``, or
    the weighted mixture of ``data.mix_sources`` (prepared datasets, one tokenizer)."""
    if not cfg.mix_sources:
        corpus, tok = load_source(cfg.source, cfg, vocab_size)
        train, val = split_corpus(corpus, cfg, seq_len, cfg.source)
        return DataBundle(tok, train, val)
    if len(cfg.mix_weights) != len(cfg.mix_sources):
        raise ConfigError(f"data.mix_weights has {len(cfg.mix_weights)} entries but data.mix_sources has "
                          f"{len(cfg.mix_sources)}; give one weight per source")
    parts, vals, tok, first = [], [], None, ""
    for source in cfg.mix_sources:
        if not is_prepared(source):
            raise ConfigError(f"data.mix_sources: {source!r} is not a prepared dataset; make it with "
                              f"`meshfold prepare ... --out {source}`")
        corpus, this_tok = load_source(source, cfg, vocab_size)
        if tok is not None and tokenizer_sha256(this_tok) != tokenizer_sha256(tok):
            raise ConfigError(f"data.mix_sources: {source!r} was prepared with another tokenizer than {first!r}; "
                              f"prepare every source with the same --tokenizer")
        tok, first = tok or this_tok, first or source
        train, val = split_corpus(corpus, cfg, seq_len, source)
        parts.append(train)
        if val is not None:
            vals.append(val)
    train = MixtureDataset(parts, [float(w) for w in cfg.mix_weights], collate)
    val = MixtureDataset(vals, [1.0] * len(vals), collate) if vals else None
    return DataBundle(tok, train, val)


def make_sampler(train, global_batch: int, seed: int):
    """The global-batch sampler for a dataset: a mixture's draws by weight."""
    if hasattr(train, "make_sampler"):
        return train.make_sampler(global_batch, seed)
    return GlobalBatchSampler(len(train), global_batch, seed)
