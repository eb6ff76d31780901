"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2), free of parallelism.

``model.mtp_depth`` = D modules run after the main model, in sequence. Module k (1..D), at
position i, combines the previous depth's representation with the embedding of token
t_{i+k} and predicts token t_{i+k+1}:

    h'_k = eh_proj_k( [ enorm_k(Emb(t_{i+k})) ; hnorm_k(h_{k-1}) ] )
    h_k  = norm_k( Block_k(h'_k) )          logits_k = OutHead(h_k)

``Emb`` and ``OutHead`` are the main model's (shared, not copied); ``h_0`` is the main
model's final hidden state after its final norm, and each module's output after its own
norm both feeds the head and the next module. This is the layout of DeepSeek-V3's released
weights (``model.layers.{61+k-1}``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
a decoder block) as the inference engines that run them read it: the embedding half comes
first in ``eh_proj``'s input (the paper's equation writes the other order).

Targets: module k at position i predicts ``labels[i + k]`` (= t_{i+k+1}). Positions with
i + k past the sequence have none, and with packed documents (``doc_ids``) neither do
positions whose token t_{i+k} lies in another document than position i: the module would
mix two documents. The loss is ``mtp_loss_weight / D`` times the sum of the D token-loss
sums, normalised like the main loss (by the main loss's token count: the paper's 1/T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshfold.models.config import ModelConfig


def build_heads(cfg: ModelConfig, make_norm, make_block) -> MTPHeads:
    """The registry's builder (``models/registry.py`` ``Head``): depth k's block is the model's
    block of layer index ``n_layers + k``."""
    return MTPHeads({str(k): MTPModule(cfg, make_norm, make_block(cfg.n_layers + k)) for k in range(cfg.mtp_depth)})


class MTPHeads(nn.ModuleDict):
    """The D depths (``model.mtp``; their names ``mtp.{k}.`` are the checkpoints' and the
    Hugging Face maps'), run after the main model's final norm in training only."""

    def predict(self, model: nn.Module, h, logits, ids, rope, positions=None, doc_ids=None):
        """The model's output given its final hidden state ``h`` and ``logits``: an
        ``MTPOutput`` in training, the logits alone in evaluation. ``ids``: the token ids."""
        if not self.training:
            return logits
        emb = model.tok_embeddings(ids)  # shared with the main model (a copy on the last pipeline stage)
        depth_logits, valid = [], []
        for k, module in enumerate(self.values(), start=1):
            h = module(h, shift_left(emb, k, 0.0), rope, positions, doc_ids)
            depth_logits.append(model.project(h))
            valid.append(mtp_valid(doc_ids, ids, k))
        return MTPOutput(logits, depth_logits, valid)


class MTPModule(nn.Module):
    """One prediction depth. ``block`` is a decoder block of the main model's kind (layer
    index ``n_layers + depth``, so MoE placement follows the model's rule); ``make_norm`` and
    ``block`` come from the model so this file does not import it."""

    def __init__(self, cfg: ModelConfig, make_norm, block: nn.Module):
        super().__init__()
        self.enorm = make_norm(cfg)
        self.hnorm = make_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = make_norm(cfg)

    def forward(self, h, emb, rope, positions=None, doc_ids=None):
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, rope, positions, doc_ids))


def shift_left(t: torch.Tensor, k: int, fill) -> torch.Tensor:
    """``t[:, i + k]`` at position i along dim 1; the last k positions hold ``fill``."""
    pad = t.new_full((t.shape[0], k) + t.shape[2:], fill)
    return torch.cat([t[:, k:], pad], dim=1)


def mtp_valid(doc_ids: torch.Tensor | None, like: torch.Tensor, k: int) -> torch.Tensor:
    """[batch, seq] bool: depth k has a target at position i (i + k inside the sequence and,
    with ``doc_ids``, in position i's document)."""
    b, s = like.shape[:2]
    inside = torch.arange(s, device=like.device) < s - k
    if doc_ids is None:
        return inside.expand(b, s)
    return (shift_left(doc_ids, k, -2) == doc_ids) & inside


@dataclass
class MTPOutput:
    """The last stage's output with multi-token prediction: the main logits and, per depth
    k = 1..D, its logits and where it has a target (``mtp_valid``)."""

    logits: torch.Tensor
    depth_logits: list[torch.Tensor]
    valid: list[torch.Tensor]
