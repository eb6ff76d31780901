"""Sliding-window attention over plain rows on the CPU (``attention_ops.banded_window_attention``):
query tiles attend only the key tiles their window reaches; it equals the banded [S, S]-mask
definition (``window_mask``) in float64, forward and every gradient, with and without sinks,
for rows that are not whole tiles and windows that are not whole tiles."""

import pytest
import torch

from meshfold.models import attention_ops
from meshfold.models.llama import CoreAttention


@pytest.mark.parametrize("b,s,heads,kv_heads,window", [(2, 300, 4, 2, 40), (1, 257, 2, 2, 128), (2, 1030, 4, 1, 100)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_banded_tiles_equal_the_band_mask(b, s, heads, kv_heads, window, with_sinks):
    g = torch.Generator().manual_seed(s + window)
    q, k, v = (torch.randn(b, s, h, 8, generator=g, dtype=torch.float64).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=g, dtype=torch.float64).requires_grad_() if with_sinks else None
    leaves = [q, k, v] + ([sinks] if with_sinks else [])
    got = attention_ops.banded_window_attention(q, k, v, window, 0.3, sinks)
    mask = attention_ops.window_mask(s, window, q.device)
    want = attention_ops.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=mask, scale=0.3,
                              sinks=sinks).transpose(1, 2)
    dout = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_windowed_layer_takes_the_banded_path_on_plain_rows(monkeypatch):
    """A windowed ``CoreAttention`` on plain rows longer than two windows goes through the tiles
    (no [S, S] mask made); with packed documents it keeps the document-aware mask."""
    calls = []
    real = attention_ops.banded_window_attention
    monkeypatch.setattr(attention_ops, "banded_window_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attention_ops._WINDOW_MASKS.clear()
    q = torch.randn(1, 96, 2, 8, dtype=torch.float64)
    CoreAttention(window=16)(q, q, q)
    assert calls == [1] and not attention_ops._WINDOW_MASKS
    CoreAttention(window=16)(q, q, q, doc_ids=torch.zeros(1, 96, dtype=torch.long))
    assert calls == [1] and len(attention_ops._WINDOW_MASKS) == 1
