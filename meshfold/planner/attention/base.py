"""What the planner asks an attention block kind (``AttentionTerms``): its parameters and
GEMMs per tp rank, what it keeps for backward, and the sizes its tp and cp collectives
move. Defaults are multi-head / grouped-query attention's where a kind shares them."""

from __future__ import annotations

from meshfold.models.config import ModelConfig


class AttentionTerms:
    """One attention block kind's planner terms (``planner/attention/__init__.py`` registry)."""

    # tensor and context parallel together on this kind (``parallel/config.py`` validates it)
    tp_with_cp: bool = True
    # ``train.recompute = "op"``: the planner prices it (``counts.op_kept_bytes``)
    op_recompute: bool = True
    # gradient buckets counted parameter by parameter (``counts.moe_chunk_param_sizes``), as
    # for MoE blocks, rather than by the dense block's shapes (``counts.chunk_param_sizes``)
    per_parameter_buckets: bool = False

    def params_local(self, m: ModelConfig, tp: int) -> float:
        """One tp rank's attention parameters (wo's bias aside)."""
        raise NotImplementedError

    def param_sizes(self, m: ModelConfig) -> list[float]:
        """The attention's parameter elements in registration order, without tp."""
        raise NotImplementedError

    def gemms(self, m: ModelConfig, tp: int) -> list[tuple[float, float]]:
        """(output columns, inner dimension) per device of the attention's linear layers, in
        the order the forward runs them."""
        raise NotImplementedError

    def tp_splits(self, m: ModelConfig) -> list[tuple[str | None, str | None]]:
        """Per linear of ``gemms``, how tensor parallel splits it (``"column"``, ``"row"``,
        ``"replicated"``; None: not through ``tp_gemm``) and the sp column group sharing its
        gathered input (None: none), as the kind's tp layer runs it (planner/fp8.py)."""
        return [(None, None)] * len(self.gemms(m, 1))

    def kept_bytes(self, m: ModelConfig, s: int, b: int, tp: int, recompute: str, act: int, amp: bool,
                   split: float, replicated: float) -> tuple[float, float, float]:
        """``counts.layer_activation_bytes``' (split over tp, replicated, whole on every tp
        rank) bytes with this kind's attention in place of the q, k, v and output counted
        into ``split`` and ``replicated``."""
        return split, replicated, 0.0

    def core_width(self, m: ModelConfig) -> int:
        """Per token, the width QK^T and AV run over for all heads (the core's FLOPs)."""
        return m.dim

    def head_widths(self, m: ModelConfig) -> tuple[int, int]:
        """The width of one head of q/k and of v/out."""
        return m.head_dim, m.head_dim

    def cp_kv_heads(self, m: ModelConfig, tp: int, u: int) -> tuple[int, int]:
        """(kv heads per tp rank, kv heads one of ``u`` Ulysses ranks receives)."""
        kv_local = m.kv_heads // min(tp, m.kv_heads)
        return kv_local, (u if (u > 1 and kv_local % u) else kv_local)

    def ulysses_q_out(self, m: ModelConfig, act: int, tokens: int, tp: int) -> tuple[float, float]:
        """Bytes of q and of the attention output a Ulysses all-to-all moves."""
        return (act * tokens * m.dim / tp,) * 2

    def ulysses_out_width(self, m: ModelConfig) -> int:
        """Width of the attention output (all heads) the out-projection keeps under Ulysses."""
        return m.dim

    def ring_hop(self, m: ModelConfig, act: int, tokens: int, kv_heads: int, u: int, R: int,
                 rate: float) -> tuple[float, float, float]:
        """A ring hop's bytes and the compute the ring adds to the attention forward and
        backward (``rate``: the GEMM FLOP/s)."""
        qk_w, v_w = self.head_widths(m)
        return act * tokens * kv_heads * (qk_w + v_w), 0.0, 0.0

    def ring_kept(self, m: ModelConfig, act_kinds: dict, act: int, tokens: int, u: int, recompute: str) -> dict:
        """Per layer kind, the activation bytes with cp's ring running the attention."""
        return act_kinds

    def tp_layer(self, m: ModelConfig, tp: int, sp: bool, recomputed: int, act: int, tokens: int, r_ar: float,
                 A: float, calls: int, sent: float, weights: float) -> tuple[int, float, float]:
        """A block's tp (calls, sent bytes, replicated weights' gradient elements) with this
        kind's attention entry and replicated weights, from the dense block's."""
        return calls, sent, weights
