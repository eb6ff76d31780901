"""What rank 0 sends in one optimizer step, by mesh dimension, as the runtime's
communication ledger counts it (``CostModel.collectives``), and tensor parallel's calls and
bytes per micro-batch (``tp_counts``, part of the layer terms)."""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.parallel.facts.sizes import router_padding
from meshfold.planner import mtp
from meshfold.planner.fp8 import fp8_gathered_params, sp_regathers_skipped, tp_amax_collectives
from meshfold.planner.attention import attention_terms
from meshfold.planner.counts import (
    DTYPE_BYTES,
    FSDP_WIRE,
    buckets,
    chunk_param_sizes,
    ddp_buckets,
    moe_chunk_param_sizes,
    reducer_buckets,
    tp_grad_bytes,
    zero1_gather,
)
from meshfold.planner.terms import LayerTerms, TpCalls
from meshfold.planner.workload import Layout
from meshfold.ring import FACTORS as RING


def tp_counts(m: ModelConfig, tp: int, sp: bool, recompute: str, act: int, tokens: int, s: int, b: int,
              has_moe: bool) -> tuple[TpCalls, TpCalls, TpCalls, TpCalls]:
    """Tensor parallel's collectives per micro-batch: (per block, per MoE block on top,
    the first stage's, the last stage's), for ``tokens`` tokens of ``b`` sequences of ``s``."""
    h = m.dim
    attn_kind = attention_terms(m)
    # Calls and bytes each tp collective of the runtime (parallel/tp/, loss.py)
    # sends, per micro-batch: per layer, on the first stage, on the last stage, each as
    # (calls, activation bytes, weight-gradient elements): activations (and their
    # gradients) cross the tp link in the compute dtype (``act``: bf16 under autocast,
    # tensor.py's ``wire_dtype``), the loss's per-token statistics in >= fp32, and the
    # gradients of replicated weights in the dtype backward makes them, the compute
    # weights' (``collectives`` prices them: ``tp_grad_bytes``), so counted in elements here.
    tp_layer = tp_first = tp_last = tp_moe = TpCalls(0, 0.0, 0.0)
    if tp > 1:
        r_ar, A = RING["all_reduce"](tp), act * tokens * h
        # Full recompute re-runs the block's forward up to its last saved tensor (torch's
        # non-reentrant checkpoint stops early), so the MLP's exit is not repeated.
        recomputed = 1 if recompute in ("full", "op") else 0  # "op" re-runs them as "full"
        weights = 0.0  # replicated weights' gradient elements summed over tp, per layer
        if sp:  # per block: gathered entry (AG fwd; AG + RS bwd) and exit (RS fwd, AG bwd)
            calls, sent = 10 + 3 * recomputed, (5 + 1.5 * recomputed) * r_ar * A
            norm_calls = 2 if (m.norm == "layernorm" and m.bias) else 1
            calls += 2 * norm_calls + (2 if m.bias else 0)  # norm weights and wo/w2 biases
            weights += (2 * norm_calls + (2 if m.bias else 0)) * h
        else:  # f (all-reduce bwd) into, g (all-reduce fwd) out of attention and MLP
            calls, sent = 4 + recomputed, (4 + recomputed) * r_ar * A
        # the attention kind's entry and replicated weights (planner/attention)
        calls, sent, weights = attn_kind.tp_layer(m, tp, sp, recomputed, act, tokens, r_ar, A,
                                                  calls, sent, weights)
        if m.qk_norm:  # per-head q/k norms: each rank's gradient covers its own heads
            calls += 2
            weights += 2 * m.head_dim
        tp_layer = TpCalls(calls, sent, r_ar * weights)
        shared = 1 if m.moe_shared_experts else 0
        gates = tokens * m.moe_topk * act  # every assignment's, in the compute dtype (parallel/ep/dispatch.py)
        if has_moe and not sp:  # a MoE block: its gates' gradient summed over tp in
            # backward (the expert output leaves, its input enters like a dense MLP's), and the
            # tp-split shared experts' own entry (all-reduce backward) and exit (forward)
            tp_moe = TpCalls(1 + 2 * shared, r_ar * (gates + 2 * shared * A), 0.0)
        elif has_moe:  # a MoE block under sp (parallel/ep/dispatch.py ``tokens_in``/``_out``),
            # in place of the dense MLP's 5 calls (2.5 all-reduces of A) counted in tp_layer: the
            # tokens gathered (AG fwd, RS bwd; not re-gathered), the chosen experts (int64, AG)
            # and the gates (AG fwd, RS bwd, compute dtype), the per-token sums scattered back (RS
            # fwd, AG bwd); the balance statistics (E + 2 float64, all-reduce, not re-sent
            # under recompute); the router's gradient (E x dim elements); a shared expert is a
            # sequence-parallel MLP (5 calls). Full recompute re-runs the three gathers (the
            # dense MLP's one counted in tp_layer) and, with a shared expert after them, the
            # scatter and the shared expert's gather (its exit is not repeated).
            # The sequence-wise balance loss sums its per-sequence counts (b x E, >= fp32) over
            # tp, again when recomputed.
            # Under a capacity the chosen experts are gathered once more, before dispatch, for
            # the whole sequences' slots (``expert.sequence_capacity``), again when recomputed.
            ids = 8 * tokens * m.moe_topk
            stats = 8 * (m.moe_experts + 2)
            seq_aux = (1 + recomputed) if m.moe_seq_aux_loss_coef > 0 else 0
            slots = (1 + recomputed) if m.moe_capacity_factor > 0 else 0
            tp_moe = TpCalls(4 + 5 * shared + recomputed * (2 + 2 * shared) + seq_aux + slots,
                      r_ar * ((2 - 2.5 + 2.5 * shared) * A + 0.5 * ids + gates + stats
                              + recomputed * (0.5 * (ids + gates) + shared * A)
                              + seq_aux * b * m.moe_experts * max(4, act) + slots * 0.5 * ids),
                      r_ar * m.moe_experts * h)
        pos = r_ar * s * h if (sp and m.pos == "learned") else 0.0
        tp_first = TpCalls(2 + (1 if pos else 0), r_ar * A, pos) if sp else TpCalls(1, r_ar * A, 0.0)
        loss = (2, r_ar * 3 * tokens * max(4, act))  # max logit, (sum exp, target)
        if sp:
            norm_calls = 2 if (m.norm == "layernorm" and m.bias) else 1
            tp_last = TpCalls(3 + loss[0] + norm_calls, 1.5 * r_ar * A + loss[1], r_ar * norm_calls * h)
        else:
            tp_last = TpCalls(1 + loss[0], r_ar * A + loss[1], 0.0)
    return tp_layer, tp_moe, tp_first, tp_last


