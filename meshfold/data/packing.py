"""Packing documents into fixed-capacity bins without ever cutting one in two.

Two uses:

* ``pack(lengths, capacity)``: best-fit or first-fit decreasing bin packing of item
  lengths (documents, or pieces of documents) into bins of ``capacity`` tokens. Items are
  taken longest first (ties by index, so the result is deterministic); best fit puts an
  item in the fullest bin it still fits, first fit in the oldest such bin.
* ``DocumentPieces``: a corpus seen as training *pieces*: each document of ``L`` tokens
  (EOS included) has ``L - 1`` next-token predictions, cut into pieces of at most
  ``max_len`` predictions. A piece is one attention unit: positions restart at 0 and
  attention never leaves it. Documents no longer than ``max_len + 1`` tokens are one
  piece, so a packed row is exactly the same computation as training on each document
  alone (with per-document masks and positions).

``packed_row`` concatenates pieces into one flat row (``[1, T]`` tensors with ``doc_ids``
and per-piece ``positions``); ``packed_rows`` packs pieces into ``[rows, seq_len]`` rows
(best fit decreasing), padding the rest with an ignored pad piece.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100
PACK_METHODS = ("bfd", "ffd")


class PackingError(ValueError):
    pass


def pack(lengths, capacity: int, method: str = "bfd") -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose sums are <= ``capacity``.

    Bins come out in the order they were opened; within a bin, items longest first."""
    if method not in PACK_METHODS:
        raise PackingError(f"packing method {method!r}; choose one of {', '.join(PACK_METHODS)}")
    lengths = [int(x) for x in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if order and lengths[order[0]] > capacity:
        raise PackingError(f"an item of {lengths[order[0]]} tokens does not fit a bin of {capacity}")
    bins: list[list[int]] = []
    free: list[int] = []  # first fit: remaining space per bin, in opening order
    by_free: list[tuple[int, int]] = []  # best fit: (remaining, bin id), sorted
    for i in order:
        size = lengths[i]
        if method == "ffd":
            for b, space in enumerate(free):
                if space >= size:
                    bins[b].append(i)
                    free[b] -= size
                    break
            else:
                bins.append([i])
                free.append(capacity - size)
        else:
            # The fullest bin that still fits = the smallest remaining space >= size.
            k = bisect.bisect_left(by_free, (size, -1))
            if k < len(by_free):
                space, b = by_free.pop(k)
                bins[b].append(i)
                bisect.insort(by_free, (space - size, b))
            else:
                bins.append([i])
                bisect.insort(by_free, (capacity - size, len(bins) - 1))
    return bins


@dataclass(frozen=True)
class Piece:
    doc: int  # document index in the corpus
    start: int  # first input token inside the document
    length: int  # number of predictions (= input tokens = label tokens)


class DocumentPieces:
    """A tokenised corpus (``TokenizedCorpus``) cut into pieces of at most ``max_len``
    predictions. ``doc_pieces[d]`` lists the piece ids of document ``d`` in order."""

    def __init__(self, corpus, max_len: int):
        if max_len < 1:
            raise PackingError(f"pieces need max_len >= 1, got {max_len}")
        self.corpus, self.max_len = corpus, max_len
        docs, starts, lens = [], [], []
        self.doc_pieces: list[list[int]] = []
        for d, L in enumerate(corpus.doc_lengths().tolist()):
            ids = []
            for s in range(0, max(L - 1, 0), max_len):
                ids.append(len(lens))
                docs.append(d)
                starts.append(s)
                lens.append(min(max_len, L - 1 - s))
            self.doc_pieces.append(ids)
        self.doc = np.asarray(docs, dtype=np.int64)
        self.start = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lens, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def n_docs(self) -> int:
        return len(self.doc_pieces)

    def piece(self, p: int) -> Piece:
        return Piece(int(self.doc[p]), int(self.start[p]), int(self.lengths[p]))

    def tokens(self, p: int) -> np.ndarray:
        """length + 1 tokens: inputs are [:-1], labels [1:]."""
        base = self.corpus.offsets[self.doc[p]] + self.start[p]
        return self.corpus.tokens[base: base + self.lengths[p] + 1]


def packed_row(pieces: DocumentPieces, ids, pad_to: int = 0) -> dict[str, torch.Tensor]:
    """One flat row holding the pieces ``ids`` back to back: ``inputs``, ``labels``,
    ``doc_ids`` (the piece id, so two pieces of one document never see each other) and
    ``positions`` (restarting at 0 per piece), each ``[1, T]``. An empty row (or
    ``pad_to`` > T) is filled with pad tokens whose labels are ignored."""
    parts_in, parts_lab, parts_doc, parts_pos = [], [], [], []
    for p in ids:
        t = pieces.tokens(int(p)).astype(np.int64)
        n = len(t) - 1
        parts_in.append(t[:-1])
        parts_lab.append(t[1:])
        parts_doc.append(np.full(n, int(p), dtype=np.int64))
        parts_pos.append(np.arange(n, dtype=np.int64))
    total = sum(len(x) for x in parts_in)
    pad = max(pad_to - total, 1 if total == 0 else 0)
    if pad:
        parts_in.append(np.full(pad, pieces.corpus.pad_id, dtype=np.int64))
        parts_lab.append(np.full(pad, IGNORE_INDEX, dtype=np.int64))
        parts_doc.append(np.full(pad, -1, dtype=np.int64))
        parts_pos.append(np.arange(pad, dtype=np.int64) % max(pieces.max_len, 1))
    cat = lambda xs: torch.from_numpy(np.concatenate(xs)).unsqueeze(0)  # noqa: E731
    return {"inputs": cat(parts_in), "labels": cat(parts_lab), "doc_ids": cat(parts_doc),
            "positions": cat(parts_pos)}


def packed_rows(pieces: DocumentPieces, ids, seq_len: int, method: str = "bfd",
                rows: int = 0) -> dict[str, torch.Tensor]:
    """Pieces ``ids`` packed into ``[rows, seq_len]`` tensors (at least ``rows`` rows,
    more if needed), documents whole, each row padded. For layouts that need a fixed
    sequence length (pipeline stages, sequence-parallel splits)."""
    ids = [int(p) for p in ids]
    bins = pack([pieces.lengths[p] for p in ids], seq_len, method)
    bins += [[] for _ in range(max(rows - len(bins), 0))]
    out = [packed_row(pieces, [ids[i] for i in b], pad_to=seq_len) for b in bins]
    return {k: torch.cat([r[k] for r in out]) for k in out[0]}
