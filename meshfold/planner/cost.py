"""One cost model: (model, cluster, layout, batch) -> predicted step time and memory per
device, each with a breakdown. ``docs/planner.md`` writes out every equation.

Conventions shared with the runtime:
- a layout is a ``ParallelConfig`` plus ``train.micro_batch`` and ``train.recompute``;
- mesh order (outermost first) pp, dp_replicate, dp_shard, cp, tp (``meshfold/mesh.py``):
  a dimension's groups are ``size`` ranks ``stride`` apart, stride = product of the sizes
  inside it, which decides the link level each group spans (``Cluster.link``);
- communication bytes follow ``meshfold/comm.py`` (bytes a rank sends, ring algorithm),
  per optimizer step, for global rank 0 (what ``metrics.jsonl`` reports as ``comm_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from meshfold.layout import ParallelConfig
from meshfold.models.config import ModelConfig
from meshfold.models.presets import attention_params, ffn_params, mlp_params
from meshfold.models.stage_balance import stage_split_of
from meshfold.parallel.expert_shard import expert_shard_padding
from meshfold.parallel.loss_chunk import CHUNK_ELEMENTS
from meshfold.planner.attention import attention_terms
from meshfold.planner.cluster import GiB, Cluster
from meshfold.planner.counts import (
    BUCKET_BYTES,
    DTYPE_BYTES,
    FSDP_WIRE,
    autocast_input_copies,
    buckets,
    chunk_param_sizes,
    attention_params_local,
    dense_layer_params_local,
    routed_fraction,
    layer_activation_bytes,
    model_state_bytes,
    moe_activation_bytes,
    ddp_buckets,
    reducer_buckets,
    routed_params,
    tp_grad_bytes,
    zero1_gather,
    moe_chunk_param_sizes,
)
from meshfold.planner.kernels import attention_tiles_per_rank, elementwise_bytes, gemm_time, layer_gemms, matmul_efficiency
from meshfold.ring import FACTORS as RING  # bytes a rank sends, per byte (ring algorithm)
from meshfold.ring import HOPS as STEPS  # sequential hops (alpha terms)
from meshfold.schedule import (
    bubble_lower_bound,
    chunks_per_rank,
    held_peak,
    pipeline_time,
    rank_chunk_of_stage,
    rank_grad_moments,
    rank_held_counts,
    stage_of,
)
from meshfold.parallel.skip import nccl_safe
from meshfold.skippipe import link_table, plan_orders, table_step_time

@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the batch and the numerics."""

    model: ModelConfig
    global_batch: int  # sequences per optimizer step
    seq_len: int = 0  # 0 = model.seq_len
    dtype: str = "bf16"  # bf16 | bf16-amp (meshfold's bfloat16: fp32 params) | float32 | float64
    flash: bool = True  # fused attention: no s^2 activations, causal half of the score FLOPs
    dropout: bool = False  # GPT/Megatron-style dropout masks (Korthikanti's 34 sbh)
    # How the memory-bound ops run (the bytes ``elementwise_bytes`` counts): "eager" =
    # one PyTorch kernel per op as meshfold's (and torchtitan's) model code writes them;
    # "fused" = hand-fused kernels (Megatron) or torch.compile's fusions.
    kernels: str = "eager"
    fp8: bool = False  # Float8 linears (torchao): GEMMs at the fp8 peak, plus their casts

    @property
    def s(self) -> int:
        return self.seq_len or self.model.seq_len


@dataclass(frozen=True)
class Layout:
    """A plan: the ``[parallel]`` section plus micro-batch size and recomputation."""

    dp_replicate: int = 1
    dp_shard: int = 1
    zero: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    cp: int = 1
    cp_mode: str = "ring"  # ring | ulysses | hybrid
    cp_ulysses: int = 0  # hybrid: the Ulysses degree (layout_from_config resolves 0 as the runtime)
    ep: int = 1
    ep_overlap_chunks: int = 1  # ep all-to-all pipelined in this many chunks (``parallel.ep_overlap_chunks``)
    micro_batch: int = 1  # sequences per micro-batch on one data-parallel rank
    recompute: str = "none"  # none | selective | op | full (parallel/recompute.py)
    pp_split: tuple = ()  # blocks per stage (``parallel.pp_split``); () = balanced by cost, as the runtime
    # skippipe's skip cap and reorder option, and links between pp ranks slower or faster
    # than the cluster's ((a, b, Mbit/s), ...: ``parallel.pp_links``), priced per link
    pp_skip: float = 0.0
    pp_reorder: bool = False
    pp_links: tuple = ()

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // self.dp // self.micro_batch

    def parallel_config(self, global_batch: int) -> ParallelConfig:
        return ParallelConfig(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                              zero=self.zero if (self.dp_shard * self.cp > 1 or self.zero <= 1) else self.zero,
                              tp=self.tp, sp=self.sp, pp=self.pp, pp_schedule=self.pp_schedule,
                              pp_microbatches=self.microbatches(global_batch) if self.pp > 1 else 0,
                              pp_virtual_stages=self.pp_virtual_stages, cp=self.cp, cp_mode=self.cp_mode,
                              cp_ulysses=self.cp_ulysses if self.cp_mode == "hybrid" else 0,
                              ep=self.ep, ep_overlap_chunks=self.ep_overlap_chunks if self.ep > 1 else 1,
                              pp_split=list(self.pp_split), pp_skip=self.pp_skip,
                              pp_reorder=self.pp_reorder, pp_links=[list(x) for x in self.pp_links])

    def to_toml(self, global_batch: int) -> str:
        p = self.parallel_config(global_batch)
        lines = ["[parallel]"]
        keys = ("dp_replicate", "dp_shard", "zero", "tp", "sp", "pp", "pp_schedule", "pp_microbatches",
                "pp_virtual_stages", "cp", "cp_mode", "ep") + (("pp_split",) if self.pp_split else ())
        for key in keys + (("ep_overlap_chunks",) if self.ep > 1 and self.ep_overlap_chunks > 1 else ()):
            value = getattr(p, key)
            lines.append(f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value).replace(chr(39), chr(34))}")
        lines += ["", "[train]", f"global_batch = {global_batch}",
                  f"micro_batch = {self.micro_batch}", f'recompute = "{self.recompute}"']
        return "\n".join(lines) + "\n"

    def short(self) -> str:
        parts = [f"dp{self.dp_replicate}x{self.dp_shard}", f"z{self.zero}", f"tp{self.tp}" + ("sp" if self.sp else "")]
        if self.pp > 1:
            v = f"v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""
            parts.append(f"pp{self.pp}{self.pp_schedule}{v}" + (f"split{list(self.pp_split)}" if self.pp_split else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}{self.cp_mode}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f"c{self.ep_overlap_chunks}" if self.ep_overlap_chunks > 1 else ""))
        parts += [f"mb{self.micro_batch}", self.recompute]
        return " ".join(parts)


