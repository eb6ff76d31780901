"""One cost model: (model, cluster, layout, batch) -> predicted step time and memory per
device, each with a breakdown. ``docs/planner.md`` writes out every equation.

Conventions shared with the runtime:
- a layout is a ``ParallelConfig`` plus ``train.micro_batch`` and ``train.recompute``;
- mesh order (outermost first) pp, dp_replicate, dp_shard, cp, tp (``meshfold/mesh.py``):
  a dimension's groups are ``size`` ranks ``stride`` apart, stride = product of the sizes
  inside it, which decides the link level each group spans (``Cluster.link``);
- communication bytes follow ``meshfold/comm.py`` (bytes a rank sends, ring algorithm),
  per optimizer step, for global rank 0 (what ``metrics.jsonl`` reports as ``comm_bytes``).

The model is one class assembled from one module per concern: ``layer.py`` (the layer
terms, typed in ``terms.py``), ``pipeline.py`` (stages and schedule time), ``step.py``
(step time), ``memory.py``, ``traffic.py`` (collective counts) and ``bounds.py`` (the
search's bounds); ``workload.py`` holds what is priced."""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.models.counts import attention_params, ffn_params
from meshfold.planner import mtp
from meshfold.planner.bounds import SearchBounds
from meshfold.planner.cluster import Cluster, GiB
from meshfold.planner.layer import LayerCosts
from meshfold.planner.memory import Memory
from meshfold.planner.choices import refuse_open_choices
from meshfold.planner.optimizer import optimizer_pricing
from meshfold.planner.pipeline import PipelineTime
from meshfold.planner.step import StepTime
from meshfold.planner.traffic import Traffic
from meshfold.planner.workload import Estimate, Layout, Workload
from meshfold.ring import FACTORS as RING  # bytes a rank sends, per byte (ring algorithm)
from meshfold.ring import HOPS as STEPS  # sequential hops (alpha terms)


class CostModel(LayerCosts, PipelineTime, StepTime, Memory, Traffic, SearchBounds):
    """The cost model for one workload on one cluster. Pieces that many layouts share
    (per-layer times, stage splits) are cached, so a search evaluates a layout in tens of
    microseconds; ``estimate`` is the one entry point and gives the same numbers cached
    or not."""

    def __init__(self, w: Workload, cluster: Cluster):
        self.w, self.c = w, cluster
        refuse_open_choices(w)  # "auto" keys are meshfold plan's to resolve (planner/choices.py)
        self.optimizer = optimizer_pricing(w)  # what train.optimizer adds (planner/optimizer.py)
        m = w.model
        self.kinds = [m.is_moe_layer(i) for i in range(m.n_layers)]
        self.mtp_kinds = mtp.head_kinds(m, self.kinds)  # the blocks after the trunk (multi-token prediction)
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
            "of_which_tp_comm": n_micro * stage_layers[0] * (per_layer_ops + T.time.layer_regather) * T.time.tp_ar,
            "of_which_cp_comm": n_micro * stage_layers[0] * 3 * T.time.cp_fwd,
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


def estimate(w: Workload, cluster: Cluster, L: Layout) -> Estimate:
    """Predict one layout (see ``CostModel``)."""
    return CostModel(w, cluster).estimate(L)


def _matmul_active(m: ModelConfig) -> float:
    """Parameters in a matmul per token in training: the layers, the output head, and each
    multi-token prediction depth's block, eh_proj and head (``models/counts.py: flops_per_token``)."""
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

