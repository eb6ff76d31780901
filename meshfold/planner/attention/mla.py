"""Multi-head latent attention's planner terms (``models/deepseek/mla.py``; under tp
``parallel/tp/mla.py``'s ``TensorParallelMLAttention``, under cp the latent ring of
``parallel/cp/mla.py``): q full-rank or through a low-rank latent, k and v expanded per
head from one kv latent (nope + rope wide q/k heads, v_dim wide v heads)."""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.planner.attention.base import AttentionTerms


class LatentAttention(AttentionTerms):
    tp_with_cp = False  # tp or cp, not both (parallel/config.py)
    op_recompute = False
    per_parameter_buckets = True

    def params_local(self, m: ModelConfig, tp: int) -> float:
        """The up-projections (wq_b or a full-rank wq, wkv_b) and wo split by heads; the
        down-projections (wq_a, wkv_a) and their norms whole."""
        h = m.dim
        H, qk = m.n_heads, m.mla_nope_dim + m.mla_rope_dim
        q = (h * m.mla_q_rank + m.mla_q_rank + H * qk * m.mla_q_rank / tp) if m.mla_q_rank else H * qk * h / tp
        return (q + h * (m.mla_kv_rank + m.mla_rope_dim) + m.mla_kv_rank
                + H * (m.mla_nope_dim + m.mla_v_dim) * m.mla_kv_rank / tp + H * m.mla_v_dim * h / tp)

    def param_sizes(self, m: ModelConfig) -> list[float]:
        h, qk, heads = m.dim, m.mla_nope_dim + m.mla_rope_dim, m.n_heads
        q = [m.mla_q_rank * h, m.mla_q_rank, heads * qk * m.mla_q_rank] if m.mla_q_rank else [heads * qk * h]
        return q + [(m.mla_kv_rank + m.mla_rope_dim) * h, m.mla_kv_rank,
                    heads * (m.mla_nope_dim + m.mla_v_dim) * m.mla_kv_rank, h * heads * m.mla_v_dim]

    def gemms(self, m: ModelConfig, tp: int) -> list[tuple[float, float]]:
        """Down-projections whole on every tp rank, up-projections and wo split by heads."""
        h, H, qk = m.dim, m.n_heads, m.mla_nope_dim + m.mla_rope_dim
        q = [(m.mla_q_rank, h), (H * qk / tp, m.mla_q_rank)] if m.mla_q_rank else [(H * qk / tp, h)]
        return q + [(m.mla_kv_rank + m.mla_rope_dim, h), (H * (m.mla_nope_dim + m.mla_v_dim) / tp, m.mla_kv_rank),
                    (h, H * m.mla_v_dim / tp)]

    def tp_splits(self, m: ModelConfig) -> list[tuple[str | None, str | None]]:
        """The down-projections replicated, the up-projections (on the latent ``tp.enter``
        gathered: no group) column, wo row; a full-rank q a column group of its own."""
        q = [("replicated", None), ("column", None)] if m.mla_q_rank else [("column", "attention")]
        return q + [("replicated", None), ("column", None), ("row", None)]

    def kept_bytes(self, m, s, b, tp, recompute, act, amp, split, replicated):
        """The latent attention's kept bytes (``mla_kept_bytes``) in place of the q, k,
        v, out (split) and, under amp, the three projections' input copies (replicated)."""
        h, hkv = m.dim, m.kv_heads * m.head_dim
        mla_split, mla_replicated, mla_whole = mla_kept_bytes(m, s, b, tp, recompute, act, amp)
        split += mla_split - act * s * b * (2 * h + 2 * hkv)
        replicated += mla_replicated - (3 * act * s * b * h if amp else 0.0)
        return split, replicated, mla_whole

    def core_width(self, m: ModelConfig) -> int:
        """q/k heads nope + rope wide, v zero-padded to them for the fused kernel
        (models/llama.py ``CoreAttention``)."""
        return m.n_heads * (m.mla_nope_dim + m.mla_rope_dim)

    def head_widths(self, m: ModelConfig) -> tuple[int, int]:
        return m.mla_nope_dim + m.mla_rope_dim, m.mla_v_dim

    def cp_kv_heads(self, m: ModelConfig, tp: int, u: int) -> tuple[int, int]:
        """The latent expands into a k and a v per query head."""
        return m.n_heads // tp, m.n_heads // tp

    def ulysses_q_out(self, m, act, tokens, tp):
        qk_w, v_w = self.head_widths(m)
        return tuple(act * tokens * m.n_heads / tp * w for w in (qk_w, v_w))

    def ulysses_out_width(self, m: ModelConfig) -> int:
        return m.n_heads * m.mla_v_dim

    def ring_hop(self, m, act, tokens, kv_heads, u, R, rate):
        """Pure ring: the latent travels, kv_rank + rope values a token (parallel/cp/mla.py),
        each step expanding it with wkv_b: R - 1 more expansions forward, R re-run plus their
        two gradient GEMMs backward."""
        if u != 1:
            return super().ring_hop(m, act, tokens, kv_heads, u, R, rate)
        kv = act * tokens * (m.mla_kv_rank + m.mla_rope_dim)
        expand = 2 * tokens * m.mla_kv_rank * m.n_heads * (m.mla_nope_dim + m.mla_v_dim) / rate
        return kv, (R - 1) * expand, (3 * R - 2) * expand

    def ring_kept(self, m, act_kinds, act, tokens, u, recompute):
        """The latent ring keeps q, the latent and the output: no expanded k and (padded) v
        (``mla_kept_bytes`` counts the one-process kernel's)."""
        if u != 1 or recompute not in ("none", "selective"):
            return act_kinds
        qk_w = m.mla_nope_dim + m.mla_rope_dim
        return {k: x - act * tokens * m.n_heads * 2 * qk_w + act * tokens * (m.mla_kv_rank + m.mla_rope_dim)
                for k, x in act_kinds.items()}

    def tp_layer(self, m, tp, sp, recomputed, act, tokens, r_ar, A, calls, sent, weights):
        """The latent enters in place of the block input (a full-rank q still reads the input:
        a dense entry of its own); sp: the latent's gather (AG fwd, RS bwd, again when
        recomputed; the up-projections keep the gathered latent, no re-gather) and the
        sequence-split down-projections' and latent norms' gradients summed over tp; else f
        (all-reduce bwd)."""
        h = m.dim
        full_q = m.mla_q_rank == 0
        latent = act * tokens * (m.mla_q_rank + m.mla_kv_rank + m.mla_rope_dim)
        if sp:
            calls += 2 + recomputed - (0 if full_q else 3 + recomputed)
            sent += r_ar * ((1 + 0.5 * recomputed) * latent - (0 if full_q else (1.5 + 0.5 * recomputed) * A))
            calls += 2 if full_q else 4
            weights += (h * (m.mla_kv_rank + m.mla_rope_dim) + m.mla_kv_rank
                        + (0 if full_q else h * m.mla_q_rank + m.mla_q_rank))
        else:
            calls += 1 if full_q else 0
            sent += r_ar * (latent - (0 if full_q else A))
        return calls, sent, weights


