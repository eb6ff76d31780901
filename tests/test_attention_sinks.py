"""Attention sinks (a learned logit per head in the softmax's denominator) on every path of
the core attention: plain causal, sliding window, packed documents (query tiles) and the
S x S document-mask reference, each against an explicit softmax over [scores, sink] in
float64, forward and gradients of q, k, v and the sinks; and the fused kernels' path
(``_SinkAttention``) against the math kernel's."""

import pytest
import torch

from meshfold.models import attention_ops
from meshfold.models.llama import CoreAttention

B, S, H, HKV, D = 2, 12, 4, 2, 8


def reference(q, k, v, sinks, keep, scale):
    """softmax([q k^T * scale, sink]) without the sink's column, times v ([b, s, h, d] layout)."""
    rep = H // HKV
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, 2)) * scale
    scores = scores.masked_fill(~keep, -torch.inf)
    sink = sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(rep, 2))


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, n, D, dtype=torch.float64, generator=g, requires_grad=True) for n in (H, HKV, HKV))
    sinks = (torch.randn(H, dtype=torch.float64, generator=g) * 2).requires_grad_()
    return q, k, v, sinks


DOCS = torch.tensor([[0] * 7 + [1] * 5, [0] * 3 + [1] * 9])


@pytest.mark.parametrize("case", ["causal", "window", "documents", "dense_documents", "window_documents"])
def test_sinks_equal_the_explicit_softmax(case):
    window = 3 if case.startswith("window") else 0
    docs = DOCS if "documents" in case else None
    core = CoreAttention(dense=case == "dense_documents", window=window, scale=0.3)
    core.document_tile = core.document_tile and 4  # several query tiles, several windows
    q, k, v, sinks = inputs()
    pos = torch.arange(S)
    keep = pos[:, None] >= pos[None, :]
    if window:
        keep = keep & (pos[:, None] - pos[None, :] < window)
    keep = keep.expand(B, 1, S, S)
    if docs is not None:
        keep = keep & (docs[:, None, :, None] == docs[:, None, None, :])
    got = core(q, k, v, doc_ids=docs, sinks=sinks)
    want = reference(q, k, v, sinks, keep, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(got)
    g_got = torch.autograd.grad(got, (q, k, v, sinks), grad)
    g_want = torch.autograd.grad(want, (q, k, v, sinks), grad)
    for name, a, b in zip("q k v sinks".split(), g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
    # the sinks matter: without them the output differs
    assert (core(q, k, v, doc_ids=docs) - got).abs().max() > 1e-3


def test_fused_path_equals_the_math_kernel_and_float32():
    q, k, v, sinks = inputs(1)
    qh, kh, vh = (t.detach().transpose(1, 2).repeat_interleave(H // t.shape[2], 1).requires_grad_() for t in (q, k, v))
    outs = []
    for kernel in ("auto", "math"):
        saved = attention_ops.pick_kernel
        attention_ops.pick_kernel = lambda q, masked, _k="auto", kind=kernel: saved(q, masked, kind)
        try:
            out = attention_ops.sdpa(qh, kh, vh, causal=True, scale=0.25, sinks=sinks)
            outs.append((out, *torch.autograd.grad(out.square().sum(), (qh, kh, vh, sinks))))
        finally:
            attention_ops.pick_kernel = saved
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    out32 = attention_ops.sdpa(*(t.detach().float() for t in (qh, kh, vh)), causal=True, scale=0.25,
                               sinks=sinks.detach().float())
    torch.testing.assert_close(out32.double(), outs[0][0], rtol=1e-5, atol=1e-6)
