"""Search bounds: a step time no variant of a structure can beat (``lower_bound``, its
terms ``bound_terms``/``bound_sums``, the compute floor shared by structures with the
same layer terms) and the data-parallel and optimizer floor (``_bound_rest_of``)."""

from __future__ import annotations

from meshfold.planner.counts import BUCKET_BYTES, DTYPE_BYTES, FSDP_WIRE
from meshfold.planner.workload import Layout
from meshfold.schedules import get_schedule


# The expert all-to-all chunkings the layout search tries with ep > 1 (parallel.ep_overlap_chunks).
EP_CHUNKS = (1, 2, 4)


class SearchBounds:
    """``CostModel``'s bounds for the branch-and-bound search (``search.py``)."""

    def lower_bound(self, L: Layout, schedules: tuple = ()) -> float:
        """A time no variant of ``L``'s (dp_replicate, dp_shard, tp, sp, pp, cp, cp_mode,
        micro-batch) can beat, whatever its zero stage, recompute and schedule (one of
        ``schedules``, (name, v) pairs): the average stage's forward and backward without
        recompute, the smallest bubble (``bubble_lower_bound``: zbv's without replaying its
        order), the optimizer pass with the most sharding, and the unhideable part of
        data-parallel communication (ZeRO-0/1: the last bucket of the all-reduce; ZeRO-2/3:
        one module's share of one gather and one reduce-scatter), whichever is smaller."""
        n_micro, t_f, t_b, rest = self.bound_terms(L.pp, L.dp_shard, L.dp, L.cp, L.tp, L.sp, L.cp_mode,
                                                   max(1, L.ep), L.micro_batch, L.cp_ulysses)
        bubble = 0.0
        if L.pp > 1 and not self.bubble_free(L.world):
            bubble = min(get_schedule(sched).bubble_lower_bound(L.pp, n_micro, v, t_f, t_b) for sched, v in schedules)
        return self.bound_of(n_micro, t_f, t_b, bubble, rest)

    @staticmethod
    def bound_of(n_micro: int, t_f: float, t_b: float, bubble: float, rest: float) -> float:
        """``lower_bound`` from its terms with a given bubble (the search bounds each
        schedule's variants with that schedule's own bubble). A hair below: sums grouped by
        layer kind may round differently from the stage sums, and zbv's replay rounds too."""
        return (n_micro * (t_f + t_b) + bubble + rest) * (1 - 1e-12)

    def bubble_free(self, world: int) -> bool:
        """Processes sharing a host's cores: a bubble can cost nothing (``_pipeline``)."""
        return bool(self.c.host_cores and world > self.c.host_cores)

    def bound_terms(self, pp: int, dp_shard: int, dp: int, cp: int, tp: int, sp: bool, cp_mode: str, ep: int,
                    b: int, ulysses: int = 0) -> tuple[int, float, float, float]:
        """``lower_bound``'s terms of a structure: (micro-batches, the average stage's
        forward and backward per micro-batch, the optimizer, small collectives, data
        parallel and fixed overhead). Sums over the layer kinds are cached per layer terms
        and the data-parallel terms per (stage parameters, tp, shards, replicas): the
        search asks for every structure."""
        w = self.w
        sums = self.bound_sums(tp, sp, cp, cp_mode, ep, b, ulysses)
        n_micro = w.global_batch // dp // b
        # the slowest stage is at least the average one, whatever the split or schedule
        t_f, t_b, P = sums[0] / pp, sums[1] / pp, sums[2] / pp  # P: the average stage's parameters
        world = dp * cp * tp * pp
        key = (P, tp, dp_shard * cp, dp * cp, world)
        rest = self._bound_rest.get(key)
        if rest is None:
            rest = self._bound_rest[key] = self._bound_rest_of(*key)
        return n_micro, t_f, t_b, rest

    def bound_sums(self, tp: int, sp: bool, cp: int, cp_mode: str, ep: int, b: int,
                   ulysses: int = 0) -> tuple[float, float, float]:
        """The whole model's forward and backward per micro-batch and its parameters, per
        device of a tp x cp group with micro-batch ``b`` (``bound_terms``' sums over the
        layer kinds; with ep > 1 the least of every exchange chunking the search tries,
        ``EP_CHUNKS``). Cached per layer terms."""
        tkey = (tp, sp, cp, cp_mode, ep, b, ulysses)
        sums = self._bound_sums.get(tkey)
        if sums is None:
            options = []
            for chunks in (EP_CHUNKS if ep > 1 else (1,)):
                T = self.layer_terms(tp, sp, cp, cp_mode, ep, b, "none", ulysses, chunks)
                kinds, counts = T.kinds, self.kind_counts
                options.append((sum(kinds[k].fwd * n for k, n in counts.items()) + T.time.out_fwd,
                                sum(kinds[k].bwd * n for k, n in counts.items()) + T.time.out_bwd,
                                sum(kinds[k].params * n for k, n in counts.items()) + T.params.emb + T.params.pos_emb))
            sums = self._bound_sums[tkey] = tuple(min(o[i] for o in options) for i in range(3))
        return sums

    def compute_floor(self, tp: int, sp: bool, cp: int, cp_mode: str, ep: int, b: int, world: int) -> float:
        """A floor under ``bound_terms``' compute, n_micro (t_f + t_b), of every structure
        with these layer terms on ``world`` devices, whatever its pp and dp: n_micro =
        global batch / (dp b) and t = sums / pp, where dp pp = world / (tp cp), so the
        product is the same for all of them (a hair below it: they round differently)."""
        f, bwd, _ = self.bound_sums(tp, sp, cp, cp_mode, ep, b)
        return self.w.global_batch * tp * cp / (world * b) * (f + bwd) * (1 - 1e-9)

    def _bound_rest_of(self, P: float, tp: int, n_shard: int, n_all: int, world: int) -> float:
        w, c, m = self.w, self.c, self.w.model
        pb, gb, ob, act = DTYPE_BYTES[w.dtype]
        opt = P * ((pb + gb + ob) * 2 + 3 * gb) / max(1, n_shard) / self.bw
        small = self.small_collectives(world)
        dp = 0.0
        if n_all > 1:
            t_ar = self.ct("all_reduce", P * gb, n_all, tp)
            dp = t_ar * min(1.0, BUCKET_BYTES / max(P * gb, 1.0))
            if n_shard > 1:  # FSDP: at least each collective's share of one module, once
                wg, wr = FSDP_WIRE[w.dtype]
                t_once = (self.ct("all_gather", P * wg, n_shard, tp)
                          + self.ct("reduce_scatter", P * wr, n_shard, tp))
                dp = min(dp, t_once / (m.n_layers + 4))
        return opt + small + dp + c.step_overhead_s
