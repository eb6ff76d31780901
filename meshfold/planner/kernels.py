"""Per-kernel pieces of the cost model (``cost.py``): a GEMM's time by its shape, a
block's GEMM shapes and memory-bound bytes, one collective's alpha-beta time, the tiles a
ring's attention runs. Pure functions of the model, the device and the shapes."""

from __future__ import annotations

import math

from meshfold.models import registry
from meshfold.models.config import ModelConfig
from meshfold.planner.attention import attention_terms
from meshfold.planner.cluster import Cluster
from meshfold.ring import FACTORS as RING  # bytes a rank sends, per byte (ring algorithm)
from meshfold.ring import HOPS as STEPS  # sequential hops (alpha terms)


def matmul_efficiency(cluster: Cluster, width: float) -> float:
    """Achievable fraction of peak for GEMMs whose per-device width is ``width``."""
    d = cluster.device
    return d.matmul_eff * width / (width + d.matmul_half_width)


def gemm_time(d, m: float, n: float, k: float, width: float, operand_bytes: int = 2,
              fp8: bool = False, out_bytes: int = 0) -> float:
    """Seconds for one GEMM (m x k) @ (k x n) on device ``d``: its FLOPs at the device's
    achievable rate (``matmul_eff`` of the bf16 or fp8 peak), lowered by tile
    quantization (an output dimension below a multiple of ``gemm_tile`` wastes the rest of
    its last tile) and wave quantization (the tiles run in waves of one per SM; a partial
    last wave idles the other SMs), both from NVIDIA's "Matrix Multiplication Background"
    guide (MAMF is measured at shapes with neither), or its HBM traffic
    (operands once, output once) when that takes longer (the roofline: skinny GEMMs are
    memory bound). On a device whose GEMM kernels run one output tile per thread block
    (``Device.gemm_epilogue_k`` > 0: cuBLAS on Ampere) each tile ends with its epilogue,
    the write of the tile after its k-loop, while its SM's tensor cores wait: per tile
    ``ob`` bytes an output at the SM's share of HBM (the tiles of a wave finish together)
    against 2 k FLOPs an output at its share of the GEMM rate, i.e. the loop lengthened by
    k0 = ob peak eff / (2 HBM hbm_eff) k-steps, the device's machine balance (A100: 146).
    MAMF was measured at k = ``gemm_epilogue_k`` (A100: 2048, bf16 out) and is the most any
    shape reaches, so a GEMM runs max(1, (1 + k0/k) / (1 + k0_MAMF/k_MAMF)) slower (A100,
    k = 768: 11 %; the attention scores' k = head dim 96: 2.35x; a weight gradient over 2048
    tokens accumulated in fp32, 8 bytes an output: 20 %). Hopper's
    persistent warp-specialized kernels overlap one tile's epilogue with the next one's
    loop (an 8192^3 product ran at 798 TFLOP/s on an H100 here, MAMF's 792). ``out_bytes``:
    what the epilogue moves per output (0: writes it in the operand dtype; an fp32 gradient
    accumulated in place reads and writes 8). ``width``: the CPU calibration's fall-off
    (``matmul_efficiency``)."""
    flops = 2.0 * m * n * k
    peak = (d.fp8_tflops if fp8 and d.fp8_tflops else d.peak_tflops) * 1e12
    eff = d.matmul_eff * (width / (width + d.matmul_half_width) if d.matmul_half_width else 1.0)
    tile = d.gemm_tile
    if not tile:
        return flops / (peak * eff)
    tiles_m, tiles_n = math.ceil(m / tile), math.ceil(n / tile)
    q = (m / (tiles_m * tile)) * (n / (tiles_n * tile))
    if d.sms:  # wave quantization: the tiles run in waves of one per SM
        tiles = tiles_m * tiles_n
        q *= tiles / (math.ceil(tiles / d.sms) * d.sms)
    ab = 1 if fp8 and d.fp8_tflops else operand_bytes
    hbm = d.hbm_GBps * 1e9 * d.hbm_eff
    ob = out_bytes or operand_bytes
    traffic = ab * (m * k + k * n) + ob * m * n
    slower = 1.0
    if d.gemm_epilogue_k:
        k0 = peak * eff / (2 * hbm)  # k-steps a tile's write costs, per byte an output
        slower = max(1.0, (1 + ob * k0 / k) / (1 + operand_bytes * k0 / d.gemm_epilogue_k))
    return max(flops / (peak * eff * q) * slower, traffic / hbm)


