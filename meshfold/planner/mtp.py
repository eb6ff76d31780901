"""Multi-token prediction's planner terms (``models/deepseek/mtp.py``): ``mtp_depth`` extra heads
after the trunk, on the last pipeline stage, each a block, eh_proj [2h -> h] and three
norms, an output head and its loss; under pp the last stage's copy of the embedding
(``parallel/pp/mtp_copies.py``). Arithmetic over the depth: a model without it (depth 0) adds
nothing, so the shared planner code adds these terms without asking whether there are any."""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.planner.terms import LayerTerms


def head_kinds(m: ModelConfig, kinds: list) -> list:
    """The block kind of each depth's block (is_moe), priced as a block of its kind; a kind
    the trunk lacks is priced as the trunk's last layer's."""
    return [k if k in kinds else kinds[-1] for k in (m.is_moe_layer(m.n_layers + d) for d in range(m.mtp_depth))]


def extra_params(m: ModelConfig, pp: int, emb: float) -> float:
    """A rank's parameters of the depths beyond their blocks: eh_proj and three norms per
    depth (whole on every tp rank) and, under pp, the last stage's copy of the embedding
    (``emb``: this tp rank's rows), held once whatever the depth."""
    h = m.dim
    copy = emb if pp > 1 else 0.0
    return m.mtp_depth * (2 * h * h + 3 * h) + min(m.mtp_depth, 1) * copy


def heads_terms(m: ModelConfig, T: LayerTerms, pp: int) -> tuple[float, float, float]:
    """The last stage's forward and backward seconds per micro-batch and parameters the
    depths add beyond their blocks: each depth's head and loss as the trunk's, with their tp
    collectives, and ``extra_params``."""
    D, t = m.mtp_depth, T.time
    return (D * (t.out_fwd + t.out_ops[0] * t.tp_ar + 3 * t.loss_t),
            D * (t.out_bwd + t.out_ops[1] * t.tp_ar),
            extra_params(m, pp, T.params.emb))


def saved_logits(m: ModelConfig, trunk: float, act: int, amp: bool, tokens: int) -> float:
    """What the loss keeps for backward with the depths' heads: ``trunk`` (the logits,
    targets and output norm the trunk's loss keeps) once per depth more, what each depth's
    enorm and hnorm keep (amp: 8h + 4 each) and eh_proj's [2h] input (whole under tp)."""
    h = m.dim
    per_token = 2 * (8 * h + 4) + 2 * act * h if amp else 5 * act * h
    kept = trunk * (1 + m.mtp_depth)
    return kept + m.mtp_depth * per_token * tokens


def heads_on(m: ModelConfig, holds_last: bool) -> int:
    """Depths whose heads a rank runs: all of them on the rank holding the last stage."""
    return m.mtp_depth if holds_last else 0


def embedding_exchanges(m: ModelConfig, holds_last: bool) -> int:
    """Point-to-point exchanges per step of the embedding's gradient with the last stage's
    copy (``parallel/pp/mtp_copies.py``): one on the first stage's rank when another holds the last."""
    return 1 if m.mtp_depth and not holds_last else 0
