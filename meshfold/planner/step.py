"""Step time: the pipeline's makespan, the data-parallel traffic left exposed after
overlap with compute, the optimizer pass, casts and copies, the small all-reduces and the
fixed overhead (``CostModel.step_time``, and ``step_bound`` for the search)."""

from __future__ import annotations

from meshfold.planner.counts import BUCKET_BYTES, DTYPE_BYTES, FSDP_WIRE, buckets, zero1_gather
from meshfold.planner.fp8 import fp8_gathered_params
from meshfold.planner.terms import LayerTerms
from meshfold.planner.workload import Layout


# Bytes a parameter Megatron's fp16 optimizer step moves (``Workload.fp16_optimizer``), pass by
# pass as its ``optimizer.py`` runs them over fp32 main gradients: unscale and inf check
# (read, write: 8), the gradient norm (read: 4) and clipping's scale (8), Adam on the fp32
# main parameter, gradient and moments (read 16, write 12), the copy of the main parameters
# into the fp16 model's (4 + 2) and the gradient buffer's zeroing (4)
MEGATRON_OPTIMIZER_BYTES = 8 + 4 + 8 + 28 + 6 + 4

ENDLESS = 1e30  # ``step_bound``'s compute window: long enough to hide any traffic the model can hide


class StepTime:
    """``CostModel``'s step time and its data-parallel exposure."""

    def step_time(self, L: Layout) -> float:
        """``estimate(L).step_time_s`` alone (the search's inner loop: no memory, no breakdown)."""
        return self._step(L)[0]

    def step_bound(self, L: Layout) -> float:
        """A time ``L`` with any recompute cannot beat (``L.recompute`` should be "none"):
        its step time with the schedule's ``bubble_lower_bound`` (zbv: no replay) and the data-
        parallel traffic with endless compute to hide behind (recompute only lengthens the
        backward: the pipeline takes no less, the traffic finds no shorter windows)."""
        return self._step(L, bound=True)[0] * (1 - 1e-12)

    def _step(self, L: Layout, bound: bool = False):
        """The step time and the parts ``estimate`` reports (one code path for both);
        ``bound``: for ``step_bound``."""
        w, c = self.w, self.c
        pb, gb, ob, act = DTYPE_BYTES[w.dtype]
        tp, cp = L.tp, L.cp
        v = L.virtual
        dp, b = L.dp, L.micro_batch
        if w.global_batch % dp or (w.global_batch // dp) % b:
            raise ValueError(f"global batch {w.global_batch} does not split into dp={dp} x micro_batch={b}")
        n_micro = w.global_batch // dp // b
        T = self.layer_terms(tp, L.sp, cp, L.cp_mode, max(1, L.ep), b, L.recompute, L.cp_ulysses,
                             L.ep_overlap_chunks, L.expert_tp)
        p2p, stages, last_rank, t_f, t_b, stage_params, stage_layers, makespan, bubble = self._pipeline(
            L, T, n_micro, v, bound)
        Pmax = max(stage_params)
        window = (ENDLESS, ENDLESS) if bound else (t_f, t_b)
        largest = stages[stage_params.index(Pmax)]  # the stage with the most parameters: {is MoE: blocks}
        Emax = largest.get(True, 0) * T.params.expert_p  # its routed experts (ep > 1)
        F8 = fp8_gathered_params(w, largest)  # of them FSDP2 gathers in fp8
        # (memoised on what it reads: layouts differing in sp, cp's mode or, with bounded
        # windows, the micro-batch size share it)
        dkey = (L.zero, L.dp_shard, L.dp_replicate, tp, cp, L.ep, L.pp, L.pp_schedule, v, T.params.emb,
                T.params.final_norm, Pmax, stage_layers[0], n_micro, *window, Emax, F8)
        dp_exposed = self._dp_cache.get(dkey)
        if dp_exposed is None:
            dp_exposed = self._dp_cache[dkey] = self._dp_exposed(L, T, Pmax, stage_layers, n_micro, *window, v, Emax,
                                                                 F8)

        # ---- optimizer step: one memory-bound pass over the local states, after gradient
        # clipping's norm (reads each gradient) and scale (reads and writes it: meshfold's
        # optim/clip.py, Megatron's clip_grad_norm)
        n_shard = L.dp_shard * cp
        shards = n_shard if L.zero >= 1 else 1
        opt_bytes = MEGATRON_OPTIMIZER_BYTES if w.fp16_optimizer else (pb + gb + ob) * 2 + 3 * gb
        opt_time = Pmax * opt_bytes / shards / self.bw
        opt_time += self.optimizer.step_time(self, L, stage_layers[0])  # (Muon: Newton-Schulz, its exchange)
        # bf16 compute from fp32 weights without FSDP's bf16 gathers (parallel/compute_weights.py):
        # every weight is cast to bf16 once a step (4 + 2 bytes); each micro-batch its bf16
        # gradient is cast back (2 + 4) and accumulated into the fp32 gradient (4 + 4 + 4)
        fsdp = L.zero >= 2 and n_shard > 1
        casts = ((6 + n_micro * 18) * Pmax / self.bw if (w.dtype == "bf16-amp" and not fsdp and c.device.gemm_tile)
                 else 0.0)
        if w.dtype != "bf16-amp" and not w.wgrad_fused and c.device.gemm_tile:
            # each micro-batch after the first adds its weight gradients into the held ones
            # (autograd's .grad accumulation, Megatron 2021's main_grad hook): read both, write one
            casts += (n_micro - 1) * 3 * gb * Pmax / self.bw
        if fsdp and c.device.gemm_tile:
            # FSDP2's copy-out of every all-gather into the parameters (read and write the
            # gathered bytes: each micro-batch forward and backward under ZeRO-3, once under
            # ZeRO-2) and copy-in of the gradients to the reduce-scatter buffer (read in the
            # compute dtype, write in the reduce dtype), on the compute stream
            wg, wr = FSDP_WIRE[w.dtype]
            gathers = 2 * n_micro if L.zero == 3 else 1
            casts += Pmax * (gathers * 2 * wg + act + wr) / self.bw
        # loss, token count and grad-norm all-reduces over everyone: latency-bound
        small = self.small_collectives(L.world)
        step = makespan + dp_exposed + opt_time + casts + small + c.step_overhead_s
        return step, (T, n_micro, v, p2p, stages, last_rank, t_f, t_b, stage_params, stage_layers, bubble,
                      dp_exposed, opt_time, casts, small)

    def _dp_exposed(self, L: Layout, T: LayerTerms, Pmax: float, stage_layers: list, n_micro: int,
                    t_f: float, t_b: float, v: int, Emax: float = 0.0, F8: float = 0.0) -> float:
        """Seconds of data-parallel traffic the step waits for (after overlap with compute).
        ``Emax``: the routed-expert parameters among ``Pmax`` (ep > 1), which zero 0/1 reduce
        (and ZeRO-1 gathers) over the edp ranks instead; ``F8``: those FSDP2 gathers in fp8,
        1 byte an element (``train.fp8_all_gather``), as traffic.py counts their bytes."""
        w, c, tp, cp, dp = self.w, self.c, L.tp, L.cp, L.dp
        pb, gb, ob, act = DTYPE_BYTES[w.dtype]
        # strides of each mesh dimension's groups, tp innermost (meshfold/mesh.py)
        # FSDP shards over (dp_shard, cp) flattened: stride tp; replicas stride tp*cp*dp_shard
        st_dps, st_dpr = tp, tp * cp * L.dp_shard
        # ---- data parallel over dp x cp ranks: gradients reduced once per optimizer step
        # (the last micro-batch's backward); ZeRO-1 then gathers the updated parameters;
        # ZeRO-3 gathers parameters per micro-batch (forward, and again in backward).
        n_shard, n_rep, n_all = L.dp_shard * cp, L.dp_replicate, dp * cp
        chunks = L.schedule.chunks_per_rank(L.pp_virtual_stages) if L.pp > 1 else 1
        dp_exposed = 0.0
        fsdp = L.zero >= 2 and n_shard > 1
        if fsdp:
            wg, wr = FSDP_WIRE[w.dtype]
            modules = stage_layers[0] + chunks  # blocks plus each chunk's root
            t_ag = self.ct("all_gather", Pmax * wg - F8 * (wg - 1), n_shard, st_dps)
            t_red = (self.ct("reduce_scatter", Pmax * wr, n_shard, st_dps)
                     + self.ct("all_reduce", Pmax * wr / n_shard, n_rep, st_dpr))
            per_call = (c.collective_overhead_us + c.fsdp_overhead_us) * 1e-6
            red_calls = modules * (2 if n_rep > 1 else 1)

            # What cannot hide, in the runtime's issue order (FSDP2, reshard_after_forward,
            # one module prefetched ahead): a forward's first gathers, the root module's (the
            # embedding, and at pp = 1 the output layer and final norm) and the first block's,
            # with nothing computing beside them; a backward's first, the root's again (at
            # least one block's); the last reduce-scatters, the last block's and the root's.
            # The rest hides behind the compute of the module before it.
            m = w.model
            root = T.params.emb * (2 if (L.pp == 1 and not m.tie_embeddings) else 1) + T.params.final_norm
            block = max(Pmax - root, 0.0) / max(1, stage_layers[0])
            share = max(1.0 / modules, min(1.0, root / max(Pmax, 1.0)))  # the backward's first gather
            first = max(share, min(1.0, (root + block) / max(Pmax, 1.0)))  # the forward's first two
            slow = c.device.overlap_slowdown

            def exposed(t: float, window: float, floor: float) -> float:
                """Seconds ``t`` of traffic costs beside ``window`` of compute: what does not
                hide (at least ``floor``), and the contention of what does (the compute it
                overlaps slowed by ``overlap_slowdown``)."""
                shown = max(t - c.overlap * window, floor)
                return shown + slow * (t - shown)

            if L.zero == 3:  # gathers in every micro-batch's forward and backward; the
                # reduction joins them in the last micro-batch's backward
                fwd_g = exposed(t_ag, t_f, t_ag * first)
                comm_t = ((n_micro - 1) * (fwd_g + exposed(t_ag, t_b, t_ag * share))
                          + fwd_g + exposed(t_ag + t_red, t_b, (t_ag + t_red) * share))
                calls = n_micro * 2 * modules + red_calls
            elif n_micro == 1:  # ZeRO-2, one micro-batch: gather and reduce in one pass
                comm_t, calls = exposed(t_ag + t_red, t_f + t_b, (t_ag + t_red) * share), modules + red_calls
            else:  # ZeRO-2: gathered in the first forward and kept; reduced in the last backward
                comm_t, calls = exposed(t_ag, t_f, t_ag * first) + exposed(t_red, t_b, t_red * share), \
                    modules + red_calls
            dp_exposed = comm_t + calls * per_call
        elif n_all > 1:
            # DDP / manual buckets: all-reduce of the gradients in 25 MB buckets during the
            # last micro-batch's backward; ZeRO-1 then all-gathers the updated shards.
            # With ep > 1 the experts go over edp (ep innermost: stride tp * ep), the rest over dp x cp.
            edp = n_all // max(1, L.ep)
            t_ar = self.ct("all_reduce", (Pmax - Emax) * gb, n_all, tp)
            calls = buckets((Pmax - Emax) * gb)
            if Emax and edp > 1:
                t_ar += self.ct("all_reduce", Emax * gb, edp, tp * L.ep)
                calls += buckets(Emax * gb)
            t_z1 = 0.0
            if L.zero == 1 and n_shard > 1 and self.optimizer.zero_one_shards:  # (Muon: its own gather)
                zb, flat = zero1_gather(w.dtype, tp, L.ep)
                t_z1 = self.ct("all_gather", (Pmax - Emax) * zb, n_shard, st_dps)
                calls += 1 if flat else buckets(Pmax * zb)
                if Emax and edp > 1:
                    t_z1 += self.ct("all_gather", Emax * zb, edp, tp * L.ep)
                    calls += 1
            last_bucket = t_ar * min(1.0, BUCKET_BYTES / max(Pmax * gb, 1.0))
            shown = max(t_ar - c.overlap * t_b / v, last_bucket)
            # (the hidden buckets slow the backward they overlap: contention, as for FSDP's)
            dp_exposed = (shown + c.device.overlap_slowdown * (t_ar - shown) + t_z1
                          + calls * c.collective_overhead_us * 1e-6)
        return dp_exposed