def gemm_backward_time(d, m: float, n: float, k: float, width: float, operand_bytes: int = 2,
                       fp8: bool = False, wgrad_fused: bool = False) -> tuple[float, float]:
    """The backward of ``gemm_time``'s (m x k) @ (k x n): the input gradient (m x n) @
    (n x k) and the weight gradient (k x m) @ (m x n), each by its own shape (the weight
    gradient's inner dimension is the tokens). ``wgrad_fused``: the weight gradient is
    accumulated into an fp32 buffer by the GEMM (Megatron's gradient-accumulation fusion:
    its epilogue reads and writes 8 bytes an output)."""
    return (gemm_time(d, m, k, n, width, operand_bytes, fp8),
            gemm_time(d, k, n, m, width, operand_bytes, fp8, 8 if wgrad_fused else 0))


def layer_gemms(m: ModelConfig, tp: int, moe: bool) -> list[tuple[float, float]]:
    """(output columns, inner dimension) per device of a block's linear layers, in the
    order the forward runs them (q, k, v, o; w1, w3, w2 or w1, w2); a MoE block's
    experts as one dense MLP of the active width (top-k experts' hidden per token)."""
    h = m.dim
    out = attention_terms(m).gemms(m, tp)  # the attention's, by its kind (planner/attention)
    f = (m.moe_topk * m.expert_dim + m.moe_shared_experts * m.expert_dim) if moe else m.hidden_dim
    if m.gated_mlp:
        out += [(f / tp, h), (f / tp, h), (h, f / tp)]
    else:
        out += [(f / tp, h), (h, f / tp)]
    return out


# Bytes a Float8 cast moves per element of its high-precision operand (torchao's dynamic
# scaling, bf16 in). Fused (``train.compile``: inductor makes one kernel of the cast): the amax
# read, the read and the 1-byte write. Eager, torchao runs it op by op: abs (read 2, write 2),
# max (read 2), the upcast to fp32 (2 + 4), the scale multiply (4 + 4), the clamp (4 + 4) and
# the conversion (4 + 1), then the copy into the other GEMM operand's layout (1 + 1). On an
# H200 the eager fp8 step of llama3-8b's widths ran 1.51x slower than bf16 (docs/gpu.md).
FP8_CAST_BYTES = {"fused": 5, "eager": 35}


def fp8_cast_elements(shapes: list[tuple[float, float]]) -> tuple[float, float]:
    """Elements per token a block's Float8 linears cast, (forward, backward), as torchao's
    ``Float8Linear`` runs them (``matmul_with_hp_or_float8_args``: it saves the bf16 input
    and weight and casts again in backward): forward each linear's input (its inner
    dimension k); backward its output gradient twice (e5m2 for the input gradient's GEMM,
    and again in the other layout for the weight gradient's: 2 n) and its input again for
    the weight gradient's GEMM (k). ``shapes``: (n, k) per linear (``layer_gemms``). The
    weights are cast once each way (forward, and for the input gradient's GEMM)."""
    return sum(k for _, k in shapes), sum(2 * n + k for n, k in shapes)


