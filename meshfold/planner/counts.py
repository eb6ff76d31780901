"""What one rank holds and sends, counted from the model and the layout alone (no times,
no cluster): bytes per parameter by numerics, model states by ZeRO stage, the parameters
tensor parallel keeps whole, gradient buckets, activation bytes per layer. The cost model
(``cost.py``) turns these into memory per device and collective volumes and prices them;
``docs/planner.md`` writes out every equation."""

from __future__ import annotations

import dataclasses
import math

from meshfold.errors import ConfigError
from meshfold.models import registry
from meshfold.models.config import ModelConfig
from meshfold.models.counts import attention_params, mlp_params
from meshfold.planner.attention import attention_terms

DTYPE_BYTES = {  # (parameter, gradient, optimizer incl. master copy, activation) bytes
    "bf16": (2, 2, 12, 2),  # mixed precision Adam: fp32 master + m + v = 12 (ZeRO paper's K)
    # meshfold's train.dtype = bfloat16: fp32 parameters and gradients, autocast to bf16
    "bf16-amp": (4, 4, 8, 2),
    "float32": (4, 4, 8, 4),
    "float64": (8, 8, 16, 8),
}
# Bytes per parameter on the wire for FSDP2 (all-gather in the compute dtype, gradient
# reduce-scatter in train.reduce_dtype = float32); DDP and ZeRO-1 send the stored dtypes.
FSDP_WIRE = {"bf16": (2, 2), "bf16-amp": (2, 4), "float32": (4, 4), "float64": (8, 8)}
# Data-parallel gradient buckets (DDP's bucket_cap_mb = 25; the same size for the
# once-per-step reductions of tp/pp layouts and ZeRO-1's parameter gather).
BUCKET_BYTES = 25 * 2**20


def tp_grad_bytes(dtype: str) -> int:
    """Bytes per element of a replicated weight's gradient as tensor parallel sums it over
    tp (``TensorParallelGroup.grad_sum``): the dtype backward makes it in, the compute
    weight's: FSDP2's mixed-precision ``param_dtype`` or the step's compute copy
    (``parallel/compute_weights.py``), bf16 for meshfold's bfloat16 in every layout."""
    return FSDP_WIRE[dtype][0]


def zero1_gather(dtype: str, tp: int, ep: int = 1) -> tuple[int, bool]:
    """ZeRO-1's all-gather of the updated parameters: (bytes per parameter, whether it is
    one flat call). Under meshfold's bfloat16 ``ShardedAdamW`` gathers the compute dtype
    straight into the step's compute weights, in one call, in every layout; otherwise it
    gathers the stored dtype, in one call with tp or ep (``ShardedAdamW``; with ep one for
    the dense part and one for the experts over edp), else in ``ZeroRedundancyOptimizer``'s
    buckets (optim/sharded.py). (Runs with a low-communication method, 1-bit Adam or live
    recovery keep the fp32 gather.)"""
    if dtype == "bf16-amp":
        return DTYPE_BYTES[dtype][3], True
    return DTYPE_BYTES[dtype][0], tp > 1 or ep > 1


def buckets(size_bytes: float) -> int:
    """Collective calls that move ``size_bytes`` in BUCKET_BYTES buckets."""
    return max(1, math.ceil(size_bytes / BUCKET_BYTES)) if size_bytes > 0 else 0


def reducer_buckets(sizes: list[float], bucket_bytes: int = BUCKET_BYTES) -> int:
    """Buckets ``GradReducer`` (parallel/dp/replicate.py) makes of parameters of ``sizes`` bytes in
    registration order: packed greedily in reverse order, a new bucket whenever the next
    parameter would overflow the current one (a parameter larger than a bucket gets its own)."""
    count, size = 0, bucket_bytes + 1
    for nbytes in reversed(sizes):
        if size + nbytes > bucket_bytes:
            count, size = count + 1, 0
        size += nbytes
    return count