@dataclass
class Estimate:
    layout: Layout
    step_time_s: float
    time: dict  # seconds by component, on the slowest pipeline stage
    memory: dict  # bytes by component, on the device that holds the most
    peak_mem_bytes: float
    fits: bool
    model_flops: float  # per step, whole cluster (3x forward, no recompute)
    mfu: float
    tflops_per_device: float  # model FLOPs / step time / devices
    comm_bytes: dict = field(default_factory=dict)  # rank 0, per step, by dimension
    # What ``meshfold dry-run`` prints next to the runtime (``footprint``): per rank, max
    # over ranks, bytes of parameters, gradients, optimizer states and activations
    # (docs/memory.md defines each term)...
    param_bytes: float = 0.0
    gathered_param_bytes: float = 0.0
    recompute_bytes: float = 0.0
    grad_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activation_bytes: float = 0.0
    # ... and rank 0's collectives per step by mesh dimension: {dim: {"count", "bytes"}}
    collectives: dict = field(default_factory=dict)

    def footprint(self) -> dict:
        return {"param_bytes": self.param_bytes, "gathered_param_bytes": self.gathered_param_bytes,
                "recompute_bytes": self.recompute_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.optimizer_bytes, "activation_bytes": self.activation_bytes,
                "collectives": self.collectives}

    def row(self) -> dict:
        return {"layout": self.layout.short(), "step_time_s": self.step_time_s, "mfu": self.mfu,
                "tflops_per_device": self.tflops_per_device, "peak_mem_bytes": self.peak_mem_bytes,
                "fits": self.fits}


# --------------------------------------------------------------------------- the model

# The expert all-to-all chunkings the layout search tries with ep > 1 (parallel.ep_overlap_chunks).
EP_CHUNKS = (1, 2, 4)
ENDLESS = 1e30  # ``step_bound``'s compute window: long enough to hide any traffic the model can hide