def elementwise_bytes(m: ModelConfig, tokens: float, s: int, tp: int, sp: bool, act: int, amp: bool,
                      flash: bool, dropout: bool, kernels: str, moe: bool = False) -> tuple[float, float, float, float]:
    """HBM bytes of one block's memory-bound ops for ``tokens`` tokens on one device:
    (forward, the attention core's share of it, autograd's sums of the gradients of
    tensors several ops read in backward — the norm outputs read by q, k, v (and w1, w3),
    the residual stream read by a norm and an add — one read-read-write each, and the
    backward's own kernels). Counted op by op from the model
    code (``models/llama.py``, ``feedforward.py``): each kernel reads its inputs and
    writes its output once. ``eager``: RMSNorm as written (upcast, square, mean, scale,
    downcast, weight: 28 + 4a bytes an element; under autocast the input is already fp32,
    28), RoPE on q and k (upcast, four products, two sums, stack, downcast: 40 + 2a),
    SwiGLU's silu and product (5a per hidden element; tanh-GELU 2a), two residual adds
    (2r + a each, r = the residual stream's bytes: fp32 under autocast), the attention
    output's transpose copy (2a), autocast's bf16 copy of the norm output per projection
    (6 bytes an element each), and without fused attention the scores' scale, mask and
    softmax (3 passes of 2a) and dropout (2a + 1) per score. ``fused``: one read and one
    write per fusion group (LayerNorm/RMSNorm 2a, RoPE 2a, bias-GELU 2a or SwiGLU 3a per
    hidden element, bias-dropout-add 3a + 1, softmax 2a). Sequence parallel splits the
    norms and residual adds over tp; without it every tp rank runs them whole.
    Backward: ``eager``, twice the forward (an op's gradient reads the output gradient and
    its saved operands and writes one gradient per operand, in about as many kernels);
    ``fused``, each fused group's backward kernel counted as it runs (Megatron's
    ``fused_layer_norm``, ``bias_gelu_back``, ``bias_dropout_add``'s, the scaled masked
    softmax's backward; torch.compile's backward groups alike): a norm reads x and dy and
    writes dx (3a), RoPE and the transpose 2a, bias-GELU 3a (SwiGLU 5a: x1, x3 and dy in,
    dx1 and dx3 out), dropout's mask-multiply 2a + 1 (the residual add passes its gradient
    through; without dropout the bias gradient's read a), softmax y, dy in, dx out (3a),
    the scores' dropout 2a + 1."""
    a = act
    r = 4 if amp else a
    h = m.dim
    hn = h / tp if sp else h  # norms and residual adds: sequence-split with sp, else replicated
    hq = m.n_heads * m.head_dim / tp
    hk = m.kv_heads * m.head_dim / min(tp, m.kv_heads) if m.kv_heads % tp else m.kv_heads * m.head_dim / tp
    f = ((m.moe_topk + m.moe_shared_experts) * m.expert_dim if moe else m.hidden_dim) / tp
    swiglu = m.gated_mlp
    rope = m.pos == "rope"
    scores = 0.0 if flash else (m.n_heads / tp) * s  # score elements per token
    drop = 1.0 if dropout else 0.0
    # norms over the residual width: two, four where the family also normalises the attention
    # and MLP outputs (``registry.post_norms``: Gemma 3's sandwich); per-head q/k norms
    # (``qk_norm``) over the q and k elements, from the projections' compute-dtype outputs
    n_norms = 4 if registry.post_norms(m) else 2
    qk = hq + hk if m.qk_norm else 0.0
    if kernels == "fused":
        norm = 2 * a
        per_token = (n_norms * norm * hn + norm * qk + (2 * a * (hq + 2 * hk) if rope else 0.0) + 2 * a * hq
                     + (3 * a if swiglu else 2 * a) * f + 2 * (3 * a + drop) * hn)
        attn = scores * (2 * a + drop * (2 * a + 1))
        bwd = (n_norms * 3 * a * hn + 3 * a * qk + (2 * a * (hq + 2 * hk) if rope else 0.0) + 2 * a * hq
               + (5 * a if swiglu else 3 * a) * f + 2 * (2 * a + 1 if dropout else a) * hn
               + scores * (3 * a + drop * (2 * a + 1)))
    else:
        if m.norm == "layernorm":
            norm = 2 * r  # nn.LayerNorm: one kernel
        else:
            norm = 28 + (0 if amp else 4 * a)
        casts = (3 + (2 if swiglu else 1)) * 6 if amp else 0.0
        # (a MoE block's routed experts may run a family's registered activation: its own count)
        glu = (registry.mlp_elements(m.mlp) if moe else None) or 5
        per_token = (n_norms * norm * hn + (28 + 4 * a) * qk + casts * h
                     + ((40 + 2 * a) * (hq + hk) if rope else 0.0) + 2 * a * hq
                     + (glu * a if swiglu else 2 * a) * f + 2 * (2 * r + a + drop * (2 * a + 1)) * hn)
        attn = scores * (3 * 2 * a + drop * (2 * a + 1))
        bwd = 2 * (per_token + attn)
    g = 4 if amp else a  # the norm outputs' gradients: fp32 behind autocast's casts
    sums = 3 * g * (2 + (1 if swiglu else 0)) * h + 2 * 3 * r * hn
    return tokens * (per_token + attn), tokens * attn, tokens * sums, tokens * bwd