def dense_layer_params_local(m: ModelConfig, tp: int) -> float:
    """One tp rank's attention and dense-MLP parameters (norms aside) under
    parallel/tp/plan.py's layout: wq, wo, w1, w3, w2 (and wk, wv when tp divides the kv
    heads) split over tp; whole on every rank: wk, wv otherwise, the per-head q/k norms and
    the biases of the row-parallel wo and w2. Equals the model's count at tp = 1."""
    h = m.dim
    row_bias = 2 * h if m.bias else 0  # wo's and w2's
    return attention_params_local(m, tp) + (mlp_params(m, m.hidden_dim) - h * (1 if m.bias else 0)) / tp + row_bias


def attention_params_local(m: ModelConfig, tp: int) -> float:
    """One tp rank's attention parameters (wo's bias aside) under parallel/tp/plan.py's layout,
    as the model's attention kind splits them (``planner/attention``)."""
    return attention_terms(m).params_local(m, tp)


def ddp_buckets(sizes: list[float], bucket_bytes: int = BUCKET_BYTES) -> int:
    """Buckets torch DDP cuts parameters of ``sizes`` bytes into, in registration order
    (``_compute_bucket_assignment_by_size``): a bucket closes as soon as it holds at least
    ``bucket_bytes``, so a parameter larger than a bucket closes the one it joins."""
    count, size = 0, 0.0
    for nbytes in sizes:
        size += nbytes
        if size >= bucket_bytes:
            count, size = count + 1, 0.0
    return count + (1 if size > 0 else 0)


def chunk_param_sizes(m: ModelConfig, tp: int, layers: int, first: bool, last: bool) -> list[float] | None:
    """Local parameter elements of one pipeline chunk (``layers`` blocks, the embedding if
    ``first``, the final norm and output if ``last``) in registration order, for the dense
    RMSNorm, bias-free, RoPE models whose tensors this knows; None for others."""
    if m.moe_experts or m.bias or m.qkv_bias or m.qk_norm or m.norm != "rmsnorm" or m.pos != "rope":
        return None
    h, hd, V = m.dim, m.head_dim, m.vocab_size
    kv_tp = tp if m.kv_heads % tp == 0 else 1  # replicated wk, wv when the kv heads do not split
    ffn = [h * m.hidden_dim / tp] * (3 if m.gated_mlp else 2)
    block = [h, h * m.n_heads * hd / tp, h * m.kv_heads * hd / kv_tp, h * m.kv_heads * hd / kv_tp,
             m.n_heads * hd * h / tp, h] + ffn
    sizes = ([V * h / tp] if first else []) + block * layers
    if last:
        sizes += [h] + ([] if (m.tie_embeddings and first) else [V * h / tp])
        # multi-token prediction depths (models/deepseek/mtp.py): enorm, hnorm, eh_proj (whole on every
        # tp rank), a block, the depth's norm
        sizes += ([h, h, 2 * h * h] + block + [h]) * m.mtp_depth
    return sizes


def moe_chunk_param_sizes(m: ModelConfig, layers: int, first: bool, last: bool,
                          ep: int = 1) -> list[tuple[float, bool]] | None:
    """``chunk_param_sizes`` for a chunk of blocks 0 .. ``layers`` - 1 of a MoE and/or
    multi-head latent attention model without tp: (local elements, routed expert or not) of
    every parameter in registration order (``ep``: each rank holds E/ep experts); None for
    models whose tensors this does not know (biases, layernorm, learned positions)."""
    if m.bias or m.qkv_bias or m.qk_norm or m.norm != "rmsnorm" or m.pos != "rope":
        return None
    h, V = m.dim, m.vocab_size
    attention = attention_terms(m).param_sizes(m)
    mats = 3 if m.gated_mlp else 2

    def block(layer: int) -> list[tuple[float, bool]]:
        out = [(h, False)] + [(x, False) for x in attention] + [(h, False)]
        if not m.is_moe_layer(layer):
            return out + [(h * m.hidden_dim, False)] * mats
        E_l, e = m.moe_experts // ep, m.expert_dim
        # models/moe.py: router, stacked experts (SwiGLU: fused w13), shared experts (w1, w2, w3)
        out += [(m.moe_experts * h, False), (E_l * (mats - 1) * e * h, True), (E_l * h * e, True)]
        return out + [(h * m.moe_shared_experts * e, False)] * (mats if m.moe_shared_experts else 0)

    sizes: list[tuple[float, bool]] = [(V * h, False)] if first else []
    for layer in range(layers):
        sizes += block(layer)
    if last:
        sizes += [(h, False)] + ([] if (m.tie_embeddings and first) else [(V * h, False)])
        for k in range(m.mtp_depth):  # multi-token prediction depth: enorm, hnorm, eh_proj, block, norm
            sizes += [(h, False), (h, False), (2 * h * h, False)] + block(m.n_layers + k) + [(h, False)]
    return sizes