def mla_kept_bytes(m: ModelConfig, s: int, b: int, tp: int, recompute: str, act: int,
                      amp: bool) -> tuple[float, float, float]:
    """What latent attention keeps for backward beyond the block's norms, for one
    micro-batch of one layer: (split over the tp heads, on the rank's tokens (1/tp of them
    under sp), whole on every tp rank).

    Split: the fused kernel's q, k and v (v zero-padded to the q/k width by ``CoreAttention``)
    and output, all nope + rope wide per head (selective recompute keeps the core's inputs
    only: q, k and the unpadded v), and the out-projection's input (v wide). The rank's tokens: the latent
    norms' fp32 input, bf16 output and 1/rms (amp), and the one bf16 copy autocast makes of
    the block input for the down-projections (two with a full-rank q, which reads it too).
    Whole: the up-projections' input latent (with tp the gathered / entered
    [c_q ; c_kv ; k_rope], without it c_q and c_kv), and RoPE's cos/sin tables cast to fp32
    for q and k."""
    H, qk = m.n_heads, m.mla_nope_dim + m.mla_rope_dim
    ranks = m.mla_q_rank + m.mla_kv_rank
    # selective: the checkpointed core's inputs q, k and the unpadded v (the core pads it)
    kernel = (2 * qk + m.mla_v_dim) if recompute == "selective" else 4 * qk
    split = act * s * b * H * (kernel + m.mla_v_dim)
    norms = 2 if m.mla_q_rank else 1
    per_token = ((6 * ranks + 4 * norms) if amp else 2 * act * ranks) \
        + (act * m.dim * (1 if m.mla_q_rank else 2) if amp else 0.0)
    latent = ranks + m.mla_rope_dim if tp > 1 else ranks
    whole = act * latent + 8 * m.mla_rope_dim
    return split, s * b * per_token, s * b * whole