class Traffic:
    """``CostModel``'s collective counts (part of the cost model; reads its workload,
    layer terms and stages)."""

    def collectives(self, L: Layout, T: LayerTerms, stages: list, stage_layers: list, stage_params: list,
                    n_micro: int) -> dict:
        """Rank 0's collectives in one optimizer step, by mesh dimension as the runtime's
        communication ledger names them: ``{dim: {"count": calls, "bytes": sent}}``, bytes
        in ``meshfold/ring.py``'s ring convention (FACTORS, as ``comm.py`` counts), one count per collective call
        or point-to-point send. Rank 0 is pipeline stage 0 (and, at pp = 1 or where the
        schedule lays the last stage there, zbv's V, also the last stage). Not counted (as the runtime's ledger does not count them:
        ``dim=None`` in comm.py): the step's control scalars (token count, loss sum, gradient norm)."""
        w = self.w
        pb, gb, _, act = DTYPE_BYTES[w.dtype]
        tp, pp, cp = L.tp, L.pp, L.cp
        chunks = L.schedule.chunks_per_rank(L.pp_virtual_stages) if pp > 1 else 1
        last_on_rank0 = self.stage_kinds(L)[1] == 0
        layers0 = stage_layers[0]  # all of rank 0's chunks
        out: dict[str, list] = {}

        def add(dim: str, calls: float, sent: float) -> None:
            if calls > 0:
                entry = out.setdefault(dim, [0, 0.0])
                entry[0] += calls
                entry[1] += sent

        # data parallel (over dp x cp: FSDP shards over dp_shard x cp, replicas over dp_replicate)
        P0 = stage_params[0]
        n_shard, n_rep, n_all = L.dp_shard * cp, L.dp_replicate, L.dp * cp
        moe0 = stages[0].get(True, 0)  # rank 0's MoE layers
        if L.zero >= 2 and n_shard > 1:
            wg, wr = FSDP_WIRE[w.dtype]
            # the blocks, and the chunk roots that hold parameters of their own (the embedding's
            # stage; the output's, on rank 0 at pp = 1 or under zbv): a root without any sends nothing
            modules = stage_layers[0] + 1 + (1 if pp > 1 and last_on_rank0 else 0)
            # (ep > 1) each MoE layer's routed experts: an own FSDP group over edp ranks
            E0, edp = moe0 * T.params.expert_p, n_all // max(1, L.ep)
            # (train.fp8_all_gather: the blocks' converted linears cross in fp8, 1 byte an element)
            fp8 = fp8_gathered_params(w, stages[0])
            # (each MoE layer's router padded to a multiple of n_shard rows: parallel/facts/sizes.py)
            dense = P0 - E0 + moe0 * router_padding(w.model, n_shard)
            groups = [(modules, n_shard, dense, dense * wg - fp8 * (wg - 1))]
            groups += [(moe0, edp, E0 * self._expert_padding(L), E0 * self._expert_padding(L) * wg)] if E0 and edp > 1 else []
            for mods, n, P, gathered in groups:
                ag = RING["all_gather"](n)
                if L.zero == 3:  # every module, the roots too, gathered in forward and again in
                    # backward (apply_fsdp passes reshard_after_forward=True explicitly, so FSDP2's
                    # "keep the root unsharded" default for reshard_after_forward=None is off)
                    add("dp", n_micro * 2 * mods, n_micro * ag * 2 * gathered)
                else:
                    add("dp", mods, ag * gathered)
                add("dp", mods, RING["reduce_scatter"](n) * P * wr)
            if n_rep > 1:
                add("dp", modules, RING["all_reduce"](n_rep) * (P0 - E0) * wr / n_shard)
        elif n_all > 1:
            # under pp each of the rank's chunks has its own bucketed reducer (parallel/dp/replicate.py);
            # with ep > 1 the routed experts have reducers of their own over edp (and, ZeRO-1,
            # their own ShardedAdamW over edp), the rest goes over dp x cp
            E0, edp = (moe0 * T.params.expert_p, n_all // L.ep) if L.ep > 1 else (0.0, 1)
            calls = chunks * buckets((P0 - E0) * gb / chunks)
            expert_calls = chunks * buckets(E0 * gb / chunks)
            m = w.model
            moe_sizes = None  # GradReducer's buckets of a MoE / latent-attention chunk, exactly
            per_parameter = m.moe_experts or attention_terms(m).per_parameter_buckets
            if tp == 1 and chunks == 1 and (pp > 1 or L.ep > 1) and per_parameter:
                moe_sizes = moe_chunk_param_sizes(m, layers0, True, last_on_rank0, max(1, L.ep))
            if moe_sizes is not None:
                apart = L.ep > 1
                calls = reducer_buckets([e * pb for e, x in moe_sizes if not (x and apart)])
                expert_calls = reducer_buckets([e * pb for e, x in moe_sizes if x and apart])
            if tp == 1 and pp == 1 and L.ep == 1:  # torch DDP's buckets
                sizes = chunk_param_sizes(m, 1, m.n_layers, True, True)
                if sizes is None and per_parameter:
                    every = moe_chunk_param_sizes(m, m.n_layers, True, True)
                    sizes = None if every is None else [e for e, _ in every]
                if sizes is not None:
                    calls = ddp_buckets([e * gb for e in sizes])
            elif (pp == 1 or not last_on_rank0) and moe_sizes is None:
                # GradReducer: greedy per parameter, over each chunk of rank 0 (the first
                # stage's; a rank 0 holding the last stage too is estimated, as above)
                if pp == 1:
                    shapes = [(m.n_layers, True, True)]
                else:
                    split = self.stage_split(L)
                    shapes = [(split[L.schedule.stage_of(pp, 0, c)], c == 0, False) for c in range(chunks)]
                sizes = [chunk_param_sizes(m, tp, n, first, last) for n, first, last in shapes]
                if all(x is not None for x in sizes):
                    calls = sum(reducer_buckets([e * pb for e in x]) for x in sizes)
            add("dp", calls, RING["all_reduce"](n_all) * (P0 - E0) * gb)
            if E0 and edp > 1:
                add("dp", expert_calls, RING["all_reduce"](edp) * E0 * gb)
            if L.zero == 1 and n_shard > 1 and self.optimizer.zero_one_shards:
                # ShardedAdamW's flat segments in one call (bf16 under meshfold's bfloat16), or
                # ZeroRedundancyOptimizer's buckets (counts.zero1_gather)
                zb, flat = zero1_gather(w.dtype, tp, L.ep)
                add("dp", 1 if flat else buckets(P0 * zb), RING["all_gather"](n_shard) * (P0 - E0) * zb)
                if E0 and edp > 1:
                    add("dp", 1, RING["all_gather"](edp) * E0 * zb)
        # tensor parallel: per layer, around the layers, loss (parallel/tp/, loss.py)
        if tp > 1:
            grad = tp_grad_bytes(w.dtype)
            moe_layers0 = stages[0].get(True, 0)
            # (each multi-token prediction depth embeds the shifted tokens and has its own head and loss)
            depths = mtp.heads_on(w.model, last_on_rank0)
            tr = T.traffic
            for part, times in ((tr.tp_layer, layers0), (tr.tp_moe, moe_layers0), (tr.tp_first, 1 + depths),
                                (tr.tp_last, (1 + depths) if last_on_rank0 else 0)):
                calls, sent, weights = part
                add("tp", n_micro * times * calls, n_micro * times * (sent + weights * grad))
            # (train.fp8: the fp8 casts' scales, max-reduced over tp where their axis is split)
            # and the sequence-parallel re-gathers its column groups skip (net: more calls, planner/fp8.py)
            tokens = L.micro_batch * (w.s // cp)
            calls, amax = tp_amax_collectives(w, tp, stages[0], tokens, L.recompute, L.sp)
            skipped, regathered = sp_regathers_skipped(w, tp, L.sp, stages[0], tokens, act)
            add("tp", n_micro * (calls - skipped),
                n_micro * (RING["all_reduce"](tp) * amax - RING["all_gather"](tp) * regathered))
        # pipeline: activations to the next stage, gradients to the previous one, per
        # micro-batch and chunk; then the loss and the bubble statistics over pp
        if pp > 1:
            # (every chunk sends forward, all but stage 0 backward; under zbv's V stage 0
            # sends activations and stage 2p-1, the last, gradients)
            sends = L.schedule.sends_per_microbatch(pp, L.virtual, 0)
            add("pp", n_micro * sends, n_micro * sends * T.traffic.p2p_bytes)
            # one all-gather of [loss sum, busy, start, end] (float64) per pp rank
            add("pp", 1, RING["all_gather"](pp) * 32 * pp)
            # the embedding's gradient, exchanged with the last stage's copy (multi-token prediction)
            add("pp", mtp.embedding_exchanges(w.model, last_on_rank0), T.params.emb * gb)
        # context parallel (parallel/cp/): ring hops, or Ulysses' all-to-alls, per
        # layer; the ranks' positions/doc ids once per micro-batch and chunk; the work counter per step
        if cp > 1:
            # the collectives recompute issues again: the block's forward ones (full, op), or the
            # attention core's (selective)
            redo = {"full": 1, "op": 1, "selective": 2}.get(L.recompute)
            per_layer = T.traffic.cp_calls[0] + (T.traffic.cp_calls[redo] if redo else 0)
            sent = T.traffic.cp_sent + ((T.traffic.cp_sent_rec, T.traffic.cp_sent_sel)[redo - 1] if redo else 0.0)
            add("cp", n_micro * layers0 * per_layer, n_micro * layers0 * sent)
            meta = 2 * L.micro_batch * (w.s // cp) * 8 * cp  # (each chunk of a pp rank gathers its own)
            add("cp", n_micro * chunks, n_micro * chunks * RING["all_gather"](cp) * meta)
            add("cp", 1, RING["all_gather"](cp) * 8 * cp)
        # MoE: the global balance statistics, per MoE layer and micro-batch forward (E + 2
        # float64 all-reduced over dp x cp, recorded as dp; replayed, not re-sent, under recompute)
        if moe0 and n_all > 1:
            add("dp", n_micro * moe0, n_micro * moe0 * RING["all_reduce"](n_all) * 8 * (w.model.moe_experts + 2))
        # expert parallel: per MoE layer the token counts (dropless only), dispatch and combine
        # forward, and the two transposes backward
        ep_layers = sum(n for k, n in stages[0].items() if k)
        if L.ep > 1 and ep_layers:
            ep_bytes = sum(T.kinds[k].ep_sent * n for k, n in stages[0].items())
            # pipelined in n chunks: each chunk's dispatch and combine, both ways; one counts exchange
            n = L.ep_overlap_chunks
            fwd_calls = 2 * n + (1 if w.model.moe_capacity_factor <= 0 else 0) + (n if w.fp8_dispatch else 0)  # (fp8: each chunk's scales)
            calls = fwd_calls + 2 * n + (fwd_calls if L.recompute in ("full", "op") else 0)  # recomputed: the forward's
            add("ep", n_micro * calls * ep_layers, n_micro * ep_bytes)
        for dim, calls, sent in self.optimizer.collectives(self, L, layers0):  # (Muon's exchange)
            add(dim, calls, sent)
        return {d: {"count": int(round(x[0])), "bytes": x[1]} for d, x in sorted(out.items())}
