"""The layer terms (``terms.LayerTerms``) of one micro-batch on one device: per block kind
(dense / MoE) and for the output layer and loss, forward and backward seconds (GEMMs by
shape, the attention core, memory-bound bytes, the tp/cp/ep communication left exposed,
recompute), parameters, kept activation bytes and the traffic ``traffic.py`` counts.
What differs between attention kinds comes from ``planner/attention``."""

from __future__ import annotations

from meshfold.models.counts import attention_share, ffn_params
from meshfold.parallel.facts.expert_tp import dispatch_share
from meshfold.planner.attention import attention_terms, ring_sends
from meshfold.planner.counts import (
    DTYPE_BYTES,
    attention_params_local,
    dense_layer_params_local,
    layer_activation_bytes,
    moe_activation_bytes,
    routed_fraction,
    routed_params,
)
from meshfold.planner.kernels import (
    FP8_CAST_BYTES,
    attention_tiles_per_rank,
    elementwise_bytes,
    fp8_cast_elements,
    gemm_backward_time,
    gemm_time,
    layer_gemms,
    matmul_efficiency,
    moe_routing_bytes,
)
from meshfold.planner.terms import (
    BlockTerms,
    LayerActivations,
    LayerParams,
    LayerTerms,
    LayerTimes,
    LayerTraffic,
)
from meshfold.planner.fp8 import dispatch_row_bytes
from meshfold.planner.traffic import tp_counts
from meshfold.ring import FACTORS as RING


