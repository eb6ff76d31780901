"""Per-document ("varlen") core attention for packed rows.

With documents packed back to back in one row, a dense masked attention still pays for
the full T x T score matrix, so its cost depends on the row length, not on the
documents in it. This module runs causal attention on each document's span separately,
so a row of documents l_1..l_n costs sum_i l_i^2 (what flash-attention's varlen kernels
do on GPUs) and the cost model W(l) = a l^2 + b l holds. Spans of equal length are
batched into one call. The result equals ``CoreAttention`` with document masks when each
document is contiguous and its positions count up from its start (``packing.packed_row``).

Swapped in from outside (``use_varlen_attention``), like context parallel swaps its own.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models.llama import Attention, CoreAttention


def document_spans(doc_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, length, id) of each run of equal ids in a 1-d tensor."""
    values, counts = torch.unique_consecutive(doc_ids, return_counts=True)
    out, start = [], 0
    for v, c in zip(values.tolist(), counts.tolist()):
        out.append((start, c, v))
        start += c
    return out


class VarlenCoreAttention(nn.Module):
    """Causal attention inside each contiguous document span; [b, s, heads, hd] in/out.

    ``spread`` (``parallel/per_sequence_cp.SpreadContext``): documents whose span on this
    rank is a share of a document spread over several ranks go to ring attention over
    their group instead."""

    def __init__(self, spread=None):
        super().__init__()
        self.spread = spread

    def forward(self, q, k, v, positions=None, doc_ids=None):
        gqa = q.shape[2] != k.shape[2]
        if doc_ids is None:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=gqa)
            return out.transpose(1, 2)
        spread = self.spread.by_doc if self.spread is not None else {}
        rows = []
        for row in range(q.shape[0]):
            spans = document_spans(doc_ids[row])
            by_len: dict[int, list[int]] = defaultdict(list)
            pieces: dict[int, torch.Tensor] = {}
            for start, length, doc in spans:
                if doc in spread:  # spans are in the canonical order every group member shares
                    sl = slice(start, start + length)
                    pieces[start] = self.spread.attend(doc, q[row: row + 1, sl], k[row: row + 1, sl],
                                                       v[row: row + 1, sl])[0]
                else:
                    by_len[length].append(start)
            for length, starts in by_len.items():
                # [n, heads, length, hd] for all spans of this length at once.
                def take(t):
                    return torch.stack([t[row, s: s + length] for s in starts]).transpose(1, 2)

                o = F.scaled_dot_product_attention(take(q), take(k), take(v), is_causal=True, enable_gqa=gqa)
                for j, s in enumerate(starts):
                    pieces[s] = o[j].transpose(0, 1)
            rows.append(torch.cat([pieces[s] for s, _, _ in spans], dim=0))
        return torch.stack(rows)


def use_varlen_attention(model: nn.Module, spread=None) -> int:
    """Swap every plain ``CoreAttention`` for ``VarlenCoreAttention``; returns how many."""
    n = 0
    for module in model.modules():
        if isinstance(module, Attention) and type(module.core) is CoreAttention:
            module.core = VarlenCoreAttention(spread)
            n += 1
    return n
