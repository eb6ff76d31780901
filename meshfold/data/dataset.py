"""Tokenised corpora packed into fixed-length sequences, and a seeded, resumable sampler
that gives every data-parallel layout the same global batches.

Packing keeps document boundaries: every token carries the index of its document, so
attention can be masked per document (``doc_ids``) and balancers can see lengths.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from meshfold.config import ConfigError, DataConfig
from meshfold.data.sources import load_documents
from meshfold.data.tokenizer import EOS, PAD, cache_root, corpus_digest, get_tokenizer, special_id

IGNORE_INDEX = -100


@dataclass
class TokenizedCorpus:
    tokens: np.ndarray  # all documents concatenated, each followed by EOS (int32)
    offsets: np.ndarray  # document d is tokens[offsets[d]:offsets[d+1]] (int64, len = n_docs + 1)
    eos_id: int
    pad_id: int

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d]: self.offsets[d + 1]]

    def subset(self, docs: range) -> "TokenizedCorpus":
        start, stop = self.offsets[docs.start], self.offsets[docs.stop]
        return TokenizedCorpus(self.tokens[start:stop], self.offsets[docs.start: docs.stop + 1] - start,
                               self.eos_id, self.pad_id)


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

    def __init__(self, corpus: TokenizedCorpus, seq_len: int, pack: bool = True):
        self.corpus, self.seq_len, self.pack = corpus, seq_len, pack
        lengths = corpus.doc_lengths()
        if pack:
            self.doc_of_token = np.repeat(np.arange(corpus.n_docs, dtype=np.int32), lengths)
            self.n = (len(corpus.tokens) - 1) // seq_len
        else:
            self.docs = np.flatnonzero(lengths >= 2)
            self.n = len(self.docs)
        if self.n == 0:
            raise ConfigError(
                f"the corpus ({len(corpus.tokens)} tokens) is too small for one sequence of model.seq_len = "
                f"{seq_len}; use a larger data.source or a shorter seq_len"
            )

    def __len__(self) -> int:
        return self.n

    def get(self, idx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens[S+1], doc_ids[S+1], valid[S+1]) for sequence ``idx``."""
        S = self.seq_len
        if self.pack:
            sl = slice(idx * S, idx * S + S + 1)
            tokens = self.corpus.tokens[sl]
            return tokens, self.doc_of_token[sl], np.ones(S + 1, dtype=bool)
        d = int(self.docs[idx])
        doc = self.corpus.doc(d)[: S + 1]
        tokens = np.full(S + 1, self.corpus.pad_id, dtype=np.int32)
        tokens[: len(doc)] = doc
        valid = np.zeros(S + 1, dtype=bool)
        valid[: len(doc)] = True
        return tokens, np.full(S + 1, d, dtype=np.int32), valid

    def batch(self, indices) -> dict[str, torch.Tensor]:
        rows = [self.get(int(i)) for i in indices]
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
        self._perm: torch.Tensor | None = None

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = torch.randperm(self.n, generator=gen)
        return self._perm

    def next(self) -> torch.Tensor:
        if self.cursor + self.global_batch > self.n:
            self.epoch, self.cursor, self._perm = self.epoch + 1, 0, None
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
        self.epoch, self.cursor, self._perm = int(state["epoch"]), int(state["cursor"]), None


def rank_slice(global_indices: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    local = len(global_indices) // dp_size
    return global_indices[dp_rank * local: (dp_rank + 1) * local]


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: SequenceDataset
    val: SequenceDataset | None


def build_data(cfg: DataConfig, vocab_size: int, seq_len: int) -> DataBundle:
    """Load, tokenise (cached) and pack the corpus. The last ``data.val_docs`` documents are
    held out for validation."""
    docs = load_documents(cfg)
    tok = get_tokenizer(cfg.tokenizer, docs, vocab_size, cfg.cache_dir)
    corpus = tokenize_corpus(docs, tok, cfg.cache_dir)
    n_val = min(cfg.val_docs, corpus.n_docs // 10)
    train = SequenceDataset(corpus.subset(range(0, corpus.n_docs - n_val)), seq_len, cfg.pack)
    val = None
    if n_val:
        try:
            val = SequenceDataset(corpus.subset(range(corpus.n_docs - n_val, corpus.n_docs)), seq_len, cfg.pack)
        except ConfigError:
            val = None
    return DataBundle(tok, train, val)