def model_state_bytes(params: float, zero: int, shards: int, dtype: str = "bf16",
                      accumulate: bool = False) -> dict:
    """Parameters, gradients and optimizer states per device under ZeRO stage ``zero``
    with ``shards`` ranks sharing them (Rajbhandari et al. 2020, Sec. 5). ``accumulate``:
    gradients are reduced once per optimizer step over several micro-batches, so ZeRO-2/3
    hold them unsharded until then (FSDP2 without gradient sync keeps unsharded grads).
    ZeRO-1 with ``bf16-amp`` shards the fp32 parameters too (Megatron's distributed
    optimizer: the rank computes from the gathered bf16 copies)."""
    pb, gb, ob, _ = DTYPE_BYTES[dtype]
    n = max(1, shards)
    # ZeRO-1 under meshfold's bfloat16 keeps fp32 values only for the rank's own segment
    # (optim/sharded.py::ShardedAdamW; the bf16 compute copies are ``gathered_param_bytes``)
    sharded_params = zero >= 3 or (zero == 1 and dtype == "bf16-amp")
    return {"params": params * pb / (n if sharded_params else 1),
            "grads": params * gb / (n if zero >= 2 and not accumulate else 1),
            "optimizer": params * ob / (n if zero >= 1 else 1)}


def routed_params(m: ModelConfig) -> int:
    """Parameters of one MoE layer's routed experts (stacked ``experts.w*``, no biases)."""
    return m.moe_experts * mlp_params(dataclasses.replace(m, bias=False), m.expert_dim)


def routed_fraction(m: ModelConfig, s: int) -> float:
    """Rows the routed experts compute (and the ep all-to-alls carry) per (token, expert)
    assignment: 1 when dropless; with ``moe_capacity_factor`` c every expert has its
    C = ceil(c s k / E) slots per sequence of s tokens, filled or not (``models/moe.py``
    ``CapacitySlots``: padded to capacity), so E C / (s k)."""
    if m.moe_capacity_factor <= 0 or not m.moe_experts:
        return 1.0
    total, E = s * m.moe_topk, m.moe_experts
    return E * math.ceil(m.moe_capacity_factor * total / E) / total


def autocast_input_copies(m: ModelConfig, s: int, b: int, act: int, tp: int, sp: bool) -> float:
    """The bf16 copies autocast makes of the fp32 norm outputs, one per projection that
    reads them (q, k, v; w1 and w3, or w1), for one micro-batch of one layer. Not made under
    FSDP2's bf16 mixed precision, which casts each block's input to bf16 itself (the norm
    then keeps a bf16 output, which the projections share: within the norm's 8h + 4)."""
    return (3 + (2 if m.gated_mlp else 1)) * act * s * b * m.dim / (tp if sp else 1)