class LayerCosts:
    """``CostModel``'s layer terms, cached per (tp, sp, cp, ep, micro-batch, recompute)."""

    def layer_terms(self, tp: int, sp: bool, cp: int, cp_mode: str, ep: int, b: int, recompute: str,
                    ulysses: int = 0, ep_chunks: int = 1, expert_tp: int = 1) -> LayerTerms:
        key = (tp, sp, cp, cp_mode, ep, b, recompute, ulysses, ep_chunks, expert_tp)
        hit = self._layer_cache.get(key)
        if hit is not None:
            return hit
        w, c, m = self.w, self.c, self.w.model
        pb, gb, ob, act = DTYPE_BYTES[w.dtype]
        s, h, V = w.s, m.dim, m.vocab_size
        s_loc = s // cp
        tokens = b * s_loc
        peak, hbm = self.peak, self.hbm
        eff = matmul_efficiency(c, h / tp)
        d = c.device
        bw = hbm * d.hbm_eff  # what streaming kernels reach
        if w.kernels == "eager" and d.eager_hbm_eff:  # PyTorch's one-kernel-per-op (measured)
            bw = hbm * d.eager_hbm_eff
        attn_p = self._attn_p
        norm_p = 2 * m.dim * (2 if (m.norm == "layernorm" and m.bias) else 1)
        # QK^T and AV for this device's queries, as wide as the attention kind's heads
        attn_kind = attention_terms(m)
        attn_core = 4 * tokens * s * attn_kind.core_width(m) / tp * self.causal
        amp = w.dtype == "bf16-amp"
        kept: dict = {}  # layer_activation_bytes per (recompute, MoE block): the same ones recur

        def layer_kept(r: str, moe: bool) -> float:
            if (r, moe) not in kept:
                kept[(r, moe)] = layer_activation_bytes(m, s_loc, b, tp, sp, r, act, w.flash, w.dropout, amp, moe)
            return kept[(r, moe)]

        any_moe = m.moe_experts > 0
        act_full, act_kept = layer_kept("none", any_moe), layer_kept(recompute, any_moe)
        # per layer kind (dense / MoE): a model with leading dense layers has both
        act_kinds = {moe: layer_kept(recompute, moe) + (moe_activation_bytes(m, s_loc, b, tp, ep, act, sp, ep_chunks,
                                                                                         w.aligned_groups, expert_tp)
                                                         if moe and recompute != "full" else 0.0)
                     for moe in self.kind_counts}
        # The attention core: fused (flash) kernels at their measured efficiency, forward
        # and backward (2.5x the forward's FLOPs: it recomputes the scores); unfused, the
        # two batched GEMMs per head (QK^T, AV) priced as GEMMs, whose s x s output makes
        # them memory bound at short head dims, the softmax in the memory-bound bytes; a
        # device without a measured attention efficiency: its FLOPs at the GEMM rate.
        if w.flash and d.attention_eff:
            attn_f = attn_core / (peak * d.attention_eff)
            attn_b = 2.5 * attn_core / (peak * (d.attention_bwd_eff or d.attention_eff))
        elif d.gemm_tile and not w.flash:
            per_head = gemm_time(d, tokens, s, m.head_dim, h / tp, act)
            attn_f = 2 * per_head * (m.n_heads / tp) * self.causal
            attn_b = 2 * attn_f
        else:
            attn_f = attn_core / (peak * eff)
            attn_b = 2 * attn_f
        share = self.__dict__.get("_attention_share")
        if share is None:  # sliding-window layers: their band only (1.0 without), once per model
            share = self._attention_share = attention_share(m, s, self.causal < 1)
        if share != 1.0:
            attn_f, attn_b = attn_f * share, attn_b * share
        # memory-bound work, bytes over the bandwidth streaming kernels reach; backward
        # twice forward (an elementwise op's gradient reads the output gradient and its
        # saved operands and writes one gradient per operand)
        scale = c.elementwise_traffic / bw
        overhead = d.layer_overhead_us * 1e-6
        # Tensor parallel: 2 all-reduces (with sp: all-gather + reduce-scatter, the same
        # bytes) of the b*s*h activations per layer forward, 2 in backward.
        tp_bytes = act * tokens * h
        call = c.collective_overhead_us * 1e-6  # software cost of issuing one collective
        tp_ar = self.ct("all_reduce", tp_bytes, tp, 1) + (call if tp > 1 else 0.0)
        # the block's exit collective (the MLP's all-reduce; sp: its reduce-scatter, half the bytes)
        tp_exit = (tp_ar + (call if tp > 1 else 0.0)) / 2 if sp else tp_ar
        # Context parallel (parallel/cp/) over u Ulysses ranks (stride tp) inside R =
        # cp / u ring members (stride u tp): ring u = 1, Ulysses u = cp, hybrid cp_ulysses.
        # Ulysses: 4 all-to-alls (q, k, v, out) forward, 4 backward (kv heads repeated up to u
        # when fewer). Ring, on the member's u x tokens and heads / u: K,V go around (R-1
        # hops) forward, K,V again and dK,dV (R hops back to their owner, in the >= fp32
        # accumulation dtype) backward, each hop hidden behind the attention block it feeds.
        u = 1 if cp_mode == "ring" else cp if cp_mode == "ulysses" else max(1, ulysses)
        R = cp // u
        kv_local, kv_heads = attn_kind.cp_kv_heads(m, tp, u)  # per tp rank, per Ulysses rank
        qk_w, v_w = attn_kind.head_widths(m)  # head widths of q/k and of v/out
        cp_fwd = cp_sel = cp_sent = cp_sent_rec = cp_sent_sel = 0.0
        cp_calls = cp_calls_rec = cp_calls_sel = 0
        if cp > 1 and u > 1:
            q_size, o_size = attn_kind.ulysses_q_out(m, act, tokens, tp)  # q and the attention output
            k_size, v_size = (act * tokens * kv_heads * w for w in (qk_w, v_w))  # k, v (GQA: fewer heads)
            cp_fwd = sum(self.ct("all_to_all", x, u, tp) for x in (q_size, o_size, k_size, v_size)) + 4 * call
            cp_sent = 2 * RING["all_to_all"](u) * (q_size + o_size + k_size + v_size)  # forward and backward
            cp_sent_rec, cp_calls, cp_calls_rec = cp_sent / 2, 8, 4
            # selective recompute re-runs the attention core from its q, k, v: their three
            # all-to-alls again, not the output's (checkpoint stops once backward has what it needs)
            cp_sent_sel, cp_calls_sel = RING["all_to_all"](u) * (q_size + k_size + v_size), 3
            cp_sel = sum(self.ct("all_to_all", x, u, tp) for x in (q_size, k_size, v_size)) + 3 * call
        if cp > 1 and R > 1:
            # a hop's bytes, and the compute the attention kind's ring adds (the latent's expansions)
            kv, ring_f, ring_b = attn_kind.ring_hop(m, act, tokens, kv_heads, u, R, peak * eff)
            attn_f += ring_f
            attn_b += ring_b
            alpha, beta = self.link(tp * u, R)
            hop = alpha + kv / beta + call
            # windowed / chunked layers send only the blocks some member sees (planner/attention/ring.py)
            sends = ring_sends(m, s, cp, u, w.cp_balance)
            # what hides behind the attention blocks slows them (contention, ``overlap_slowdown``)
            shown = max(sends.steps * hop - attn_f, hop)
            ring_t = shown + d.overlap_slowdown * max(0.0, sends.steps * hop - shown)
            cp_fwd += ring_t
            cp_sel += ring_t
            cp_sent += 2 * sends.kv * kv + sends.grad * kv * max(4, act) / act
            cp_sent_rec += sends.kv * kv
            cp_sent_sel += sends.kv * kv
            cp_calls, cp_calls_rec, cp_calls_sel = (cp_calls + 2 * sends.kv_calls + sends.grad_calls,
                                                    cp_calls_rec + sends.kv_calls, cp_calls_sel + sends.kv_calls)
        if cp > 1:  # what the attention kind's ring keeps in place of the one-process kernel's
            act_kinds = attn_kind.ring_kept(m, act_kinds, act, tokens, u, recompute)
        if cp > 1 and u > 1 and recompute in ("none", "selective"):
            # Ulysses: the output projection keeps the output's all-to-all result besides the
            # core's own output (other layouts: one tensor); kv heads repeated up to u are kept
            # so by the core (unless selective recompute reruns it)
            extra = act * tokens * attn_kind.ulysses_out_width(m) / tp
            if recompute == "none" and kv_local % u:
                extra += 2 * act * tokens * m.head_dim * (u - kv_local)
            act_kinds = {k: x + extra for k, x in act_kinds.items()}
        # the tiled attention's fixed cost per tile (a third forward, two thirds backward)
        tile_t = 0.0
        if cp > 1:
            tile_t = attention_tiles_per_rank(cp, R) * c.device.attention_tile_us * 1e-6
        out = {}
        for moe in self.kind_counts:
            ffn_active, ffn_total, params = self._layer_params(tp, ep, moe, norm_p)
            gkey = (tokens, tp, moe)  # (sp, cp's mode and the recompute change no GEMM)
            hit = self._gemm_cache.get(gkey)
            if hit is None and d.gemm_tile:  # each linear layer's GEMMs by their shapes, forward and
                # backward (the input gradient's and the weight gradient's)
                shapes = layer_gemms(m, tp, moe)
                hit = ([gemm_time(d, tokens, n, k, h / tp, act, w.fp8) for n, k in shapes],
                       [gemm_backward_time(d, tokens, n, k, h / tp, act, w.fp8, w.wgrad_fused) for n, k in shapes])
                if moe and d.grouped_gemm_eff and m.moe_capacity_factor <= 0:
                    # dropless, the routed experts run as grouped GEMMs (torch._grouped_mm), below
                    # the dense rate (``Device.grouped_gemm_eff``); the shared experts' share stays dense
                    slow = 1 + m.moe_topk / (m.moe_topk + m.moe_shared_experts) * (1 / d.grouped_gemm_eff - 1)
                    mlp = len(shapes) - (3 if m.gated_mlp else 2)
                    hit = ([t * (slow if i >= mlp else 1.0) for i, t in enumerate(hit[0])],
                           [tuple(x * (slow if i >= mlp else 1.0) for x in pair) for i, pair in enumerate(hit[1])])
            elif hit is None:  # a calibrated rate: FLOPs over it (the form calibrate solves)
                one = 2 * (attn_p + ffn_active) / tp * tokens / (peak * eff)
                hit = ([one], [(one, one)])
            self._gemm_cache[gkey] = hit
            gemms, gemms_b = hit
            ekey = ("ew", tp, sp, moe)  # (bytes per token: the count is linear in the tokens)
            per_token = self._model_cache.get(ekey)
            if per_token is None:
                per_token = elementwise_bytes(m, 1, s, tp, sp, act, amp, w.flash, w.dropout, w.kernels, moe)
                if moe:  # the routing's gathers, casts and index-adds (kernels.moe_routing_bytes)
                    rf, rb = moe_routing_bytes(m, tp, sp, act, m.moe_topk * routed_fraction(m, s))
                    per_token = (per_token[0] + rf, per_token[1], per_token[2], per_token[3] + rb)
                self._model_cache[ekey] = per_token
            ew_all, ew_attn, ew_sums, ew_back = (tokens * x for x in per_token)
            if w.fp8:  # Float8 casts as torchao runs them (kernels.fp8_cast_elements): each
                # linear's input forward; its output gradient twice and its input again backward;
                # its weight once each way, every micro-batch
                cast = FP8_CAST_BYTES[w.kernels]
                cast_f, cast_b = fp8_cast_elements(layer_gemms(m, tp, moe))
                weights8 = cast * (attn_p + ffn_total) / tp
                ew_all, ew_back = ew_all + cast * tokens * cast_f + weights8, ew_back + cast * tokens * cast_b + weights8
            ew_f = ew_all * scale
            fwd_c = sum(gemms) + attn_f
            fwd = fwd_c + ew_f + 2 * tp_ar + cp_fwd + (overhead + tile_t) / 3
            if recompute == "full":
                # torch's non-reentrant checkpoint stops once every tensor the backward saved
                # is recomputed: the block's last linear's input, so its GEMM and the exit
                # collective after it (all-reduce; sp: reduce-scatter) are not re-run, as the
                # runtime's counts have it (traffic.tp_counts); a dropout after the MLP
                # (Megatron's jobs) saves its mask at the very end: the whole forward re-runs
                rec = fwd if w.dropout else fwd - gemms[-1] - tp_exit
            elif recompute == "op":
                # torchtitan's op policy: every op recomputed but every other matmul (it
                # saves the 1st, 3rd, ...) and the attention kernel; the block's tp and
                # cp communication is re-run as under full (meshfold's collectives are not kept)
                rec = sum(gemms[1::2]) + ew_f - ew_attn * scale + 2 * tp_ar - tp_exit + cp_fwd
            elif recompute == "selective":  # the attention core and its softmax, with its cp communication
                rec = attn_f + ew_attn * scale + cp_sel
            else:
                rec = 0.0
            bwd = (sum(map(sum, gemms_b)) + attn_b + (ew_back + ew_sums) * scale + self._tp_backward(gemms_b, tp_ar, sp)
                   + 2 * cp_fwd + rec + 2 * (overhead + tile_t) / 3)
            ep_sent = 0.0
            if moe and ep > 1:
                # expert parallel: dispatch and combine all-to-alls of the routed tokens
                # (top-k copies of each, every capacity slot under a capacity; with tp each tp
                # rank sends only its expert column's 1/tp) forward, and their transposes
                # backward, over the ep ranks (innermost of dp x cp: stride tp); before them,
                # dropless, the per-expert row counts (E/tp int64; per chunk when pipelined).
                # Experts split inside (``expert_tp``): every tp rank sends all its tokens' rows
                # and counts for all experts (``dispatch_share`` 1)
                share = dispatch_share(tp, expert_tp)
                routed = act * tokens * m.moe_topk * routed_fraction(m, s) * h / share
                counts = 8 * m.moe_experts / share * ep_chunks if m.moe_capacity_factor <= 0 else 0.0
                # pipelined in n chunks (parallel/ep/dispatch.py ``overlapped_exchange``): the first
                # dispatch and the last combine are exposed; the other 2n - 2 chunk exchanges
                # run while the experts compute, and show only where they outlast it
                n = ep_chunks
                a2a = self.ct("all_to_all", routed / n, ep, tp) + call
                experts_f = 2 * routed_params(m) / m.moe_experts * m.moe_topk * routed_fraction(m, s) \
                    * tokens / tp / (peak * eff)
                # (the chunks hidden behind the experts slow them: contention, ``overlap_slowdown``)
                for window, part in ((experts_f, "f"), (2 * experts_f, "b")):
                    hidden = min((2 * n - 2) * a2a, window)
                    t = 2 * a2a + (2 * n - 2) * a2a - hidden + d.overlap_slowdown * hidden
                    fwd, bwd = (fwd + t, bwd) if part == "f" else (fwd, bwd + t)
                # (parallel.ep_fp8_dispatch: the dispatch's rows in fp8 plus a scale, planner/fp8.py)
                dispatch = routed / (act * h) * dispatch_row_bytes(w, act, h)
                ep_sent = RING["all_to_all"](ep) * (3 * routed + dispatch + counts)
                if recompute in ("full", "op"):  # the forward's counts, dispatch and combine re-run
                    ep_sent += RING["all_to_all"](ep) * (routed + dispatch + counts)
            out[moe] = (fwd, bwd, params, fwd_c, ep_sent)
        # the output layer and the loss over the vocabulary: the logits GEMM, then the
        # cross-entropy's memory-bound passes per logit (parallel/loss.py; forward: the max
        # a, the shifted fp32 copy a + 4, exp 8, the sum 4; backward: the shifted copy a + 4,
        # exp 8, the scale 8, the cast into the gradient 4 + a)
        logits = self._gemm_cache.get((tokens, tp, "logits"))
        if logits is None and d.gemm_tile:
            # (bf16 under train.fp8 too: the runtime keeps the output layer in bf16)
            logits = (gemm_time(d, tokens, V / tp, h, h / tp, act),
                      sum(gemm_backward_time(d, tokens, V / tp, h, h / tp, act, False, w.wgrad_fused)))
        elif logits is None:
            one = 2 * h * V / tp * tokens / (peak * eff)
            logits = (one, 2 * one)
        self._gemm_cache[(tokens, tp, "logits")] = logits
        logits_gemm, logits_back = logits
        ce = c.elementwise_traffic * tokens * V / tp / bw if d.gemm_tile else (act + 8) * tokens * V / tp / hbm
        # (eager: the shifted fp32 copy, forward and backward, subtracts a broadcast per-token
        # max from the compute-dtype logits: PyTorch runs that on its non-vectorized path)
        shift = ((act + 4) * (bw / (hbm * d.broadcast_hbm_eff) - 1)
                 if w.kernels == "eager" and d.broadcast_hbm_eff else 0.0)
        out_fwd = logits_gemm + (2 * act + 16 + shift) * ce if d.gemm_tile else logits_gemm + ce
        out_bwd = logits_back + (2 * act + 24 + shift) * ce if d.gemm_tile else 2 * out_fwd
        # Tensor parallel around the layers, in all-reduce equivalents of tp_bytes (an
        # all-gather or reduce-scatter is half of one): the vocabulary-parallel embedding's
        # reduction (sp: reduce-scatter fwd, all-gather bwd); the output layer's input (sp:
        # all-gather fwd, reduce-scatter + re-gather bwd; else all-reduce bwd); and per layer
        # with sp the re-gather of the two gathered inputs in backward. Plus, on the last
        # stage, the loss's three all-reduces of per-token scalars and (sp) the all-reduce of
        # the replicated norm weights' gradients.
        emb_ops = (0.5, 0.5) if sp else (1.0, 0.0)  # (forward, backward)
        out_ops = (0.5, 1.0) if sp else (0.0, 1.0)
        layer_regather = 1.0 if sp else 0.0
        loss_bytes = 3 * tokens * max(4, act)
        norm_bytes = (2 * m.n_layers + 1) * h * pb if sp else 0.0
        tp_layer, tp_moe, tp_first, tp_last = tp_counts(m, tp, sp, recompute, act, tokens, s, b, self._has_moe)
        # with ep > 1 the routed experts are their own FSDP group, sharded over the edp ranks
        expert_p = routed_params(m) / (tp * ep) if ep > 1 else 0.0
        hit = LayerTerms(
            kinds={moe: BlockTerms(*x) for moe, x in out.items()}, tokens=tokens,
            time=LayerTimes(out_fwd=out_fwd, out_bwd=out_bwd, tp_ar=tp_ar, cp_fwd=cp_fwd,
                            loss_t=self.ct("all_reduce", loss_bytes / 3, tp, 1),
                            norm_t=self.ct("all_reduce", norm_bytes, tp, 1) if sp else 0.0,
                            emb_ops=emb_ops, out_ops=out_ops, layer_regather=layer_regather),
            traffic=LayerTraffic(tp_layer=tp_layer, tp_moe=tp_moe, tp_first=tp_first, tp_last=tp_last,
                                 cp_sent=cp_sent, cp_sent_rec=cp_sent_rec, cp_sent_sel=cp_sent_sel,
                                 cp_calls=(cp_calls, cp_calls_rec, cp_calls_sel),
                                 p2p_bytes=act * tokens * h / (tp if sp else 1)),
            params=LayerParams(expert_p=expert_p, emb=V * h / tp,
                               pos_emb=s * h if m.pos == "learned" else 0.0,  # learned positions: whole on every tp rank
                               final_norm=norm_p / 2),
            acts=LayerActivations(act_kinds=act_kinds, act_full=act_full, act_kept=act_kept))
        self._layer_cache[key] = hit
        return hit

    def _tp_backward(self, gemms_b: list, tp_ar: float, sp: bool) -> float:
        """Seconds a block's backward waits for its tensor-parallel collectives: the input
        gradients of the two column-parallel linears (the attention's input projections, the
        MLP's first) are all-reduced (sp: reduce-scattered, after re-gathering their
        sequence-split input), and with sp the two row-parallel linears' output gradients
        all-gathered: 2 all-reduces' worth (sp: 3). Issued one after the other on the compute
        stream (meshfold's ``parallel/tp``), all of it waits. ``Workload.tp_overlap``
        (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``): the column-parallel
        ones run beside the GEMM that does not need them -- the input gradient's reduction
        beside the weight-gradient GEMM, the input's re-gather (sp) beside the input-gradient
        GEMM -- so only what outlasts that GEMM waits, plus the contention of the rest (the
        device's ``overlap_slowdown``); the row-parallel gathers (sp) still wait.
        ``gemms_b``: (input gradient, weight gradient) seconds per linear, forward order."""
        if tp_ar <= 0.0:
            return 0.0
        exposed = (2.0 + (1.0 if sp else 0.0)) * tp_ar
        if not self.w.tp_overlap:
            return exposed
        mlp_n = 3 if self.w.model.gated_mlp else 2
        n = len(gemms_b)
        slow = self.c.device.overlap_slowdown
        waits = 1.0 * tp_ar if sp else 0.0  # sp: the row-parallel gathers
        # the column-parallel linears: the attention's input projections, the MLP's first ones
        for linears in (gemms_b[:n - mlp_n - 1], gemms_b[n - mlp_n:-1]):
            dgrad, wgrad = sum(x[0] for x in linears), sum(x[1] for x in linears)
            pieces = ((tp_ar / 2, dgrad), (tp_ar / 2, wgrad)) if sp else ((tp_ar, wgrad),)
            for t, window in pieces:
                shown = max(0.0, t - window)
                waits += shown + slow * (t - shown)
        return waits

    def _layer_params(self, tp: int, ep: int, moe: bool, norm_p: float) -> tuple[float, float, float]:
        """A block's active and total feed-forward parameters and its parameters per device
        (``layer_terms``'), per (tp, ep, kind)."""
        key = ("params", tp, ep, moe)
        hit = self._model_cache.get(key)
        if hit is None:
            m = self.w.model
            ffn_active = ffn_params(m, self._first_moe if moe else 0, active=True)
            ffn_total = ffn_params(m, self._first_moe if moe else 0)
            if moe:  # the router is replicated over tp; the routed experts split over ep too
                router = m.dim * m.moe_experts
                params = (attention_params_local(m, tp) + (ffn_total - router) / tp + router + norm_p
                          - routed_params(m) / tp * (1 - 1 / ep))
            else:  # replicated kv heads, q/k norms and row-parallel biases are whole on each rank
                params = dense_layer_params_local(m, tp) + norm_p
            hit = self._model_cache[key] = (ffn_active, ffn_total, params)
        return hit
