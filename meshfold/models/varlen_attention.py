"""Per-document ("varlen") core attention for packed rows.

With documents packed back to back in one row, a dense masked attention still pays for
the full T x T score matrix, so its cost depends on the row length, not on the
documents in it. This module runs attention only where documents are: query tiles attend
to the key window from their document's start (``attention_ops.document_attention``,
batched fused SDPA calls with a tile-sized mask, no per-row or per-document loop), so a
row of documents l_1..l_n costs about sum_i l_i^2 plus one tile per query tile, and the
cost model W(l) = a l^2 + b l holds. The result equals ``CoreAttention`` with document
masks when each document is contiguous (``packing.packed_row``).

Swapped in from outside (``use_varlen_attention``), like context parallel swaps its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models.attention_ops import DOCUMENT_TILE, document_attention
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

    def __init__(self, spread=None, tile: int = DOCUMENT_TILE):
        super().__init__()
        self.spread = spread
        self.tile = self.document_tile = tile  # Transformer.forward plans the windows once with it

    def forward(self, q, k, v, positions=None, doc_ids=None):
        gqa = q.shape[2] != k.shape[2]
        if doc_ids is None:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=gqa)
            return out.transpose(1, 2)
        out = document_attention(q, k, v, positions, doc_ids, self.tile)
        if self.spread is None or not self.spread.by_doc:
            return out
        # Spread documents' shares (laid first on the row, in the order every group member
        # shares) are replaced by ring attention over their group.
        for row in range(q.shape[0]):
            for start, length, doc in document_spans(doc_ids[row]):
                if doc in self.spread.by_doc:
                    sl = slice(start, start + length)
                    ring = self.spread.attend(doc, q[row: row + 1, sl], k[row: row + 1, sl], v[row: row + 1, sl])
                    out = _put(out, row, sl, ring)
        return out


def _put(out: torch.Tensor, row: int, sl: slice, value: torch.Tensor) -> torch.Tensor:
    """out with out[row, sl] = value[0], out of place (keeps autograd simple)."""
    mask = torch.zeros(out.shape[:2], dtype=torch.bool, device=out.device)
    mask[row, sl] = True
    full = torch.zeros_like(out)
    full[row: row + 1, sl] = value
    return torch.where(mask[:, :, None, None], full, out)


def use_varlen_attention(model: nn.Module, spread=None) -> int:
    """Swap every plain ``CoreAttention`` for ``VarlenCoreAttention``; returns how many."""
    n = 0
    for module in model.modules():
        if (isinstance(module, Attention) and type(module.core) is CoreAttention and not module.core.window
                and module.core.scale is None and not module.core.chunk):  # (windowed, rescaled or chunked layers keep their own)
            module.core = VarlenCoreAttention(spread)
            n += 1
    return n
