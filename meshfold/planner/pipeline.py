"""Pipeline time: the stage split (as the runtime's ``stage_split_of``), which blocks each
pp rank holds (stage -> rank as the schedule lays them out), the slowest stage's
forward and backward per micro-batch, and the schedule's makespan and bubble
(the layout's schedule object, ``meshfold/schedules/``; per-micro-batch paths over
priced links where the schedule is priced as paths)."""

from __future__ import annotations

from meshfold.models.stage_balance import stage_split_of
from meshfold.parallel.pp.p2p_plan import nccl_check
from meshfold.planner import mtp
from meshfold.planner.terms import LayerTerms
from meshfold.planner.workload import Layout
from meshfold.schedules.skippipe.paths import link_table, plan_orders, table_step_time


class PipelineTime:
    """``CostModel``'s pipeline stages and schedule time."""

    def stage_split(self, L: Layout) -> list[int]:
        """Blocks per pipeline stage (stage order), as ``parallel/pp/stage_modules.py::stage_split``
        builds them; cached per (stages, pp_split) -- the model is fixed per CostModel."""
        n = L.pp * L.schedule.chunks_per_rank(L.pp_virtual_stages) if L.pp > 1 else 1
        key = (n, tuple(L.pp_split))
        hit = self._split_cache.get(key)
        if hit is None:
            hit = self._split_cache[key] = stage_split_of(self.w.model, n, L.pp_split)[0]
        return hit

    def stage_kinds(self, L: Layout) -> tuple[list[dict], int]:
        """Per pipeline rank, its blocks by kind ({is_moe: count}) over all its chunks, and
        the rank holding the last stage (the output layer): pp - 1, or 0 under zbv's V."""
        key = (L.pp, L.pp_schedule, L.virtual, tuple(L.pp_split)) if L.pp > 1 else (1, tuple(L.pp_split))
        hit = self._stage_cache.get(key)
        if hit is None:
            split = self.stage_split(L)
            ranks = [dict() for _ in range(L.pp)]
            start = 0
            for stage, n in enumerate(split):
                rank = L.schedule.rank_chunk_of_stage(L.pp, stage)[0] if L.pp > 1 else 0
                for i in range(start, start + n):
                    ranks[rank][self.kinds[i]] = ranks[rank].get(self.kinds[i], 0) + 1
                start += n
            last = L.schedule.rank_chunk_of_stage(L.pp, len(split) - 1)[0] if L.pp > 1 else 0
            for kind in self.mtp_kinds:
                ranks[last][kind] = ranks[last].get(kind, 0) + 1
            hit = self._stage_cache[key] = (ranks, last)
        return hit

    def stage_block_kinds(self, L: Layout) -> list[dict]:
        """Per pipeline stage (stage order), its blocks by kind ({is_moe: count}); cached
        per stage split."""
        split = self.stage_split(L)
        key = ("kinds", tuple(split))
        hit = self._split_cache.get(key)
        if hit is None:
            hit, start = [], 0
            for n in split:
                counts: dict = {}
                for i in range(start, start + n):
                    counts[self.kinds[i]] = counts.get(self.kinds[i], 0) + 1
                hit.append(counts)
                start += n
            self._split_cache[key] = hit
        return hit

    def _stage_sums(self, T: LayerTerms, stages: list, last_rank: int, pp: int, v: int, p2p: float):
        """Per-micro-batch forward/backward of the slowest stage, total busy time over
        stages, and each stage's parameters and layer count (cached per layer terms)."""
        fs, bws, stage_params, stage_layers = self._stage_base(T, stages, last_rank, pp)
        hop = v * p2p  # each of the rank's v chunks sends forward and backward (pp > 1)
        t_f = t_b = busy_sum = 0.0
        for f, bw in zip(fs, bws):
            if pp > 1:
                f, bw = f + hop, bw + hop
            t_f, t_b = max(t_f, f), max(t_b, bw)
            busy_sum += f + bw
        return t_f, t_b, busy_sum, stage_params, stage_layers

    def _stage_base(self, T: LayerTerms, stages: list, last_rank: int, pp: int):
        """``_stage_sums``' per-rank forward and backward before the point-to-point hops, and
        its parameters and layers per rank (cached per layer terms and stage kinds: the hops
        differ with the data-parallel split)."""
        key = (id(T), id(stages), pp)
        hit = self._stage_base_cache.get(key)
        if hit is not None:
            return hit
        m = self.w.model
        kinds = T.kinds
        fs, bws, stage_params, stage_layers = [], [], [], []
        for st, counts in enumerate(stages):
            f = sum(kinds[k].fwd * n for k, n in counts.items())
            bw = sum(kinds[k].bwd * n for k, n in counts.items())
            params = sum(kinds[k].params * n for k, n in counts.items())
            if st == 0:
                params += T.params.emb + T.params.pos_emb
                f, bw = f + T.time.emb_ops[0] * T.time.tp_ar, bw + T.time.emb_ops[1] * T.time.tp_ar
            if st == last_rank:
                f, bw = f + T.time.out_fwd, bw + T.time.out_bwd
                f += T.time.out_ops[0] * T.time.tp_ar + 3 * T.time.loss_t
                bw += T.time.out_ops[1] * T.time.tp_ar + T.time.norm_t
                params += (0 if (m.tie_embeddings and pp == 1) else T.params.emb) + T.params.final_norm
                # multi-token prediction's heads after the trunk (none: adds nothing)
                heads_f, heads_b, heads_p = mtp.heads_terms(m, T, pp)
                f, bw, params = f + heads_f, bw + heads_b, params + heads_p
            fs.append(f)
            bws.append(bw)
            stage_params.append(params)
            stage_layers.append(sum(counts.values()))
        hit = self._stage_base_cache[key] = (fs, bws, stage_params, stage_layers)
        return hit

    def _pipeline(self, L: Layout, T: LayerTerms, n_micro: int, v: int, bound: bool = False):
        """Per-stage compute, the schedule's makespan and bubble: (p2p per hop, stage kinds,
        the rank holding the last stage, t_f, t_b of the slowest stage, parameters and blocks per pp rank, makespan, bubble).
        Cached: a structure's zero stages share it."""
        key = (id(T), L.pp, L.pp_schedule, v, L.pp_split, L.pp_links, L.pp_skip, L.pp_reorder, L.tp, L.cp, L.dp,
               n_micro, bound)
        hit = self._pipeline_cache.get(key)
        if hit is None:
            hit = self._pipeline_cache[key] = self._pipeline_of(L, T, n_micro, v, bound)
        return hit

    def _pipeline_of(self, L: Layout, T: LayerTerms, n_micro: int, v: int, bound: bool):
        c, tp, pp, cp, dp = self.c, L.tp, L.pp, L.cp, L.dp
        st_pp = tp * cp * dp  # pp groups' stride, tp innermost (meshfold/mesh.py)
        if pp > 1:  # point-to-point to the next stage, over the link the pp dimension spans,
            # and the executor's fixed work around each stage operation
            alpha, beta = self.link(st_pp, pp)
            p2p = alpha + T.traffic.p2p_bytes / beta + c.pipeline_op_us * 1e-6
            if self.w.pp_scatter_gather and tp > 1 and not L.sp:
                # Megatron's scatter/gather (Narayanan et al. 2021, 4.1): each tp rank sends
                # its 1/tp of the replicated activations, the receiving ranks all-gather them
                p2p = (alpha + T.traffic.p2p_bytes / tp / beta + self.ct("all_gather", T.traffic.p2p_bytes, tp, 1)
                       + c.pipeline_op_us * 1e-6)
        else:
            p2p = 0.0
        stages, last_rank = self.stage_kinds(L)
        skey = (id(T), id(stages), pp, v, p2p)
        hit = self._stage_sum_cache.get(skey)
        if hit is None:
            hit = self._stage_sums(T, stages, last_rank, pp, v, p2p)
            self._stage_sum_cache[skey] = hit
        t_f, t_b, busy_sum, stage_params, stage_layers = hit
        schedule = L.schedule
        if pp > 1 and schedule.priced_as_paths(bool(L.pp_links)):
            makespan = self._path_time(L, T, n_micro, t_f - p2p, t_b - p2p, p2p)
            bubble = max(0.0, makespan - n_micro * (t_f + t_b))
        elif bound:  # (step_bound: the bound, without replaying an order; exact for the closed forms)
            bubble = schedule.bubble_lower_bound(pp, n_micro, v, t_f, t_b)
            makespan = n_micro * (t_f + t_b) + bubble
        else:
            makespan, bubble = schedule.pipeline_time(pp, n_micro, v, t_f, t_b)
        if c.host_cores and L.world > c.host_cores and pp > 1:
            # Processes sharing host_cores cores: the calibrated rate is with every process
            # busy; a stage waiting in the bubble frees its core, so the step is the larger
            # of the total work over the cores (the average stage, no bubble) and the
            # critical path run at the faster rate of a less crowded host.
            host_bound = n_micro * busy_sum / pp
            critical = makespan * c.host_cores / L.world
            shared = max(host_bound, critical)
            bubble = max(0.0, shared - n_micro * (t_f + t_b))
            makespan = shared
        return p2p, stages, last_rank, t_f, t_b, stage_params, stage_layers, makespan, bubble

    def _path_time(self, L: Layout, T: LayerTerms, n_micro: int, t_f: float, t_b: float, p2p: float) -> float:
        """One step of stage-per-rank paths (``schedules/skippipe/paths.py``: 1F1B without skips)
        over links priced one by one: ``p2p`` on the cluster's link, ``alpha + bytes/rate``
        on the ``pp_links``; the slowest stage's times on every stage."""
        slow = {(a, b): p2p - T.traffic.p2p_bytes / self.link(L.tp * L.cp * L.dp, L.pp)[1] + T.traffic.p2p_bytes * 8 / (r * 1e6)
                for a, b, r in L.pp_links}
        stage_s = tuple((t_f, t_b) for _ in range(L.pp))
        links = link_table(L.pp, p2p, slow)
        schedule = L.schedule
        paths, _ = plan_orders(L.pp, n_micro, *schedule.path_options(L), stage_s, links, nccl_check(schedule))
        return table_step_time(L.pp, paths, stage_s, links)