def layer_activation_bytes(m: ModelConfig, s: int, b: int, tp: int, sp: bool, recompute: str,
                           act: int, flash: bool, dropout: bool, amp: bool = False,
                           moe: bool | None = None) -> float:
    """Activation bytes one transformer layer keeps for backward, for one micro-batch of
    ``b`` sequences of ``s`` tokens on one device (Korthikanti et al. 2022, Sec. 4,
    generalised to GQA and SwiGLU; with GPT's shape, act=2, dropout and no flash it is
    exactly ``s b h (34 + 5 a s / h)`` at tp=1 and ``s b h (10 + 24/t + 5 a s / (h t))``).

    ``amp``: meshfold's ``train.dtype = bfloat16`` (fp32 parameters, bf16 compute): each
    RMSNorm keeps an fp32 copy of its input, its normalised output and 1/rms (8h + 4 bytes
    a token, ``models/llama.py``); ``autocast_input_copies`` are what autocast would add
    over fp32 weights (the caller takes them out: the blocks compute from bf16 weights).

    ``moe``: the layer is a MoE block (default: the model has experts); its experts keep
    the SwiGLU/GELU activations of the top-k rows each token is routed to (every slot
    under a capacity; ``moe_activation_bytes`` adds what routing and dispatch keep)."""
    h, a = m.dim, m.n_heads
    hkv = m.kv_heads * m.head_dim
    if recompute == "full":  # only the layer input survives (the residual stream: act-sized, as
        # the blocks compute from bf16 weights in every layout under bf16)
        return act * s * b * h / (tp if sp else 1)
    if recompute == "op":
        return op_kept_bytes(m, s, b, tp, sp, act, flash, moe)
    # Replicated across tp ranks unless sequence parallel: two norm inputs, the inputs of
    # the QKV and first MLP projections, and the two dropout masks (1 byte each).
    replicated = s * b * h * (2 * act + act + act) + (2 * s * b * h if dropout else 0)
    if amp:
        replicated = s * b * 2 * (8 * h + 4) + autocast_input_copies(m, s, b, act, 1, False) \
            + (2 * s * b * h if dropout else 0)
    if registry.post_norms(m):  # the attention and MLP outputs' norms keep their inputs too
        replicated += s * b * 2 * (8 * h + 4) if amp else 2 * act * s * b * h
    # Split over tp ranks: Q, K, V, attention output (input of the out-projection), the MLP
    # hidden activations (GELU: fc1 output and GELU output; SwiGLU: gate, silu(gate), up,
    # product), and the attention output dropout mask.
    f = m.hidden_dim
    mlp = (2 if m.mlp == "gelu" else 4) * act * s * b * f
    if (m.moe_experts > 0) if moe is None else moe:  # top-k experts each see the token
        mlp = (4 * act * s * b * m.expert_dim) * (m.moe_topk * routed_fraction(m, s) + m.moe_shared_experts)
    split = act * s * b * (2 * h + 2 * hkv) + mlp
    # the attention kind's own kept bytes in place of the q, k, v, out above (planner/attention)
    split, replicated, whole = attention_terms(m).kept_bytes(m, s, b, tp, recompute, act, amp, split, replicated)
    # Scores: softmax output, dropout mask and dropout output (5 a s^2 b with act=2);
    # fused attention keeps only the log-sum-exp.
    if flash or recompute == "selective":
        scores = 0.0 if not flash else 4 * a * s * b
    else:
        scores = a * s * s * b * (act + (1 + act if dropout else 0))
    return (replicated / (tp if sp else 1)) + (split + scores) / tp + whole


def op_kept_bytes(m: ModelConfig, s: int, b: int, tp: int, sp: bool, act: int, flash: bool,
                  moe: bool | None = None) -> float:
    """What ``train.recompute = "op"`` keeps of one layer (``parallel/recompute.py``, torchtitan's
    op policy), for one micro-batch of ``b`` sequences of ``s`` tokens on one device: the
    block input (a 1/tp sequence slice with sp), the output of every
    other matmul in the order the block calls them (wq, wk, wv, wo, w1, w3, w2: q, v, w1's
    and w2's outputs are kept), and the fused attention kernel's output and log-sum-exp
    (an unfused attention keeps nothing: its batched matmuls are recomputed). Under tp the
    column-parallel outputs are this rank's heads or hidden units over the whole sequence
    (sp gathers it first); a row-parallel output is the full-width partial sum, before the
    reduction. Dense (non-MLA) blocks only."""
    if not attention_terms(m).op_recompute or ((m.moe_experts > 0) if moe is None else moe):
        raise ConfigError('train.recompute = "op": the planner prices it for dense attention blocks only '
                          '(no MLA, no MoE); use "selective" or "full"')
    h, hd = m.dim, m.head_dim
    q = m.n_heads * hd / tp
    kv = m.kv_heads * hd / tp if m.kv_heads % tp == 0 else hd  # replicated kv: one head per rank
    f = m.hidden_dim / tp
    widths = [q, kv, kv, h] + ([f, f, h] if m.gated_mlp else [f, h])
    kept = act * s * b * sum(widths[0::2])
    attention = (act * q + max(4, act) * m.n_heads / tp) * s * b if flash else 0.0
    block_input = act * s * b * h / (tp if sp else 1)  # the bf16 residual stream under amp too
    return block_input + kept + attention


