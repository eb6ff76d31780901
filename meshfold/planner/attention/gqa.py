"""Multi-head and grouped-query attention's planner terms (``models/llama.py``'s
``Attention`` under ``parallel/tp/plan.py``): wq, wk, wv, wo; kv heads replicated over tp
ranks when tp does not divide them."""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.planner.attention.base import AttentionTerms


class GroupedQuery(AttentionTerms):
    def params_local(self, m: ModelConfig, tp: int) -> float:
        """wq, wo (and wk, wv when tp divides the kv heads) split, else whole, with the
        per-head q/k norms."""
        h, hd = m.dim, m.head_dim
        qkv = 1 if (m.bias or m.qkv_bias) else 0
        kv_tp = tp if m.kv_heads % tp == 0 else 1
        return (m.n_heads * hd * (h + qkv) / tp + 2 * m.kv_heads * hd * (h + qkv) / kv_tp
                + m.n_heads * hd * h / tp + (2 * hd if m.qk_norm else 0))

    def tp_splits(self, m: ModelConfig) -> list[tuple[str | None, str | None]]:
        return [("column", "attention")] * 3 + [("row", None)]  # q, k, v gathered once under sp

    def param_sizes(self, m: ModelConfig) -> list[float]:
        h, hd = m.dim, m.head_dim
        return [h * m.n_heads * hd, h * m.kv_heads * hd, h * m.kv_heads * hd, m.n_heads * hd * h]

    def gemms(self, m: ModelConfig, tp: int) -> list[tuple[float, float]]:
        h, hq, hkv = m.dim, m.n_heads * m.head_dim, m.kv_heads * m.head_dim
        kv_local = hkv / min(tp, m.kv_heads) if m.kv_heads % tp else hkv / tp
        return [(hq / tp, h), (kv_local, h), (kv_local, h), (h, hq / tp)]

    def tp_layer(self, m, tp, sp, recomputed, act, tokens, r_ar, A, calls, sent, weights):
        if m.kv_heads % tp:  # wk, wv replicated: their gradients are summed over tp
            kv_bias = m.bias or m.qkv_bias
            calls += 2 * (2 if kv_bias else 1)
            weights += 2 * m.kv_heads * m.head_dim * (m.dim + (1 if kv_bias else 0))
        return calls, sent, weights