def moe_routing_bytes(m: ModelConfig, tp: int, sp: bool, act: int, rows: float) -> tuple[float, float]:
    """HBM bytes per token of a MoE block's routing as ``models/moe.py`` runs it (dropless
    ``LocalDispatcher`` or capacity slots), (forward, backward); ``rows`` routed rows per
    token (top-k, or every capacity slot's share). Forward: the rows gathered (read and write
    each, ``gather_rows``), the gates applied to the experts' hidden rows (read, write), and
    ``scatter_add_rows``: an fp32 zero buffer per token, the rows upcast (a in, 4 out),
    ``index_add`` (read the row, read and write its token's sum: 12) and the sums cast back
    (4 in, a out). Backward: the output gradient upcast, ``index_add``'s gradient (an
    ``index_select``: 4 + 4 a row) and the rows' cast back (4 + a), the gates' gradient
    (the hidden rows and their gradient read, the scaled gradient written) and the gather's
    gradient (``_GatherRows``: a zero buffer per token, then ``index_add`` of the rows: read
    the row, read and write the sum). Rows are h / tp wide (a tp rank routes its expert
    column's share), the token side as wide as the block's residual (h / tp with sp)."""
    a = act
    h = m.dim / tp
    hn = m.dim / tp if sp else m.dim
    f = m.expert_dim / tp
    fwd = rows * ((2 * a + a + 4 + 12) * h + 2 * a * f) + (4 + 4 + a) * hn
    bwd = rows * ((8 + 4 + a + 3 * a) * h + 4 * a * f) + (a + 4 + a) * hn
    return fwd, bwd


def collective_time(cluster: Cluster, op: str, size_bytes: float, n: int, stride: int,
                    in_step: bool = False) -> float:
    """alpha-beta time of one collective over a group of n ranks ``stride`` apart.
    ``in_step``: the ranks arrive in step (right after another collective), so its hops
    cost the cluster's ``in_step_alpha_us`` where set."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    alpha, beta = cluster.link(stride, n)
    if in_step and cluster.in_step_alpha_us > 0:
        alpha = cluster.in_step_alpha_us * 1e-6
    return STEPS[op](n) * alpha + RING[op](n) * size_bytes / beta


def attention_tiles_per_rank(cp: int, ring: int) -> float:
    """Visible (query, key) tiles one rank computes per layer in the tiled attention that
    context parallelism runs: tiles of seq / (2 max(cp, 4)) tokens (the rule in
    ``parallel/cp/ring.py``), so T = 2 max(cp, 4) per side, T (T + 1) / 2 under the causal
    mask, split over the ``ring`` members (Ulysses ranks each see every tile)."""
    t = 2 * max(cp, 4)
    return t * (t + 1) / 2 / ring