def moe_activation_bytes(m: ModelConfig, s: int, b: int, tp: int, ep: int, act: int, sp: bool = False,
                         ep_chunks: int = 1, aligned: bool = True, expert_tp: int = 1) -> float:
    """What a MoE block keeps for backward beyond ``layer_activation_bytes``'s expert
    activations, for one micro-batch of b sequences of s tokens on one rank, as
    ``models/moe.py`` and ``parallel/ep/dispatch.py`` run it under a balanced router: the router's
    scores (T x E, >= fp32), the chosen experts and gates; the A = T k / tp assignments of
    this rank's expert column (every capacity slot under a capacity) enter the experts as act-sized
    rows, with their int64 row indices; the rows coming back are added per token with an
    ``index_add`` in >= fp32, which keeps its A x dim source. With ep > 1 the all-to-all
    dispatcher weights the returned rows by their gates first (``combine``: the product
    keeps the fp32 rows, A x dim more); without ep the gates are folded into the experts
    (the gated A x min(expert_dim, dim) product). With ``sp`` each tp rank routes its 1/tp of
    the tokens (router state / tp); the experts still see their column of all of them.
    Experts split inside (``expert_tp``): every tp rank's experts take all T k assignments,
    each E/ep local expert 1/tp wide (``layer_activation_bytes`` has the hidden units)."""
    T, h, E, k = s * b, m.dim, m.moe_experts, m.moe_topk
    A = T * k * routed_fraction(m, s) / (tp if expert_tp == 1 else 1)
    wide = max(4, act)
    router = T * E * wide + T * k * (8 + wide) + (T * wide if m.moe_norm_topk else 0)
    router /= tp if sp else 1
    if ep > 1:  # rows in (act), their ids (gather, order, regroup, back), combine's fp32 rows twice + gates
        dispatch, ids = A * h * act + A * (2 * h + 1) * wide, 5 * A * 8
    else:  # gathered rows and their ids, the gated product and the gates, the fp32 sum's source
        dispatch, ids = A * h * act + A * (min(m.expert_dim, h) + 1) * act + A * h * wide, A * 8
    if m.moe_capacity_factor > 0:  # fixed slots (models/moe.py CapacitySlots): one batched matmul,
        # no aligned groups; each slot's token id and filled flag, each assignment's slot (int64)
        # and kept flag for its gate (every assignment: tp ranks route the same tokens)
        return router + dispatch + A * 9 + T * k * 9
    dispatch += ids
    # The grouped GEMM's groups padded to 16 bytes of rows (models/moe.py GROUP_ALIGN_BYTES):
    # up to align - 1 rows more per local expert, with their input and hidden activations,
    # and each row's place in the padded layout (int64). Pipelined in ``ep_chunks`` chunks
    # (``parallel.ep_overlap_chunks``), every chunk's groups are padded. CUDA only
    # (``aligned``): the CPU kernel takes groups as they are.
    if not aligned:
        return router + dispatch
    align = max(1, 16 // act)
    local_e, width = (E / ep / (tp if ep == 1 else 1), m.expert_dim) if expert_tp == 1 else (E / ep, m.expert_dim / tp)
    padding = ep_chunks * (align - 1) * local_e * (h + 4 * width) * act + A * 8
    return router + dispatch + padding
