"""Per-sequence context parallel for the balanced data path (ByteScale / FlexSP spirit).

Instead of one static ``parallel.cp`` degree for every sequence, each step's plan
(``balance.plan_context_parallel``) spreads only the documents that are too long for one
rank's token limit, or too costly to balance, over an aligned group of ``k`` data-parallel
ranks (k a power of two); all other documents stay whole on one rank. A spread document
is padded at its end to a multiple of 2k tokens (pads come after every real token, so
causally no real token sees them; their labels are ignored) and cut into 2k chunks;
group member j holds chunks j and 2k-1-j (the causal load-balanced layout of
``parallel/cp/``), and its attention runs as that module's ring attention over the
group. Everything outside attention is per token, so the rest of the model runs on the
member's chunks like on any other tokens, and gradients need no special treatment: every
rank's loss covers its own tokens, the ring's backward returns key/value gradients to
their owners, and the data-parallel reduction sums the rest.

Fixed for a run: the process groups (every aligned power-of-two block of the dp ranks up
to ``data.seq_cp_max``, created once at start, in the same order on every rank), the
maximum degree, the token limit. Dynamic per step: which documents are spread, their
degree and group, where all other documents go.

Ordering: every rank lays its spread documents first, in the step's item order, so every
member of any group meets the group's ring calls in the same order (forward; the backward
runs them in reverse creation order, again the same on every member).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from meshfold.data.packing import IGNORE_INDEX, DocumentPieces
from meshfold.parallel.cp.batch import token_indices
from meshfold.parallel.cp.groups import ContextParallelPlan
from meshfold.parallel.cp.ring import ring_attention as _ring_attention


@dataclass
class SpreadContext:
    """Shared by the loader (which fills it each step) and the attention modules:
    piece id -> (ContextParallelPlan, meta [k, 2, 1, s_local]) for this rank's spread
    documents."""

    by_doc: dict = field(default_factory=dict)

    def attend(self, doc, q, k, v) -> torch.Tensor:
        """Ring attention of spread document ``doc``'s local chunks [1, s, heads, d] over its group."""
        plan, meta = self.by_doc[doc]
        return ring_attention(q, k, v, plan, meta)


def build_groups(dp_group, dp_size: int, max_degree: int) -> dict[tuple[int, int], object]:
    """Every aligned block (k, start) of the dp ranks for k = 2, 4, .. max_degree; all
    ranks create all groups in the same order and keep the ones they belong to."""
    me = dist.get_rank()
    mine = {}
    k = 2
    while k <= max_degree:
        for start in range(0, dp_size, k):
            ranks = [dist.get_global_rank(dp_group, i) if dp_group is not None else i for i in range(start, start + k)]
            group = dist.new_group(ranks)
            if me in ranks:
                mine[(k, start)] = group
        k *= 2
    return mine


def chunk_indices(padded: int, k: int, member: int) -> torch.Tensor:
    """Token indices member ``member`` of ``k`` holds: chunks member and 2k-1-member."""
    return token_indices(padded, k, member, 1, True)


def spread_span(pieces: DocumentPieces, piece: int, k: int, member: int, pad_id: int) -> tuple[dict, torch.Tensor]:
    """This member's share of a spread piece as ``[1, s]`` tensors (inputs, labels,
    doc_ids, positions), and the meta [k, 2, 1, s] (every member's positions) the ring needs."""
    tokens = pieces.tokens(piece).astype(np.int64)
    n = len(tokens) - 1
    padded = -(-n // (2 * k)) * (2 * k)
    inputs = np.full(padded, pad_id, dtype=np.int64)
    labels = np.full(padded, IGNORE_INDEX, dtype=np.int64)
    inputs[:n], labels[:n] = tokens[:-1], tokens[1:]
    idx = chunk_indices(padded, k, member)
    inputs_t, labels_t = torch.from_numpy(inputs)[idx], torch.from_numpy(labels)[idx]
    span = {"inputs": inputs_t.unsqueeze(0), "labels": labels_t.unsqueeze(0),
            "doc_ids": torch.full((1, len(idx)), piece, dtype=torch.int64), "positions": idx.unsqueeze(0)}
    meta = torch.stack([torch.stack([chunk_indices(padded, k, j).unsqueeze(0),
                                     torch.full((1, len(idx)), piece, dtype=torch.int64)]) for j in range(k)])
    return span, meta


def make_plan(group, k: int, member: int, s_local: int):
    return ContextParallelPlan(cp=k, ulysses=1, balance=True, cp_rank=member, cp_group=group, ulysses_group=None,
                               ring_group=group, tile=max(1, s_local // 2))


def ring_attention(q, k, v, plan, meta):
    """Causal attention of one spread document's local chunks over the whole document."""
    return _ring_attention(q, k, v, meta.to(q.device), False, plan)
