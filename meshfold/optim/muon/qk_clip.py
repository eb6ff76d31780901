"""QK-clip (MuonClip, as Kimi K2 trained): after each optimizer step, every attention head
whose largest pre-softmax logit in the step exceeded ``threshold`` (tau) has its query and
key projections scaled down so that logit would have been tau: gamma_h = tau / S_max_h,
W_q rows of head h times gamma_h^alpha, W_k rows of its kv head times gamma^(1 - alpha)
(grouped-query attention: the group's smallest gamma, so no head of the group keeps a
logit above tau). Heads under the threshold are untouched.

``S_max`` is recorded by a forward hook on each attention's ``core`` (the q, k it is handed,
after RoPE, with the causal / document mask and the core's softmax scale), in query tiles,
only while gradients are on (training forwards and their recomputation, not validation),
and is the maximum over micro-batches and over the data-parallel ranks (one all-reduce of
layers x heads floats per step, on dp). It costs one more QK^T per layer (fused attention
kernels do not return their row maxima). The step's hook (``Muon.after_step``) applies it
to whatever piece of W_q / W_k the rank holds (whole, or FSDP2's rows: ``local_box``).

Grouped-query ``Attention`` modules (models/llama.py) without tp or cp, sliding windows or
q/k norms (which bound the logits themselves); anything else refused in one line."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshfold import comm
from meshfold.errors import ConfigError
from meshfold.models.llama import Attention, document_causal_mask
from meshfold.parallel.materialize import local_box

QUERY_TILE = 1024  # queries per logit tile (bounds the extra memory to tile x keys per head)


def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, positions=None, doc_ids=None) -> torch.Tensor:
    """[heads]: the largest visible logit scale * q_i . k_j of each head (q [b, s, H, d],
    k [b, s, Hkv, d]; causal, and within a document when ``doc_ids``)."""
    b, s, H, _ = q.shape
    k = k.repeat_interleave(H // k.shape[2], dim=2)
    pos = positions if positions is not None else torch.arange(s, device=q.device).expand(b, -1)
    docs = doc_ids if doc_ids is not None else torch.zeros_like(pos)
    best = torch.full((H,), -torch.inf, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                      device=q.device)
    for t0 in range(0, s, QUERY_TILE):
        t1 = min(s, t0 + QUERY_TILE)
        logits = torch.einsum("bqhd,bkhd->bhqk", q[:, t0:t1], k).to(best.dtype) * scale
        visible = document_causal_mask(docs[:, t0:t1], docs, pos[:, t0:t1], pos)
        logits = logits.masked_fill(~visible, -torch.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 2, 3)))
    return best


class QKClip:
    """The hooks on ``model``'s attentions and the clip after each step (over ``group``)."""

    def __init__(self, model: nn.Module, threshold: float, alpha: float, group, *, tp: int = 1, cp: int = 1):
        if tp > 1 or cp > 1:
            raise ConfigError("train.muon_qk_clip works without tensor and context parallel for now; "
                              "set parallel.tp = parallel.cp = 1 or train.muon_qk_clip = 0")
        self.threshold, self.alpha, self.group = threshold, alpha, group
        self.attentions = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.attentions:
            raise ConfigError("train.muon_qk_clip needs grouped-query attention (models/llama.py Attention); "
                              "this model's attention is another kind: set train.muon_qk_clip = 0")
        for a in self.attentions:
            if a.q_norm is not None or a.core.window:
                raise ConfigError("train.muon_qk_clip: q/k norms or sliding-window attention in this model; "
                                  "set train.muon_qk_clip = 0")
        self.max_logits = [None] * len(self.attentions)
        self._handles = [a.core.register_forward_hook(self._recorder(i), with_kwargs=True)
                         for i, a in enumerate(self.attentions)]
        self.clipped = torch.zeros((), dtype=torch.int64)  # heads clipped so far (a test's counter)

    def _recorder(self, i: int):
        def record(core, args, kwargs, out):
            if not torch.is_grad_enabled():  # validation: not the training logits
                return
            q, k = args[0], args[1]
            scale = core.scale if core.scale is not None else q.shape[-1] ** -0.5
            with torch.no_grad():
                got = head_max_logits(q.detach(), k.detach(), scale, kwargs.get("positions"), kwargs.get("doc_ids"))
            self.max_logits[i] = got if self.max_logits[i] is None else torch.maximum(self.max_logits[i], got)
        return record

    @torch.no_grad()
    def after_step(self) -> None:
        """Clip the heads over the threshold (every rank the same: S_max is all-reduced)."""
        if any(m is None for m in self.max_logits):
            return  # no training forward since the last step (e.g. a checkpoint load's dry step)
        smax = torch.stack(self.max_logits)  # [layers, heads]
        self.max_logits = [None] * len(self.attentions)
        if self.group is not None and torch.distributed.get_world_size(self.group) > 1:
            comm.all_reduce(smax, self.group, "dp", op="max")
        gamma = (self.threshold / smax).clamp(max=1.0)
        self.clipped = self.clipped.to(gamma.device) + (gamma < 1).sum()
        for a, g in zip(self.attentions, gamma):
            group_gamma = g.view(a.n_kv_heads, -1).amin(dim=1)
            _scale_heads(a.wq, g.pow(self.alpha), a.head_dim)
            _scale_heads(a.wk, group_gamma.pow(1 - self.alpha), a.head_dim)


def _scale_heads(linear: nn.Linear, factors: torch.Tensor, head_dim: int) -> None:
    """Rows of ``linear`` (weight and bias) times their head's factor, on the piece this rank holds."""
    for p in (linear.weight, linear.bias):
        if p is None:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        row0, rows = (local_box(tuple(p.shape), p)[0][0], local.shape[0]) if isinstance(p, DTensor) else (0, p.shape[0])
        heads = (torch.arange(row0, row0 + rows, device=local.device) // head_dim).clamp(max=factors.numel() - 1)
        per_row = factors.to(local.device, local.dtype)[heads]
        local.mul_(per_row.view(-1, *([1] * (local.dim() - 1))))
