"""Memory per device: model states by ZeRO stage (experts sharded their own way), gathered
parameter copies, the activations each pp rank holds at its fullest moment (the
schedule's held counts), the recompute working set, the loss's logits, buffers and the
reserved memory; the peak and the floors the search prunes with."""

from __future__ import annotations

from functools import lru_cache

from meshfold.parallel.facts.expert_tp import local_experts
from meshfold.parallel.facts.sizes import CHUNK_ELEMENTS, expert_shard_padding, router_padding
from meshfold.planner import mtp
from meshfold.planner.cluster import GiB
from meshfold.planner.counts import (
    BUCKET_BYTES,
    DTYPE_BYTES,
    FSDP_WIRE,
    autocast_input_copies,
    model_state_bytes,
)
from meshfold.planner.terms import LayerTerms
from meshfold.planner.workload import Layout
from meshfold.schedules import Schedule
from meshfold.schedules.held import held_peak


class Memory:
    """``CostModel``'s memory terms."""

    def peak_memory(self, L: Layout) -> float:
        """``estimate(L).peak_mem_bytes`` without the step time (the search prunes by memory
        before it prices): the stage split and the memory terms alone, cached alike."""
        v = L.virtual
        n_micro = self.w.global_batch // L.dp // L.micro_batch
        T = self.layer_terms(L.tp, L.sp, L.cp, L.cp_mode, max(1, L.ep), L.micro_batch, L.recompute, L.cp_ulysses,
                             L.ep_overlap_chunks, L.expert_tp)
        stages, last_rank = self.stage_kinds(L)
        _, _, stage_params, stage_layers = self._stage_base(T, stages, last_rank, L.pp)
        return self._memory(L, T, stage_params, stage_layers, last_rank, n_micro, v)[2]

    def _memory(self, L: Layout, T: LayerTerms, stage_params: list, stage_layers: list, last_rank: int, n_micro: int,
                v: int):
        """The fullest device's bytes: (model states, memory by kind, peak, activation bytes)."""
        w, c, tp, pp, cp = self.w, self.c, L.tp, L.pp, L.cp
        pb, gb, ob, act = DTYPE_BYTES[w.dtype]
        V = w.model.vocab_size
        Pmax = max(stage_params)
        max_block = max(k.params for k in T.kinds.values())
        n_shard, n_all = L.dp_shard * cp, L.dp * cp
        fsdp = L.zero >= 2 and n_shard > 1
        # ---- memory on the fullest device (stage 0 holds the most in-flight activations)
        states, zero, accumulate, moe_layers = self._top_states(L, T, stage_params, n_micro)
        if accumulate and zero >= 2 and pp > 1 and L.schedule.chunks_per_rank(L.pp_virtual_stages) > 1:
            # a rank's chunks reduce their gradients each at its own last backward: the
            # unsharded ones are only those still accumulating at the fullest moment
            states = {**states, "grads": states["grads"] * self._grad_share(L, T, n_micro, L.dp_shard * cp)}
        # Gathered parameter copies (FSDP2, in the compute dtype): ZeRO-2 keeps every block of
        # the rank gathered from its first forward to the step's last backward; ZeRO-3 the
        # running block and the prefetched next one.
        # Without FSDP, under bf16: the step's compute copies of every local parameter
        # (parallel/compute_weights.py), made at its first forward and kept to its last backward.
        wg = FSDP_WIRE[w.dtype][0]
        amp = w.dtype == "bf16-amp"
        gathered = (Pmax * wg if L.zero == 2 else 2 * max_block * wg) if fsdp else (act * Pmax if amp else 0.0)
        full = L.recompute == "full"
        tokens = T.tokens
        logits_here = pp == 1 or last_rank == 0  # zbv's V puts the last stage on rank 0 too
        held, held_logits = self._rank_activations(L, T, n_micro)
        acts = max(held)
        self._acts_cache[self._acts_key(L, n_micro)] = acts
        # the recompute working set while one block is recomputed and run backward: under full,
        # all of its activations; under op, what the policy did not keep
        if full:
            recompute = T.acts.act_full
        elif L.recompute == "op":
            recompute = max(0.0, T.acts.act_full - T.acts.act_kept)
        else:
            recompute = 0.0
        # the loss's moment (parallel/loss.py's chunked cross-entropy, in backward): the logits
        # as they came, their gradient in the same dtype, one chunk's fp32 scratch when that
        # dtype is narrower; per token the saved label index, two masks and the log-sum-exp.
        # An H200 measured 4.8 B per logit at the peak (llama3.2-1b, 8,192 tokens x 128,256,
        # bf16; docs/gpu.md) when the loss kept four fp32 chunk copies, which this gave as 4.5.
        scratch = 4 * min(CHUNK_ELEMENTS, tokens * V / tp) if act < 4 else 0.0
        logits = 2 * act * tokens * V / tp + scratch + 14 * tokens
        buffers = 2 * min(BUCKET_BYTES, Pmax * gb) if (n_all > 1 and not fsdp) else 0.0
        reserved = c.device.reserved_gib * GiB
        memory = {**states, "gathered_params": gathered, "activations": acts,
                  "recompute": recompute, "logits": logits if logits_here else 0.0,
                  "buffers": buffers, "reserved": reserved}
        # the peak is the worst moment of the step, not a sum of maxima: the loss (the logits
        # next to the in-flight activations) or the first backward's recompute (the working
        # set next to them; the logits are freed by then)
        base = sum(states.values()) + gathered + acts + buffers + reserved
        peak_mem = base + max(memory["logits"], recompute)
        activation_bytes = max(held_logits)
        if pp > 1 and last_rank > 0:  # the last stage holds the logits but fewer in-flight micro-batches
            last = self._model_states(L, T, stage_params[last_rank], moe_layers[last_rank], zero, accumulate)
            peak_mem = max(peak_mem, sum(last.values()) + gathered + held[last_rank] + buffers + reserved
                           + max(logits, recompute))
        return states, memory, peak_mem, activation_bytes

    def _rank_activations(self, L: Layout, T: LayerTerms, n_micro: int) -> tuple[list, list]:
        """Per pipeline rank, the most activation bytes it holds at once, without and with the
        last stage's saved logits (``_held``; at pp = 1 the one rank's blocks)."""
        w, m, tp, cp, b = self.w, self.w.model, L.tp, L.cp, L.micro_batch
        act = DTYPE_BYTES[w.dtype][3]
        V, h = m.vocab_size, m.dim
        amp = w.dtype == "bf16-amp"
        tokens = T.tokens
        # bf16 compute weights in every layout (FSDP2's gathers or the step's compute copies):
        # the blocks take bf16 inputs, and the projections share one bf16 norm output
        per_layer = dict(T.acts.act_kinds)
        if amp and L.recompute not in ("full", "op"):
            per_layer = {k: x - autocast_input_copies(m, w.s // cp, b, act, tp, L.sp) for k, x in per_layer.items()}
        stage_in = 0.0 if amp else act * tokens * h  # (amp: layer 0's norm input, counted there)
        # what the loss keeps for backward: the logits as they came (parallel/loss.py's
        # chunked cross-entropy recomputes each chunk's softmax in backward) and the int64
        # labels; with amp also the final norm (8h + 4; sequence-sharded under sp)
        saved_logits = (act * V / tp + 8) * tokens + ((8 * h + 4) * tokens / (tp if L.sp else 1) if amp else 0.0)
        saved_logits = mtp.saved_logits(m, saved_logits, act, amp, tokens)  # and the heads after the trunk
        if L.pp == 1:
            acts = sum(per_layer[k] * n for k, n in self.stage_kinds(L)[0][0].items()) + stage_in
            return [acts], [acts + saved_logits]
        # every rank's chunks, each held from its forward to its backward in the rank's order
        return self._held(L, per_layer, stage_in, saved_logits, n_micro)

    def rank_footprints(self, L: Layout) -> list[dict]:
        """Per pipeline rank (pp coordinate order), the footprint ``Estimate.footprint`` gives
        for the fullest: its parameter, gradient and optimizer bytes (``_model_states``; at
        the rank's own fullest moment on multi-chunk pipelines) and activation bytes (with
        the saved logits where it holds the last stage). ``meshfold dry-run`` sets them
        beside the ranks it simulates; the search never asks."""
        n_micro = self.w.global_batch // L.dp // L.micro_batch
        T = self.layer_terms(L.tp, L.sp, L.cp, L.cp_mode, max(1, L.ep), L.micro_batch, L.recompute, L.cp_ulysses,
                             L.ep_overlap_chunks, L.expert_tp)
        stages, last_rank = self.stage_kinds(L)
        stage_params = self._stage_base(T, stages, last_rank, L.pp)[2]
        _, zero, accumulate, moe_layers = self._top_states(L, T, stage_params, n_micro)
        grad_share = [1.0] * L.pp
        if accumulate and zero >= 2 and L.pp > 1 and L.schedule.chunks_per_rank(L.pp_virtual_stages) > 1:
            held, whole = self._rank_grads(L, T, n_micro, L.dp_shard * L.cp)
            grad_share = [x / max(y, 1e-30) for x, y in zip(held, whole)]
        activations = self._rank_activations(L, T, n_micro)[1]
        out = []
        for P, n, share, acts in zip(stage_params, moe_layers, grad_share, activations):
            states = self._model_states(L, T, P, n, zero, accumulate)
            out.append({"param_bytes": states["params"], "grad_bytes": states["grads"] * share,
                        "optimizer_bytes": states["optimizer"], "activation_bytes": acts})
        return out

    def _grad_share(self, L: Layout, T: LayerTerms, n_micro: int, n_shard: int) -> float:
        """The gradients the fullest pp rank holds at its fullest moment
        (``Schedule.rank_grad_moments``: chunks still accumulating whole, chunks already
        reduced as their 1/n_shard share, chunks not yet in backward nothing), as a
        fraction of the largest rank's unsharded gradients."""
        held, whole = self._rank_grads(L, T, n_micro, n_shard)
        return max(held) / max(max(whole), 1e-30)

    def _rank_grads(self, L: Layout, T: LayerTerms, n_micro: int, n_shard: int) -> tuple[list, list]:
        """Per pp rank, the gradient parameters it holds at its fullest moment (see
        ``_grad_share``) and its parameters unsharded. Cached: the search asks often."""
        sched, v = L.schedule, L.virtual
        key = ("grads", L.tp, L.ep, L.pp, L.pp_schedule, v, tuple(L.pp_split), n_micro, n_shard)  # (params: tp, ep)
        hit = self._held_cache.get(key)
        if hit is None:
            kinds, stage_kinds = T.kinds, self.stage_block_kinds(L)
            params = []
            for st, counts in enumerate(stage_kinds):
                p = sum(kinds[k].params * n for k, n in counts.items())
                if st == 0:
                    p += T.params.emb + T.params.pos_emb
                if st == len(stage_kinds) - 1:
                    p += T.params.emb + T.params.final_norm + mtp.extra_params(self.w.model, L.pp, T.params.emb)
                    p += sum(kinds[k].params for k in self.mtp_kinds)
                params.append(p)
            weight = (0.0, 1.0, 1.0 / max(1, n_shard))
            held, whole = [], []
            for rank in range(L.pp):
                mine = [params[sched.stage_of(L.pp, rank, c)] for c in range(sched.chunks_per_rank(v))]
                whole.append(sum(mine))
                held.append(max(sum(p * weight[s] for p, s in zip(mine, moment))
                                for moment in sched.rank_grad_moments(L.pp, v, n_micro, rank)))
            hit = self._held_cache[key] = (held, whole)
        return hit

    def _held(self, L: Layout, per_layer: dict, stage_in: float, saved_logits: float,
              n_micro: int) -> tuple[list, list]:
        """Per pipeline rank, the most activation bytes it holds at once, without and with
        the last stage's saved logits: each chunk's bytes per micro-batch, held from its
        forward to its backward in the rank's order (``schedules/held.py``: the moments
        the dry-run's measurement is taken at too). Cached: the search asks often."""
        v = L.virtual
        key = (L.pp, L.pp_schedule, v, tuple(L.pp_split), n_micro, tuple(sorted(per_layer.items())), stage_in, saved_logits)
        hit = self._held_cache.get(key)
        if hit is None:
            stage_bytes = [sum(per_layer[k] * n for k, n in kinds.items()) + stage_in
                           for kinds in self.stage_block_kinds(L)]
            last = len(stage_bytes) - 1
            stage_bytes[last] += sum(per_layer[k] for k in self.mtp_kinds)
            without, with_logits = [], []
            for stages, counts in _rank_held(L.schedule, L.pp, v, n_micro):
                without.append(held_peak(counts, [stage_bytes[st] for st in stages]))
                with_logits.append(held_peak(counts, [stage_bytes[st] + (saved_logits if st == last else 0.0)
                                                      for st in stages]))
            hit = self._held_cache[key] = (without, with_logits)
        return hit

    def _top_states(self, L: Layout, T: LayerTerms, stage_params: list, n_micro: int):
        """Model states of the pp rank holding the most (``_memory``'s), the zero stage in
        effect, whether gradients accumulate, and MoE layers per pp rank. The fullest rank is
        the one with the most parameters, except where experts are sharded over fewer ranks
        than the rest (ep with zero 0/1: a rank of MoE blocks can hold more than the
        embedding's with more parameters)."""
        zero = L.zero if L.dp_shard * L.cp > 1 else 0  # nothing to shard over: replicated states
        accumulate = n_micro > 1
        moe_layers = [r.get(True, 0) for r in self.stage_kinds(L)[0]]
        if not T.params.expert_p:  # every parameter sharded alike: the rank with the most holds the most
            top = stage_params.index(max(stage_params))
            return self._model_states(L, T, stage_params[top], moe_layers[top], zero, accumulate), zero, \
                accumulate, moe_layers
        ranks = [self._model_states(L, T, P, n, zero, accumulate) for P, n in zip(stage_params, moe_layers)]
        top = max(range(len(ranks)), key=lambda r: (sum(ranks[r].values()), stage_params[r]))
        return ranks[top], zero, accumulate, moe_layers

    @staticmethod
    def _acts_key(L: Layout, n_micro: int) -> tuple:
        # what _memory's activations depend on: the layer terms' key (tp, sp, cp, ep,
        # micro-batch, recompute, ...), the schedule and its split, the micro-batches; not the
        # zero stage or how dp splits into shards and replicas
        sched = (L.pp_schedule, L.virtual) if L.pp > 1 else ()
        return (L.tp, L.sp, L.cp, L.cp_mode, L.ep, L.micro_batch, L.recompute, L.cp_ulysses, L.ep_overlap_chunks,
                L.pp, *sched, tuple(L.pp_split), n_micro, L.expert_tp)

    def activations_if_known(self, L: Layout) -> float | None:
        """``peak_memory``'s activation term for ``L`` if a layout differing only in its zero
        stage or dp split was already priced, else None. With the model states other than
        gradients (``memory_floor``'s, which a sharded gradient share can undercut) it floors
        the peak, so the search skips most layouts that do not fit without pricing them."""
        return self._acts_cache.get(self._acts_key(L, self.w.global_batch // L.dp // L.micro_batch))

    def memory_floor(self, L: Layout, with_grads: bool = False):
        """Bytes ``L`` needs with any recompute: the fullest rank's model states and the
        reserved memory, which the peak holds whatever else it holds (the search skips a
        variant whose floor does not fit without checking each recompute's peak).
        ``with_grads``: (that, the gradients in it)."""
        n_micro = self.w.global_batch // L.dp // L.micro_batch
        v = L.virtual
        # model states depend on the parameters (tp, ep), the stages and how they shard, not
        # on the micro-batch, sp or cp's mode: structures differing only there share it
        key = (L.tp, L.ep, L.pp, L.pp_schedule, v, L.pp_split, L.zero, L.dp_shard, L.cp, L.dp, n_micro > 1, L.expert_tp)
        hit = self._floor_cache.get(key)
        if hit is None:
            T = self.layer_terms(L.tp, L.sp, L.cp, L.cp_mode, max(1, L.ep), L.micro_batch, L.recompute,
                                 L.cp_ulysses, L.ep_overlap_chunks, L.expert_tp)
            stages, last_rank = self.stage_kinds(L)
            states = self._top_states(L, T, self._stage_base(T, stages, last_rank, L.pp)[2], n_micro)[0]
            hit = self._floor_cache[key] = (sum(states.values()) + self.c.device.reserved_gib * GiB, states["grads"])
        return hit if with_grads else hit[0]

    def states_floor(self, L: Layout, zeros) -> float:
        """A floor under ``memory_floor`` of every variant of ``L``'s structure (pp, dp,
        cp, tp, micro-batch) with a zero stage in ``zeros``: the model states of a pp rank
        holding the average stage's blocks and embeddings (the fullest holds at least that)
        and the reserved memory. Dense models only (0.0 with MoE layers: their experts
        shard their own way)."""
        if self._has_moe:
            return 0.0
        ep, u = max(1, L.ep), L.cp_ulysses
        n_micro = self.w.global_batch // L.dp // L.micro_batch
        key = ("states", L.tp, ep, L.pp, L.dp_shard, L.cp, L.dp, n_micro > 1, tuple(sorted(zeros)))  # (as memory_floor's)
        hit = self._floor_cache.get(key)
        if hit is None:
            P = self.bound_sums(L.tp, L.sp, L.cp, L.cp_mode, ep, L.micro_batch, u)[2] / L.pp
            T = self.layer_terms(L.tp, L.sp, L.cp, L.cp_mode, ep, L.micro_batch, "none", u)
            shard = L.dp_shard * L.cp > 1
            hit = self._floor_cache[key] = min(
                sum(self._model_states(L, T, P, 0, z if shard else 0, n_micro > 1).values())
                for z in zeros) + self.c.device.reserved_gib * GiB
        return hit

    def _model_states(self, L: Layout, T: LayerTerms, params: float, moe_layers: int, zero: int,
                      accumulate: bool) -> dict:
        """``model_state_bytes`` of a pipeline rank with ``params`` parameters: sharded over
        dp_shard x cp, except (ep > 1) the routed experts of its ``moe_layers`` MoE layers, an
        own FSDP group over the edp = dp x cp / ep ranks (``parallel/ep/plan.py``)."""
        n_shard = L.dp_shard * L.cp
        experts = moe_layers * T.params.expert_p
        states = model_state_bytes(params - experts, zero, n_shard, self.w.dtype, accumulate)
        if zero == 2:  # meshfold's ZeRO-2 is FSDP2 without resharding after forward: the storage is
            # sharded as under ZeRO-3 (the whole compute-dtype copy the paper's stage 2 keeps is
            # the ``gathered_params`` term)
            states["params"] /= max(1, n_shard)
        if zero >= 2 and moe_layers:  # each router's E rows padded to a multiple of the ranks: the
            # fullest rank holds ceil(E / n) rows of it, its gradient (once reduce-scattered) and states
            pad = moe_layers * router_padding(self.w.model, n_shard)
            padded = model_state_bytes(pad, zero, n_shard, self.w.dtype, accumulate)
            states["params"] += model_state_bytes(pad, 3, n_shard, self.w.dtype)["params"]
            states["grads"] += padded["grads"] if not accumulate else 0.0
            states["optimizer"] += padded["optimizer"]
        if experts:
            edp = L.dp * L.cp // L.ep
            # (zero 0/1: ShardedAdamW's element segments over edp, no padding; zero 0: replicated)
            padding = self._expert_padding(L) if zero >= 2 else 1.0
            sharded = model_state_bytes(experts * padding, zero, edp, self.w.dtype, accumulate)
            whole = model_state_bytes(experts, zero, edp, self.w.dtype, accumulate)
            if zero == 2:
                sharded["params"] /= max(1, edp)
            for k in states:  # gradients held unsharded between micro-batches: not padded
                states[k] += whole[k] if (k == "grads" and accumulate) else sharded[k]
        return self.optimizer.model_states(self, L, states, zero)  # (Muon: one momentum, no ZeRO-1)

    def _expert_padding(self, L: Layout) -> float:
        """The routed experts' bytes per rank (held, all-gathered, reduce-scattered) relative to
        their even share over the edp ranks. Each stacked expert weight [E_l, out, in]
        (E_l = E / (ep tp) local experts) is sharded on the dimension
        ``parallel/facts/sizes.py: expert_shard_dim`` picks, as the runtime does: 1.0 when
        edp divides E_l, out or in; else dim 0 padded to ceil(E_l / edp) experts per rank."""
        m = self.w.model
        E_l, edp = local_experts(m.moe_experts, L.ep, L.tp, L.expert_tp), L.dp * L.cp // L.ep
        if not E_l:
            return 1.0
        # w2 [E_l, dim, hidden] and w1 [E_l, hidden, dim], or with swiglu the fused w13
        # [E_l, 2 hidden, dim] (models/moe.py), weighted by their sizes; experts split
        # inside (expert tp): hidden / tp of each
        wide, f = 2 if m.gated_mlp else 1, m.expert_dim // L.expert_tp
        split = L.expert_tp > 1  # (FSDP2 never shards the dimension tp splits: parallel/ep/plan.py)
        shapes = [((E_l, wide * f, m.dim), wide, (1,) if split else ()), ((E_l, m.dim, f), 1, (2,) if split else ())]
        return sum(n * expert_shard_padding(s, edp, avoid) for s, n, avoid in shapes) / (wide + 1)


@lru_cache(maxsize=1024)
def _rank_held(sched: Schedule, pp: int, v: int, n_micro: int) -> tuple:
    """Per pp rank, (its chunks' stages, ``rank_held_counts``): ``_held``'s per-rank terms."""
    chunks = sched.chunks_per_rank(v)
    return tuple((tuple(sched.stage_of(pp, r, c) for c in range(chunks)),
                  sched.rank_held_counts(pp, v, n_micro, r)) for r in range(pp))