class CostModel:
    """The cost model for one workload on one cluster. Pieces that many layouts share
    (per-layer times, stage splits) are cached, so a search evaluates a layout in tens of
    microseconds; ``estimate`` is the one entry point and gives the same numbers cached
    or not."""

    def __init__(self, w: Workload, cluster: Cluster):
        self.w, self.c = w, cluster
        m = w.model
        self.kinds = [m.is_moe_layer(i) for i in range(m.n_layers)]
        # multi-token prediction: one block per depth on the last stage (models/mtp.py), priced as
        # a block of its kind (a kind the main layers lack is priced as the last layer's)
        self.mtp_kinds = [k if k in self.kinds else self.kinds[-1]
                          for k in (m.is_moe_layer(m.n_layers + d) for d in range(m.mtp_depth))]
        self._layer_cache: dict = {}
        self._gemm_cache: dict = {}  # a block's GEMM times per (tokens, tp, MoE), the logits' per (tokens, tp)
        self._stage_cache: dict = {}
        self._split_cache: dict = {}
        self._held_cache: dict = {}  # _held's per-rank activations
        self._floor_cache: dict = {}  # memory_floor's
        self._acts_cache: dict = {}  # _memory's activations, for ``activations_if_known``
        self._stage_sum_cache: dict = {}
        self._stage_base_cache: dict = {}
        self._pipeline_cache: dict = {}
        self._dp_cache: dict = {}  # _dp_exposed's
        self._small: dict = {}  # small_collectives' per world size
        self._bound_sums: dict = {}  # lower_bound's sums over layer kinds, per layer terms
        self._bound_rest: dict = {}
        self.peak = cluster.device.peak_tflops * 1e12
        self.hbm = cluster.device.hbm_GBps * 1e9
        self.bw = self.hbm * cluster.device.hbm_eff  # what streaming kernels (the optimizer) reach
        self.causal = 0.5 if w.flash else 1.0
        self.kind_counts = {k: (self.kinds + self.mtp_kinds).count(k) for k in set(self.kinds)}
        self._has_moe = True in self.kind_counts
        self._first_moe = self.kinds.index(True) if self._has_moe else 0
        self._attn_p = attention_params(m)
        self._model_cache: dict = {}  # per-layer pieces that depend on tp (and ep) alone
        self._links: dict = {}
        self.flops_model = 3 * w.global_batch * w.s * (2 * _matmul_active(m) + 4 * w.s * m.dim * (m.n_layers + m.mtp_depth) * self.causal)

    def link(self, stride: int, n: int) -> tuple[float, float]:
        """``Cluster.link``, memoised for this model (the search asks millions of times)."""
        key = (stride, n)
        hit = self._links.get(key)
        if hit is None:
            hit = self._links[key] = self.c.link(stride, n)
        return hit

    def small_collectives(self, world: int) -> float:
        """The loss, token count and grad-norm all-reduces over everyone: latency-bound."""
        hit = self._small.get(world)
        if hit is None:
            hit = self._small[world] = 3 * self.ct("all_reduce", 8, world, 1, in_step=True)
        return hit

    def ct(self, op: str, size_bytes: float, n: int, stride: int, in_step: bool = False) -> float:
        """``collective_time`` on this cluster (same formula, memoised links)."""
        if n <= 1 or size_bytes <= 0:
            return 0.0
        alpha, beta = self.link(stride, n)
        if in_step and self.c.in_step_alpha_us > 0:
            alpha = self.c.in_step_alpha_us * 1e-6
        return STEPS[op](n) * alpha + RING[op](n) * size_bytes / beta

    # ---- per layer (one micro-batch on one device), by kind (dense / MoE)
    def layer_terms(self, tp: int, sp: bool, cp: int, cp_mode: str, ep: int, b: int, recompute: str,
                    ulysses: int = 0, ep_chunks: int = 1) -> dict:
        key = (tp, sp, cp, cp_mode, ep, b, recompute, ulysses, ep_chunks)
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
        attn_p = self._attn_p
        norm_p = 2 * m.dim * (2 if (m.norm == "layernorm" and m.bias) else 1)
        # QK^T and AV for this device's queries (latent attention: q/k heads nope + rope wide,
        # v zero-padded to them for the fused kernel, models/llama.py ``CoreAttention``)
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
        act_kinds = {moe: layer_kept(recompute, moe) + (moe_activation_bytes(m, s_loc, b, tp, ep, act, sp, ep_chunks)
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
        # Context parallel (parallel/context.py) over u Ulysses ranks (stride tp) inside R =
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
            cp_fwd += max((R - 1) * hop - attn_f, hop)
            cp_sel += max((R - 1) * hop - attn_f, hop)
            cp_sent += (2 * R - 2) * kv + R * kv * max(4, act) / act
            cp_sent_rec += (R - 1) * kv
            cp_sent_sel += (R - 1) * kv
            cp_calls, cp_calls_rec, cp_calls_sel = cp_calls + 3 * R - 2, cp_calls_rec + R - 1, cp_calls_sel + R - 1
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
            gemms = self._gemm_cache.get(gkey)
            if gemms is None and d.gemm_tile:  # each linear layer's GEMM by its shape
                gemms = [gemm_time(d, tokens, n, k, h / tp, act, w.fp8) for n, k in layer_gemms(m, tp, moe)]
            elif gemms is None:  # a calibrated rate: FLOPs over it (the form calibrate solves)
                gemms = [2 * (attn_p + ffn_active) / tp * tokens / (peak * eff)]
            self._gemm_cache[gkey] = gemms
            ekey = ("ew", tp, sp, moe)  # (bytes per token: the count is linear in the tokens)
            per_token = self._model_cache.get(ekey)
            if per_token is None:
                per_token = self._model_cache[ekey] = elementwise_bytes(m, 1, s, tp, sp, act, amp, w.flash,
                                                                        w.dropout, w.kernels, moe)
            ew_all, ew_attn, ew_sums = (tokens * x for x in per_token)
            if w.fp8:  # Float8 casts: each linear's input (amax read, read, 1-byte write) forward,
                # its output gradient backward, and its weight each micro-batch (both ways)
                ew_all += 5 * tokens * sum(k for _, k in layer_gemms(m, tp, moe)) + 10 * (attn_p + ffn_total) / tp
            ew_f = ew_all * scale
            fwd_c = sum(gemms) + attn_f
            fwd = fwd_c + ew_f + 2 * tp_ar + cp_fwd + (overhead + tile_t) / 3
            if recompute == "full":
                rec = fwd
            elif recompute == "op":
                # torchtitan's op policy: every op recomputed but every other matmul (it
                # saves the 1st, 3rd, ...) and the attention kernel; the block's tp and
                # cp communication is re-run (meshfold's collectives are not kept)
                rec = sum(gemms[1::2]) + ew_f - ew_attn * scale + 2 * tp_ar + cp_fwd
            elif recompute == "selective":  # the attention core and its softmax, with its cp communication
                rec = attn_f + ew_attn * scale + cp_sel
            else:
                rec = 0.0
            bwd = (2 * sum(gemms) + attn_b + 2 * ew_f + ew_sums * scale + (2 + (1.0 if sp else 0.0)) * tp_ar
                   + 2 * cp_fwd + rec + 2 * (overhead + tile_t) / 3)
            ep_sent = 0.0
            if moe and ep > 1:
                # expert parallel: dispatch and combine all-to-alls of the routed tokens
                # (top-k copies of each, every capacity slot under a capacity; with tp each tp
                # rank sends only its expert column's 1/tp) forward, and their transposes
                # backward, over the ep ranks (innermost of dp x cp: stride tp); before them,
                # dropless, the per-expert row counts (E/tp int64)
                # dropless, the per-expert row counts (E/tp int64; per chunk when pipelined)
                routed = act * tokens * m.moe_topk * routed_fraction(m, s) * h / tp
                counts = 8 * m.moe_experts / tp * ep_chunks if m.moe_capacity_factor <= 0 else 0.0
                # pipelined in n chunks (parallel/expert.py ``overlapped_exchange``): the first
                # dispatch and the last combine are exposed; the other 2n - 2 chunk exchanges
                # run while the experts compute, and show only where they outlast it
                n = ep_chunks
                a2a = self.ct("all_to_all", routed / n, ep, tp) + call
                experts_f = 2 * routed_params(m) / m.moe_experts * m.moe_topk * routed_fraction(m, s) \
                    * tokens / tp / (peak * eff)
                fwd = fwd + 2 * a2a + max(0.0, (2 * n - 2) * a2a - experts_f)
                bwd = bwd + 2 * a2a + max(0.0, (2 * n - 2) * a2a - 2 * experts_f)
                ep_sent = RING["all_to_all"](ep) * (4 * routed + counts)
                if recompute in ("full", "op"):  # the forward's counts, dispatch and combine re-run
                    ep_sent += RING["all_to_all"](ep) * (2 * routed + counts)
            out[moe] = (fwd, bwd, params, fwd_c, ep_sent)
        # the output layer and the loss over the vocabulary: the logits GEMM, then the
        # cross-entropy's memory-bound passes per logit (parallel/loss.py; forward: the max
        # a, the shifted fp32 copy a + 4, exp 8, the sum 4; backward: the shifted copy a + 4,
        # exp 8, the scale 8, the cast into the gradient 4 + a)
        logits_gemm = self._gemm_cache.get((tokens, tp, "logits"))
        if logits_gemm is None and d.gemm_tile:
            logits_gemm = gemm_time(d, tokens, V / tp, h, h / tp, act, w.fp8)
        elif logits_gemm is None:
            logits_gemm = 2 * h * V / tp * tokens / (peak * eff)
        self._gemm_cache[(tokens, tp, "logits")] = logits_gemm
        ce = c.elementwise_traffic * tokens * V / tp / bw if d.gemm_tile else (act + 8) * tokens * V / tp / hbm
        out_fwd = logits_gemm + (2 * act + 16) * ce if d.gemm_tile else logits_gemm + ce
        out_bwd = 2 * logits_gemm + (2 * act + 24) * ce if d.gemm_tile else 2 * out_fwd
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
        # Calls and bytes each tp collective of the runtime (parallel/tensor.py, loss.py)
        # sends, per micro-batch: per layer, on the first stage, on the last stage, each as
        # (calls, activation bytes, weight-gradient elements): activations (and their
        # gradients) cross the tp link in the compute dtype (``act``: bf16 under autocast,
        # tensor.py's ``wire_dtype``), the loss's per-token statistics in >= fp32, and the
        # gradients of replicated weights in the dtype backward makes them, the compute
        # weights' (``collectives`` prices them: ``tp_grad_bytes``), so counted in elements here.
        tp_layer = tp_first = tp_last = tp_moe = (0, 0.0, 0.0)
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
            tp_layer = (calls, sent, r_ar * weights)
            shared = 1 if m.moe_shared_experts else 0
            gates = tokens * m.moe_topk * act  # every assignment's, in the compute dtype (parallel/expert.py)
            if self._has_moe and not sp:  # a MoE block: its gates' gradient summed over tp in
                # backward (the expert output leaves, its input enters like a dense MLP's), and the
                # tp-split shared experts' own entry (all-reduce backward) and exit (forward)
                tp_moe = (1 + 2 * shared, r_ar * (gates + 2 * shared * A), 0.0)
            elif self._has_moe:  # a MoE block under sp (parallel/expert.py ``tokens_in``/``_out``),
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
                tp_moe = (4 + 5 * shared + recomputed * (2 + 2 * shared) + seq_aux + slots,
                          r_ar * ((2 - 2.5 + 2.5 * shared) * A + 0.5 * ids + gates + stats
                                  + recomputed * (0.5 * (ids + gates) + shared * A)
                                  + seq_aux * b * m.moe_experts * max(4, act) + slots * 0.5 * ids),
                          r_ar * m.moe_experts * h)
            pos = r_ar * s * h if (sp and m.pos == "learned") else 0.0
            tp_first = (2 + (1 if pos else 0), r_ar * A, pos) if sp else (1, r_ar * A, 0.0)
            loss = (2, r_ar * 3 * tokens * max(4, act))  # max logit, (sum exp, target)
            if sp:
                norm_calls = 2 if (m.norm == "layernorm" and m.bias) else 1
                tp_last = (3 + loss[0] + norm_calls, 1.5 * r_ar * A + loss[1], r_ar * norm_calls * h)
            else:
                tp_last = (1 + loss[0], r_ar * A + loss[1], 0.0)
        # with ep > 1 the routed experts are their own FSDP group, sharded over the edp ranks
        expert_p = routed_params(m) / (tp * ep) if ep > 1 else 0.0
        hit = dict(kinds=out, expert_p=expert_p, act_kinds=act_kinds, out_fwd=out_fwd,
                   out_bwd=out_bwd, act_full=act_full, act_kept=act_kept,
                   tp_layer=tp_layer, tp_moe=tp_moe, tp_first=tp_first, tp_last=tp_last, final_norm=norm_p / 2,
                   tp_ar=tp_ar, tp_bytes=tp_bytes, cp_fwd=cp_fwd, cp_sent=cp_sent, tokens=tokens,
                   cp_calls=(cp_calls, cp_calls_rec, cp_calls_sel), cp_sent_rec=cp_sent_rec, cp_sent_sel=cp_sent_sel,
                   p2p_bytes=act * tokens * h / (tp if sp else 1), emb=V * h / tp,
                   pos_emb=s * h if m.pos == "learned" else 0.0,  # learned positions: whole on every tp rank
                   emb_ops=emb_ops, out_ops=out_ops, layer_regather=layer_regather,
                   loss_t=self.ct("all_reduce", loss_bytes / 3, tp, 1),
                   norm_t=self.ct("all_reduce", norm_bytes, tp, 1) if sp else 0.0,
                   tp_edge_bytes=(loss_bytes + norm_bytes) * RING["all_reduce"](tp) if tp > 1 else 0.0)
        self._layer_cache[key] = hit
        return hit

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

    # ---- pipeline stages: the runtime's split (``stage_split_of``: parallel.pp_split, else
    # balanced by cost), stage -> rank as the schedule lays them out (``meshfold/schedule.py``)
    def stage_split(self, L: Layout) -> list[int]:
        """Blocks per pipeline stage (stage order), as ``parallel/stages.py::stage_split``
        builds them; cached per (stages, pp_split) -- the model is fixed per CostModel."""
        n = L.pp * chunks_per_rank(L.pp_schedule, L.pp_virtual_stages) if L.pp > 1 else 1
        key = (n, tuple(L.pp_split))
        hit = self._split_cache.get(key)
        if hit is None:
            hit = self._split_cache[key] = stage_split_of(self.w.model, n, L.pp_split)[0]
        return hit

    def mtp_extra_params(self, pp: int, emb: float) -> float:
        """A rank's parameters of the multi-token prediction depths beyond their blocks:
        eh_proj [2h -> h] and three norms per depth (whole on every tp rank), and under pp
        the last stage's copy of the embedding (models/mtp.py, parallel/pipeline.py)."""
        m = self.w.model
        if not m.mtp_depth:
            return 0.0
        h = m.dim
        copy = emb if pp > 1 else 0.0  # (emb: this tp rank's rows)
        return m.mtp_depth * (2 * h * h + 3 * h) + copy

    def stage_kinds(self, L: Layout) -> tuple[list[dict], int]:
        """Per pipeline rank, its blocks by kind ({is_moe: count}) over all its chunks, and
        the rank holding the last stage (the output layer): pp - 1, or 0 under zbv's V."""
        sched = L.pp_schedule if L.pp > 1 else "1f1b"
        key = (L.pp, sched, L.pp_virtual_stages if sched == "interleaved" else 1, tuple(L.pp_split))
        hit = self._stage_cache.get(key)
        if hit is None:
            split = self.stage_split(L)
            ranks = [dict() for _ in range(L.pp)]
            start = 0
            for stage, n in enumerate(split):
                rank = rank_chunk_of_stage(sched, L.pp, stage)[0] if L.pp > 1 else 0
                for i in range(start, start + n):
                    ranks[rank][self.kinds[i]] = ranks[rank].get(self.kinds[i], 0) + 1
                start += n
            last = rank_chunk_of_stage(sched, L.pp, len(split) - 1)[0] if L.pp > 1 else 0
            for kind in self.mtp_kinds:
                ranks[last][kind] = ranks[last].get(kind, 0) + 1
            hit = self._stage_cache[key] = (ranks, last)
        return hit

    def _stage_sums(self, T: dict, stages: list, last_rank: int, pp: int, v: int, p2p: float):
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

    def _stage_base(self, T: dict, stages: list, last_rank: int, pp: int):
        """``_stage_sums``' per-rank forward and backward before the point-to-point hops, and
        its parameters and layers per rank (cached per layer terms and stage kinds: the hops
        differ with the data-parallel split)."""
        key = (id(T), id(stages), pp)
        hit = self._stage_base_cache.get(key)
        if hit is not None:
            return hit
        m = self.w.model
        kinds = T["kinds"]
        fs, bws, stage_params, stage_layers = [], [], [], []
        for st, counts in enumerate(stages):
            f = sum(kinds[k][0] * n for k, n in counts.items())
            bw = sum(kinds[k][1] * n for k, n in counts.items())
            params = sum(kinds[k][2] * n for k, n in counts.items())
            if st == 0:
                params += T["emb"] + T["pos_emb"]
                f, bw = f + T["emb_ops"][0] * T["tp_ar"], bw + T["emb_ops"][1] * T["tp_ar"]
            if st == last_rank:
                f, bw = f + T["out_fwd"], bw + T["out_bwd"]
                f += T["out_ops"][0] * T["tp_ar"] + 3 * T["loss_t"]
                bw += T["out_ops"][1] * T["tp_ar"] + T["norm_t"]
                params += (0 if (m.tie_embeddings and pp == 1) else T["emb"]) + T["final_norm"]
                if m.mtp_depth:  # each depth's head and loss, eh_proj and norms; the embedding's copy
                    D = m.mtp_depth
                    f += D * (T["out_fwd"] + T["out_ops"][0] * T["tp_ar"] + 3 * T["loss_t"])
                    bw += D * (T["out_bwd"] + T["out_ops"][1] * T["tp_ar"])
                    params += self.mtp_extra_params(pp, T["emb"])
            fs.append(f)
            bws.append(bw)
            stage_params.append(params)
            stage_layers.append(sum(counts.values()))
        hit = self._stage_base_cache[key] = (fs, bws, stage_params, stage_layers)
        return hit

    def step_time(self, L: Layout) -> float:
        """``estimate(L).step_time_s`` alone (the search's inner loop: no memory, no breakdown)."""
        return self._step(L)[0]

    def step_bound(self, L: Layout) -> float:
        """A time ``L`` with any recompute cannot beat (``L.recompute`` should be "none"):
        its step time with zbv's replay replaced by ``bubble_lower_bound`` and the data-
        parallel traffic with endless compute to hide behind (recompute only lengthens the
        backward: the pipeline takes no less, the traffic finds no shorter windows)."""
        return self._step(L, bound=True)[0] * (1 - 1e-12)

    def _step(self, L: Layout, bound: bool = False):
        """The step time and the parts ``estimate`` reports (one code path for both);
        ``bound``: for ``step_bound``."""
        w, c = self.w, self.c
        pb, gb, ob, act = DTYPE_BYTES[w.dtype]
        tp, cp = L.tp, L.cp
        v = L.pp_virtual_stages if L.pp_schedule == "interleaved" else 1
        dp, b = L.dp, L.micro_batch
        if w.global_batch % dp or (w.global_batch // dp) % b:
            raise ValueError(f"global batch {w.global_batch} does not split into dp={dp} x micro_batch={b}")
        n_micro = w.global_batch // dp // b
        T = self.layer_terms(tp, L.sp, cp, L.cp_mode, max(1, L.ep), b, L.recompute, L.cp_ulysses,
                             L.ep_overlap_chunks)
        p2p, stages, last_rank, t_f, t_b, stage_params, stage_layers, makespan, bubble = self._pipeline(
            L, T, n_micro, v, bound)
        Pmax = max(stage_params)
        window = (ENDLESS, ENDLESS) if bound else (t_f, t_b)
        Emax = stages[stage_params.index(Pmax)].get(True, 0) * T["expert_p"]  # its routed experts (ep > 1)
        # (memoised on what it reads: layouts differing in sp, cp's mode or, with bounded
        # windows, the micro-batch size share it)
        dkey = (L.zero, L.dp_shard, L.dp_replicate, tp, cp, L.ep, L.pp, L.pp_schedule, v, T["emb"],
                T["final_norm"], Pmax, stage_layers[0], n_micro, *window, Emax)
        dp_exposed = self._dp_cache.get(dkey)
        if dp_exposed is None:
            dp_exposed = self._dp_cache[dkey] = self._dp_exposed(L, T, Pmax, stage_layers, n_micro, *window, v, Emax)

        # ---- optimizer step: one memory-bound pass over the local states
        n_shard = L.dp_shard * cp
        shards = n_shard if L.zero >= 1 else 1
        opt_time = Pmax * (pb + gb + ob) * 2 / shards / self.bw
        # bf16 compute from fp32 weights without FSDP's bf16 gathers (parallel/compute_weights.py):
        # every weight is cast to bf16 once a step (4 + 2 bytes); each micro-batch its bf16
        # gradient is cast back (2 + 4) and accumulated into the fp32 gradient (4 + 4 + 4)
        fsdp = L.zero >= 2 and n_shard > 1
        casts = ((6 + n_micro * 18) * Pmax / self.bw if (w.dtype == "bf16-amp" and not fsdp and c.device.gemm_tile)
                 else 0.0)
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

    def estimate(self, L: Layout, detail: bool = True) -> Estimate:
        """Predict one layout. Raises ValueError for layouts that do not tile the batch.
        ``detail=False`` (the search's inner loop) leaves out the per-dimension collectives.
        Three parts: the pipeline's compute and bubble (``_pipeline``), the data-parallel
        traffic left exposed (``_dp_exposed``) and the fullest device's memory (``_memory``)."""
        c = self.c
        step, (T, n_micro, v, p2p, stages, last_rank, t_f, t_b, stage_params, stage_layers, bubble, dp_exposed,
               opt_time, casts, small) = self._step(L)
        per_layer_ops = 4 + (2 if L.recompute in ("full", "op") else 0)
        time = {
            "compute_fwd_bwd": n_micro * (t_f + t_b),
            "of_which_tp_comm": n_micro * stage_layers[0] * (per_layer_ops + T["layer_regather"]) * T["tp_ar"],
            "of_which_cp_comm": n_micro * stage_layers[0] * 3 * T["cp_fwd"],
            "of_which_pp_p2p": n_micro * 2 * v * p2p,
            "pipeline_bubble": bubble,
            "dp_exposed": dp_exposed,
            "optimizer": opt_time,
            "casts_and_copies": casts,
            "latency_small": small + c.step_overhead_s,
            # per-micro-batch forward/backward of the slowest stage (for the simulator)
            "stage_fwd_s": t_f,
            "stage_bwd_s": t_b,
        }
        states, memory, peak_mem, activation_bytes = self._memory(L, T, stage_params, stage_layers, last_rank,
                                                                  n_micro, v)
        fits = peak_mem <= c.device.memory_gib * GiB
        tflops = self.flops_model / step / L.world
        est = Estimate(L, step, time, memory, peak_mem, fits, self.flops_model, tflops / self.peak,
                       tflops / 1e12, param_bytes=states["params"], grad_bytes=states["grads"],
                       optimizer_bytes=states["optimizer"], activation_bytes=activation_bytes,
                       gathered_param_bytes=memory["gathered_params"], recompute_bytes=memory["recompute"])
        if detail:
            est.collectives = self.collectives(L, T, stages, stage_layers, stage_params, n_micro)
            est.comm_bytes = {d: x["bytes"] for d, x in est.collectives.items()}
        return est

    def peak_memory(self, L: Layout) -> float:
        """``estimate(L).peak_mem_bytes`` without the step time (the search prunes by memory
        before it prices): the stage split and the memory terms alone, cached alike."""
        v = L.pp_virtual_stages if L.pp_schedule == "interleaved" else 1
        n_micro = self.w.global_batch // L.dp // L.micro_batch
        T = self.layer_terms(L.tp, L.sp, L.cp, L.cp_mode, max(1, L.ep), L.micro_batch, L.recompute, L.cp_ulysses,
                             L.ep_overlap_chunks)
        stages, last_rank = self.stage_kinds(L)
        _, _, stage_params, stage_layers = self._stage_base(T, stages, last_rank, L.pp)
        return self._memory(L, T, stage_params, stage_layers, last_rank, n_micro, v)[2]

    def _pipeline(self, L: Layout, T: dict, n_micro: int, v: int, bound: bool = False):
        """Per-stage compute, the schedule's makespan and bubble: (p2p per hop, stage kinds,
        the rank holding the last stage, t_f, t_b of the slowest stage, parameters and blocks per pp rank, makespan, bubble).
        Cached: a structure's zero stages share it."""
        key = (id(T), L.pp, L.pp_schedule, v, L.pp_split, L.pp_links, L.pp_skip, L.pp_reorder, L.tp, L.cp, L.dp,
               n_micro, bound)
        hit = self._pipeline_cache.get(key)
        if hit is None:
            hit = self._pipeline_cache[key] = self._pipeline_of(L, T, n_micro, v, bound)
        return hit

    def _pipeline_of(self, L: Layout, T: dict, n_micro: int, v: int, bound: bool):
        c, tp, pp, cp, dp = self.c, L.tp, L.pp, L.cp, L.dp
        st_pp = tp * cp * dp  # pp groups' stride, tp innermost (meshfold/mesh.py)
        if pp > 1:  # point-to-point to the next stage, over the link the pp dimension spans,
            # and the executor's fixed work around each stage operation
            alpha, beta = self.link(st_pp, pp)
            p2p = alpha + T["p2p_bytes"] / beta + c.pipeline_op_us * 1e-6
        else:
            p2p = 0.0
        stages, last_rank = self.stage_kinds(L)
        skey = (id(T), id(stages), pp, v, p2p)
        hit = self._stage_sum_cache.get(skey)
        if hit is None:
            hit = self._stage_sums(T, stages, last_rank, pp, v, p2p)
            self._stage_sum_cache[skey] = hit
        t_f, t_b, busy_sum, stage_params, stage_layers = hit
        if pp > 1 and (L.pp_schedule == "skippipe" or (L.pp_links and L.pp_schedule == "1f1b")):
            makespan = self._path_time(L, T, n_micro, t_f - p2p, t_b - p2p, p2p)
            bubble = max(0.0, makespan - n_micro * (t_f + t_b))
        elif bound and L.pp_schedule == "zbv":  # (step_bound: no replay)
            bubble = bubble_lower_bound(L.pp_schedule, pp, n_micro, v, t_f, t_b)
            makespan = n_micro * (t_f + t_b) + bubble
        else:
            makespan, bubble = pipeline_time(L.pp_schedule, pp, n_micro, v, t_f, t_b)
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

    def _path_time(self, L: Layout, T: dict, n_micro: int, t_f: float, t_b: float, p2p: float) -> float:
        """One step of stage-per-rank paths (``meshfold/skippipe.py``: 1F1B without skips)
        over links priced one by one: ``p2p`` on the cluster's link, ``alpha + bytes/rate``
        on the ``pp_links``; the slowest stage's times on every stage."""
        slow = {(a, b): p2p - T["p2p_bytes"] / self.link(L.tp * L.cp * L.dp, L.pp)[1] + T["p2p_bytes"] * 8 / (r * 1e6)
                for a, b, r in L.pp_links}
        stage_s = tuple((t_f, t_b) for _ in range(L.pp))
        links = link_table(L.pp, p2p, slow)
        paths, _ = plan_orders(L.pp, n_micro, float(L.pp_skip) if L.pp_schedule == "skippipe" else 0.0,
                               bool(L.pp_reorder) and L.pp_schedule == "skippipe", stage_s, links, nccl_safe)
        return table_step_time(L.pp, paths, stage_s, links)

    def _dp_exposed(self, L: Layout, T: dict, Pmax: float, stage_layers: list, n_micro: int,
                    t_f: float, t_b: float, v: int, Emax: float = 0.0) -> float:
        """Seconds of data-parallel traffic the step waits for (after overlap with compute).
        ``Emax``: the routed-expert parameters among ``Pmax`` (ep > 1), which zero 0/1 reduce
        (and ZeRO-1 gathers) over the edp ranks instead."""
        w, c, tp, cp, dp = self.w, self.c, L.tp, L.cp, L.dp
        pb, gb, ob, act = DTYPE_BYTES[w.dtype]
        # strides of each mesh dimension's groups, tp innermost (meshfold/mesh.py)
        # FSDP shards over (dp_shard, cp) flattened: stride tp; replicas stride tp*cp*dp_shard
        st_dps, st_dpr = tp, tp * cp * L.dp_shard
        # ---- data parallel over dp x cp ranks: gradients reduced once per optimizer step
        # (the last micro-batch's backward); ZeRO-1 then gathers the updated parameters;
        # ZeRO-3 gathers parameters per micro-batch (forward, and again in backward).
        n_shard, n_rep, n_all = L.dp_shard * cp, L.dp_replicate, dp * cp
        chunks = chunks_per_rank(L.pp_schedule, L.pp_virtual_stages) if L.pp > 1 else 1
        dp_exposed = 0.0
        fsdp = L.zero >= 2 and n_shard > 1
        if fsdp:
            wg, wr = FSDP_WIRE[w.dtype]
            modules = stage_layers[0] + chunks  # blocks plus each chunk's root
            t_ag = self.ct("all_gather", Pmax * wg, n_shard, st_dps)
            t_red = (self.ct("reduce_scatter", Pmax * wr, n_shard, st_dps)
                     + self.ct("all_reduce", Pmax * wr / n_shard, n_rep, st_dpr))
            per_call = (c.collective_overhead_us + c.fsdp_overhead_us) * 1e-6
            red_calls = modules * (2 if n_rep > 1 else 1)

            # What cannot hide: the root module's collectives (the embedding, and at pp = 1
            # the output layer and final norm: the largest module) are the first gather of
            # a forward and of a backward, and the last reduce-scatter, with no compute
            # beside them; at least one block's share otherwise.
            m = w.model
            root = T["emb"] * (2 if (L.pp == 1 and not m.tie_embeddings) else 1) + T["final_norm"]
            share = max(1.0 / modules, min(1.0, root / max(Pmax, 1.0)))

            def exposed(t: float, window: float) -> float:
                return max(t - c.overlap * window, t * share)

            if L.zero == 3:  # gathers in every micro-batch's forward and backward; the
                # reduction joins them in the last micro-batch's backward
                t_g = 2 * t_ag
                comm_t = (n_micro - 1) * exposed(t_g, t_f + t_b) + exposed(t_g + t_red, t_f + t_b)
                calls = n_micro * 2 * modules + red_calls
            elif n_micro == 1:  # ZeRO-2, one micro-batch: gather and reduce in one pass
                comm_t, calls = exposed(t_ag + t_red, t_f + t_b), modules + red_calls
            else:  # ZeRO-2: gathered in the first forward and kept; reduced in the last backward
                comm_t, calls = exposed(t_ag, t_f) + exposed(t_red, t_b), modules + red_calls
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
            if L.zero == 1 and n_shard > 1:
                zb, flat = zero1_gather(w.dtype, tp, L.ep)
                t_z1 = self.ct("all_gather", (Pmax - Emax) * zb, n_shard, st_dps)
                calls += 1 if flat else buckets(Pmax * zb)
                if Emax and edp > 1:
                    t_z1 += self.ct("all_gather", Emax * zb, edp, tp * L.ep)
                    calls += 1
            last_bucket = t_ar * min(1.0, BUCKET_BYTES / max(Pmax * gb, 1.0))
            dp_exposed = max(t_ar - c.overlap * t_b / v, last_bucket) + t_z1 + calls * c.collective_overhead_us * 1e-6
        return dp_exposed

    def _memory(self, L: Layout, T: dict, stage_params: list, stage_layers: list, last_rank: int, n_micro: int,
                v: int):
        """The fullest device's bytes: (model states, memory by kind, peak, activation bytes)."""
        w, c, m, tp, pp, cp, b = self.w, self.c, self.w.model, L.tp, L.pp, L.cp, L.micro_batch
        pb, gb, ob, act = DTYPE_BYTES[w.dtype]
        V, h = m.vocab_size, m.dim
        Pmax = max(stage_params)
        max_block = max(k[2] for k in T["kinds"].values())
        n_shard, n_all = L.dp_shard * cp, L.dp * cp
        fsdp = L.zero >= 2 and n_shard > 1
        # ---- memory on the fullest device (stage 0 holds the most in-flight activations)
        states, zero, accumulate, moe_layers = self._top_states(L, T, stage_params, n_micro)
        if accumulate and zero >= 2 and pp > 1 and chunks_per_rank(L.pp_schedule, L.pp_virtual_stages) > 1:
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
        tokens = T["tokens"]
        stage_kinds = self.stage_kinds(L)[0]
        # bf16 compute weights in every layout (FSDP2's gathers or the step's compute copies):
        # the blocks take bf16 inputs, and the projections share one bf16 norm output
        per_layer = dict(T["act_kinds"])
        if amp and L.recompute not in ("full", "op"):
            per_layer = {k: x - autocast_input_copies(m, w.s // cp, b, act, tp, L.sp) for k, x in per_layer.items()}
        stage_in = 0.0 if amp else act * tokens * h  # (amp: layer 0's norm input, counted there)
        # what the loss keeps for backward: the logits as they came (parallel/loss.py's
        # chunked cross-entropy recomputes each chunk's softmax in backward) and the int64
        # labels; with amp also the final norm (8h + 4; sequence-sharded under sp)
        saved_logits = (act * V / tp + 8) * tokens + ((8 * h + 4) * tokens / (tp if L.sp else 1) if amp else 0.0)
        if m.mtp_depth:  # each multi-token prediction depth's logits, targets and output norm (as the
            # main model's: the term above once per depth), what its enorm and hnorm keep (amp: 8h + 4
            # each) and eh_proj's [2h] input (whole under tp)
            per_token = 2 * (8 * h + 4) + 2 * act * h if amp else 5 * act * h
            saved_logits *= 1 + m.mtp_depth
            saved_logits += m.mtp_depth * per_token * tokens
        logits_here = pp == 1 or last_rank == 0  # zbv's V puts the last stage on rank 0 too
        if pp == 1:
            acts = sum(per_layer[k] * n for k, n in stage_kinds[0].items()) + stage_in
            held, held_logits = [acts], [acts + saved_logits]
        else:  # every rank's chunks, each held from its forward to its backward in the rank's order
            held, held_logits = self._held(L, per_layer, stage_in, saved_logits, n_micro)
            acts = max(held)
        self._acts_cache[self._acts_key(L, n_micro)] = acts
        # the recompute working set while one block is recomputed and run backward: under full,
        # all of its activations; under op, what the policy did not keep
        if full:
            recompute = T["act_full"]
        elif L.recompute == "op":
            recompute = max(0.0, T["act_full"] - T["act_kept"])
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

    def _grad_share(self, L: Layout, T: dict, n_micro: int, n_shard: int) -> float:
        """The gradients the fullest pp rank holds at its fullest moment
        (``schedule.rank_grad_moments``: chunks still accumulating whole, chunks already
        reduced as their 1/n_shard share, chunks not yet in backward nothing), as a
        fraction of the largest rank's unsharded gradients."""
        sched = L.pp_schedule
        v = L.pp_virtual_stages if sched == "interleaved" else 1
        key = ("grads", L.tp, L.ep, L.pp, sched, v, tuple(L.pp_split), n_micro, n_shard)  # (params: tp, ep)
        hit = self._held_cache.get(key)
        if hit is None:
            kinds, stage_kinds = T["kinds"], self.stage_block_kinds(L)
            params = []
            for st, counts in enumerate(stage_kinds):
                p = sum(kinds[k][2] * n for k, n in counts.items())
                if st == 0:
                    p += T["emb"] + T["pos_emb"]
                if st == len(stage_kinds) - 1:
                    p += T["emb"] + T["final_norm"] + self.mtp_extra_params(L.pp, T["emb"])
                    p += sum(kinds[k][2] for k in self.mtp_kinds)
                params.append(p)
            weight = (0.0, 1.0, 1.0 / max(1, n_shard))
            held = whole = 0.0
            for rank in range(L.pp):
                mine = [params[stage_of(sched, L.pp, rank, c)] for c in range(chunks_per_rank(sched, v))]
                whole = max(whole, sum(mine))
                held = max(held, max(sum(p * weight[s] for p, s in zip(mine, moment))
                                     for moment in rank_grad_moments(sched, L.pp, v, n_micro, rank)))
            hit = self._held_cache[key] = held / max(whole, 1e-30)
        return hit

    def _held(self, L: Layout, per_layer: dict, stage_in: float, saved_logits: float,
              n_micro: int) -> tuple[list, list]:
        """Per pipeline rank, the most activation bytes it holds at once, without and with
        the last stage's saved logits: each chunk's bytes per micro-batch, held from its
        forward to its backward in the rank's order (``schedule.held_counts``: the moments
        the dry-run's measurement is taken at too). Cached: the search asks often."""
        sched = L.pp_schedule
        v = L.pp_virtual_stages if sched == "interleaved" else 1
        key = (L.pp, sched, v, tuple(L.pp_split), n_micro, tuple(sorted(per_layer.items())), stage_in, saved_logits)
        hit = self._held_cache.get(key)
        if hit is None:
            stage_bytes = [sum(per_layer[k] * n for k, n in kinds.items()) + stage_in
                           for kinds in self.stage_block_kinds(L)]
            last = len(stage_bytes) - 1
            stage_bytes[last] += sum(per_layer[k] for k in self.mtp_kinds)
            without, with_logits = [], []
            for stages, counts in _rank_held(sched, L.pp, v, n_micro):
                without.append(held_peak(counts, [stage_bytes[st] for st in stages]))
                with_logits.append(held_peak(counts, [stage_bytes[st] + (saved_logits if st == last else 0.0)
                                                      for st in stages]))
            hit = self._held_cache[key] = (without, with_logits)
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

    def _top_states(self, L: Layout, T: dict, stage_params: list, n_micro: int):
        """Model states of the pp rank holding the most (``_memory``'s), the zero stage in
        effect, whether gradients accumulate, and MoE layers per pp rank. The fullest rank is
        the one with the most parameters, except where experts are sharded over fewer ranks
        than the rest (ep with zero 0/1: a rank of MoE blocks can hold more than the
        embedding's with more parameters)."""
        zero = L.zero if L.dp_shard * L.cp > 1 else 0  # nothing to shard over: replicated states
        accumulate = n_micro > 1
        moe_layers = [r.get(True, 0) for r in self.stage_kinds(L)[0]]
        if not T["expert_p"]:  # every parameter sharded alike: the rank with the most holds the most
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
        sched = L.pp_schedule if L.pp > 1 else ""
        return (L.tp, L.sp, L.cp, L.cp_mode, L.ep, L.micro_batch, L.recompute, L.cp_ulysses, L.ep_overlap_chunks,
                L.pp, sched, L.pp_virtual_stages if sched == "interleaved" else 1, tuple(L.pp_split), n_micro)

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
        v = L.pp_virtual_stages if L.pp_schedule == "interleaved" else 1
        # model states depend on the parameters (tp, ep), the stages and how they shard, not
        # on the micro-batch, sp or cp's mode: structures differing only there share it
        key = (L.tp, L.ep, L.pp, L.pp_schedule, v, L.pp_split, L.zero, L.dp_shard, L.cp, L.dp, n_micro > 1)
        hit = self._floor_cache.get(key)
        if hit is None:
            T = self.layer_terms(L.tp, L.sp, L.cp, L.cp_mode, max(1, L.ep), L.micro_batch, L.recompute,
                                 L.cp_ulysses, L.ep_overlap_chunks)
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

    def _model_states(self, L: Layout, T: dict, params: float, moe_layers: int, zero: int,
                      accumulate: bool) -> dict:
        """``model_state_bytes`` of a pipeline rank with ``params`` parameters: sharded over
        dp_shard x cp, except (ep > 1) the routed experts of its ``moe_layers`` MoE layers, an
        own FSDP group over the edp = dp x cp / ep ranks (``parallel/expert.py``)."""
        n_shard = L.dp_shard * L.cp
        experts = moe_layers * T["expert_p"]
        states = model_state_bytes(params - experts, zero, n_shard, self.w.dtype, accumulate)
        if zero == 2:  # meshfold's ZeRO-2 is FSDP2 without resharding after forward: the storage is
            # sharded as under ZeRO-3 (the whole compute-dtype copy the paper's stage 2 keeps is
            # the ``gathered_params`` term)
            states["params"] /= max(1, n_shard)
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
        return states

    def _expert_padding(self, L: Layout) -> float:
        """The routed experts' bytes per rank (held, all-gathered, reduce-scattered) relative to
        their even share over the edp ranks. Each stacked expert weight [E_l, out, in]
        (E_l = E / (ep tp) local experts) is sharded on the dimension
        ``parallel/expert_shard.py: expert_shard_dim`` picks, as the runtime does: 1.0 when
        edp divides E_l, out or in; else dim 0 padded to ceil(E_l / edp) experts per rank."""
        m = self.w.model
        E_l, edp = m.moe_experts // (L.ep * L.tp), L.dp * L.cp // L.ep
        if not E_l:
            return 1.0
        # w2 [E_l, dim, hidden] and w1 [E_l, hidden, dim], or with swiglu the fused w13
        # [E_l, 2 hidden, dim] (models/moe.py), weighted by their sizes
        wide = 2 if m.mlp == "swiglu" else 1
        shapes = [((E_l, wide * m.expert_dim, m.dim), wide), ((E_l, m.dim, m.expert_dim), 1)]
        return sum(n * expert_shard_padding(s, edp) for s, n in shapes) / (wide + 1)

    def collectives(self, L: Layout, T: dict, stages: list, stage_layers: list, stage_params: list,
                    n_micro: int) -> dict:
        """Rank 0's collectives in one optimizer step, by mesh dimension as the runtime's
        communication ledger names them: ``{dim: {"count": calls, "bytes": sent}}``, bytes
        in ``meshfold/ring.py``'s ring convention (FACTORS, as ``comm.py`` counts), one count per collective call
        or point-to-point send. Rank 0 is pipeline stage 0 (and, at pp = 1 or with zbv,
        also the last stage). Not counted (as the runtime's ledger does not count them:
        ``dim=None`` in comm.py): the step's control scalars (token count, loss sum, gradient norm)."""
        w = self.w
        pb, gb, _, act = DTYPE_BYTES[w.dtype]
        tp, pp, cp = L.tp, L.pp, L.cp
        chunks = chunks_per_rank(L.pp_schedule, L.pp_virtual_stages) if pp > 1 else 1
        last_on_rank0 = pp == 1 or L.pp_schedule == "zbv"
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
            E0, edp = moe0 * T["expert_p"], n_all // max(1, L.ep)
            groups = [(modules, n_shard, P0 - E0)] + ([(moe0, edp, E0 * self._expert_padding(L))]
                                                      if E0 and edp > 1 else [])
            for mods, n, P in groups:
                ag = RING["all_gather"](n)
                if L.zero == 3:  # every module, the roots too, gathered in forward and again in
                    # backward (apply_fsdp passes reshard_after_forward=True explicitly, so FSDP2's
                    # "keep the root unsharded" default for reshard_after_forward=None is off)
                    add("dp", n_micro * 2 * mods, n_micro * ag * 2 * P * wg)
                else:
                    add("dp", mods, ag * P * wg)
                add("dp", mods, RING["reduce_scatter"](n) * P * wr)
            if n_rep > 1:
                add("dp", modules, RING["all_reduce"](n_rep) * (P0 - E0) * wr / n_shard)
        elif n_all > 1:
            # under pp each of the rank's chunks has its own bucketed reducer (parallel/data.py);
            # with ep > 1 the routed experts have reducers of their own over edp (and, ZeRO-1,
            # their own ShardedAdamW over edp), the rest goes over dp x cp
            E0, edp = (moe0 * T["expert_p"], n_all // L.ep) if L.ep > 1 else (0.0, 1)
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
            elif L.pp_schedule != "zbv" and moe_sizes is None:
                # GradReducer: greedy per parameter
                if pp == 1:
                    shapes = [(m.n_layers, True, True)]
                elif L.pp_schedule == "interleaved":
                    split = self.stage_split(L)
                    shapes = [(split[stage_of(L.pp_schedule, pp, 0, c)], c == 0, False)
                              for c in range(L.pp_virtual_stages)]
                else:
                    shapes = [(layers0, True, False)]
                sizes = [chunk_param_sizes(m, tp, n, first, last) for n, first, last in shapes]
                if all(x is not None for x in sizes):
                    calls = sum(reducer_buckets([e * pb for e in x]) for x in sizes)
            add("dp", calls, RING["all_reduce"](n_all) * (P0 - E0) * gb)
            if E0 and edp > 1:
                add("dp", expert_calls, RING["all_reduce"](edp) * E0 * gb)
            if L.zero == 1 and n_shard > 1:
                # ShardedAdamW's flat segments in one call (bf16 under meshfold's bfloat16), or
                # ZeroRedundancyOptimizer's buckets (counts.zero1_gather)
                zb, flat = zero1_gather(w.dtype, tp, L.ep)
                add("dp", 1 if flat else buckets(P0 * zb), RING["all_gather"](n_shard) * (P0 - E0) * zb)
                if E0 and edp > 1:
                    add("dp", 1, RING["all_gather"](edp) * E0 * zb)
        # tensor parallel: per layer, around the layers, loss (parallel/tensor.py, loss.py)
        if tp > 1:
            grad = tp_grad_bytes(w.dtype)
            moe_layers0 = stages[0].get(True, 0)
            # (each multi-token prediction depth embeds the shifted tokens and has its own head and loss)
            depths = w.model.mtp_depth if last_on_rank0 else 0
            for part, times in (("tp_layer", layers0), ("tp_moe", moe_layers0), ("tp_first", 1 + depths),
                                ("tp_last", (1 + depths) if last_on_rank0 else 0)):
                calls, sent, weights = T[part]
                add("tp", n_micro * times * calls, n_micro * times * (sent + weights * grad))
        # pipeline: activations to the next stage, gradients to the previous one, per
        # micro-batch and chunk; then the loss and the bubble statistics over pp
        if pp > 1:
            if L.pp_schedule == "zbv":
                sends = 2  # stage 0 sends activations, stage 2p-1 (the last) gradients
            else:
                sends = 2 * chunks - 1  # every chunk sends forward; all but stage 0 backward
            add("pp", n_micro * sends, n_micro * sends * T["p2p_bytes"])
            # one all-gather of [loss sum, busy, start, end] (float64) per pp rank
            add("pp", 1, RING["all_gather"](pp) * 32 * pp)
            if w.model.mtp_depth and not last_on_rank0:  # the embedding's gradient, exchanged with
                # the last stage's copy (multi-token prediction; parallel/pipeline.py)
                add("pp", 1, T["emb"] * gb)
        # context parallel (parallel/context.py): ring hops, or Ulysses' all-to-alls, per
        # layer; the ranks' positions/doc ids once per micro-batch and chunk; the work counter per step
        if cp > 1:
            # the collectives recompute issues again: the block's forward ones (full, op), or the
            # attention core's (selective)
            redo = {"full": 1, "op": 1, "selective": 2}.get(L.recompute)
            per_layer = T["cp_calls"][0] + (T["cp_calls"][redo] if redo else 0)
            sent = T["cp_sent"] + ((T["cp_sent_rec"], T["cp_sent_sel"])[redo - 1] if redo else 0.0)
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
            ep_bytes = sum(T["kinds"][k][4] * n for k, n in stages[0].items())
            # pipelined in n chunks: each chunk's dispatch and combine, both ways; one counts exchange
            n = L.ep_overlap_chunks
            fwd_calls = 2 * n + (1 if w.model.moe_capacity_factor <= 0 else 0)
            calls = fwd_calls + 2 * n + (fwd_calls if L.recompute in ("full", "op") else 0)  # recomputed: the forward's
            add("ep", n_micro * calls * ep_layers, n_micro * ep_bytes)
        return {d: {"count": int(round(x[0])), "bytes": x[1]} for d, x in sorted(out.items())}

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
            bubble = min(bubble_lower_bound(sched, L.pp, n_micro, v, t_f, t_b) for sched, v in schedules)
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
                kinds, counts = T["kinds"], self.kind_counts
                options.append((sum(kinds[k][0] * n for k, n in counts.items()) + T["out_fwd"],
                                sum(kinds[k][1] * n for k, n in counts.items()) + T["out_bwd"],
                                sum(kinds[k][2] * n for k, n in counts.items()) + T["emb"] + T["pos_emb"]))
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
        opt = P * (pb + gb + ob) * 2 / max(1, n_shard) / self.bw
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


@lru_cache(maxsize=1024)
def _rank_held(sched: str, pp: int, v: int, n_micro: int) -> tuple:
    """Per pp rank, (its chunks' stages, ``rank_held_counts``): ``_held``'s per-rank terms."""
    chunks = chunks_per_rank(sched, v)
    return tuple((tuple(stage_of(sched, pp, r, c) for c in range(chunks)),
                  rank_held_counts(sched, pp, v, n_micro, r)) for r in range(pp))


def estimate(w: Workload, cluster: Cluster, L: Layout) -> Estimate:
    """Predict one layout (see ``CostModel``)."""
    return CostModel(w, cluster).estimate(L)


def _matmul_active(m: ModelConfig) -> float:
    """Parameters in a matmul per token in training: the layers, the output head, and each
    multi-token prediction depth's block, eh_proj and head (``presets.flops_per_token``)."""
    total = m.vocab_size * m.dim
    for i in range(m.n_layers):
        total += attention_params(m) + ffn_params(m, i, active=True)
    for i in range(m.n_layers, m.n_layers + m.mtp_depth):
        total += attention_params(m) + ffn_params(m, i, active=True) + 2 * m.dim * m.dim + m.vocab_size * m.dim
    return total


def megatron_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> int:
    """Narayanan et al. 2021, Eq. (3): FLOPs per iteration of a GPT model with full
    activation recomputation (4 forward-pass equivalents, 3 for the logit layer):
    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)), expanded so integers stay exact."""
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    return 96 * B * s * l * h * h + 16 * B * s * s * l * h + 6 * B * s * h * V


__all__ = ["Workload", "Layout", "Estimate", "estimate", "model_state_bytes", "layer_activation_bytes",
           "megatron_flops_per_iteration", "mlp_params"]
