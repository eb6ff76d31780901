"""What ``train.optimizer`` adds to a step, per kind (``OPTIMIZERS``): AdamW's pass and states
are ``StepTime``'s and ``Memory``'s own terms (it adds nothing); Muon (optim/muon/) adds its
Newton-Schulz FLOPs on each matrix's owner, the owner-computes exchange (two all-to-alls per
same-shape bucket over the dp_shard / tp group, as ``optim/muon/exchange.py`` issues them),
keeps one momentum instead of Adam's two moments for its matrices, and leaves ZeRO-1's
sharding off (every replica computes the whole update). docs/optimizers.md, "Cost".

A new optimizer is a class with the methods of ``AdamWPricing`` and one line in
``OPTIMIZERS``; ``CostModel`` asks ``optimizer_pricing(workload)``. Torch-free."""

from __future__ import annotations

import math

from meshfold.errors import ConfigError
from meshfold.models.config import ModelConfig
from meshfold.optim.muon.ownership import assign_owners, gather_segment
from meshfold.parallel.facts.sizes import expert_shard_dim
from meshfold.planner import mtp
from meshfold.planner.attention import attention_terms
from meshfold.planner.counts import DTYPE_BYTES, attention_params_local, chunk_param_sizes, moe_chunk_param_sizes
from meshfold.planner.workload import Layout, Workload
from meshfold.ring import FACTORS as RING

# Bytes per parameter of one Adam moment (Muon keeps one momentum in its place).
MOMENT_BYTES = {"bf16": 4, "bf16-amp": 4, "float32": 4, "float64": 8}
# Newton-Schulz GEMMs off the bf16 tensor cores (float32 / float64): this fraction of the peak.
SLOW_GEMM = 1 / 16


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of one rows x cols matrix's orthogonalisation: per step X X^T, A A and (.) X on
    the wide orientation (as ``optim/muon/newton_schulz.py``)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * 2 * (m * m * n + m * m * m + m * m * n)


def block_matrices(m: ModelConfig, tp: int) -> list[tuple[int, int, int | None]] | None:
    """One dense block's Muon matrices as (rows, cols, tp-sharded dimension or None), in the
    tp plan's layout (parallel/tp/plan.py: wq, wk, wv, w1, w3 column-parallel, wo, w2 row-
    parallel; wk, wv whole when tp does not divide the kv heads); None for models whose
    tensors ``chunk_param_sizes`` does not know (MoE, latent attention)."""
    if chunk_param_sizes(m, tp, 1, False, False) is None or m.attention != "gqa":
        return None
    h, q, kv = m.dim, m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    kv_dim = 0 if m.kv_heads % tp == 0 else None
    ffn = [(m.hidden_dim, h, 0), (h, m.hidden_dim, 1)] + ([(m.hidden_dim, h, 0)] if m.gated_mlp else [])
    return [(q, h, 0), (kv, h, kv_dim), (kv, h, kv_dim), (h, q, 1)] + ffn


def layer_matrices(m: ModelConfig, layer: int) -> list[tuple[int, int, int, bool]]:
    """Block ``layer``'s Muon matrices without tp, as (rows, cols, matrices, routed expert
    stack): the attention's projections (any kind: latent attention's down- and
    up-projections too, ``gemms``), then a dense FFN, or an MoE layer's stacked experts
    ([E, a, b]: E matrices; SwiGLU's fused w13) and shared experts (the router is AdamW's);
    a multi-token prediction depth (layer >= n_layers) adds its eh_proj."""
    h = m.dim
    out = [(int(r), int(c), 1, False) for r, c in attention_terms(m).gemms(m, 1)]
    gated = m.gated_mlp
    if m.is_moe_layer(layer):
        E, e, s = m.moe_experts, m.expert_dim, m.moe_shared_experts * m.expert_dim
        out += [((2 if gated else 1) * e, h, E, True), (h, e, E, True)]
        out += [(s, h, 1, False), (h, s, 1, False)] + ([(s, h, 1, False)] if gated else []) if s else []
    else:
        out += [(m.hidden_dim, h, 1, False), (h, m.hidden_dim, 1, False)] + ([(m.hidden_dim, h, 1, False)] if gated else [])
    return out + ([(h, 2 * h, 1, False)] if layer >= m.n_layers else [])


def muon_params_local(m: ModelConfig, tp: int, ep: int) -> tuple[float, float]:
    """(Muon's matrix elements, all parameter elements) of the whole model on one tp rank:
    the blocks' projections and experts vs also embeddings, output, norms, routers."""
    h, V = m.dim, m.vocab_size
    mats = 3 if m.gated_mlp else 2
    muon = total = 0.0
    for layer in range(m.n_layers + m.mtp_depth):
        attention = attention_params_local(m, tp)
        if m.is_moe_layer(layer):
            ffn = (m.moe_experts * mats * h * m.expert_dim / ep + mats * h * m.moe_shared_experts * m.expert_dim) / tp
            router = m.moe_experts * h
        else:
            ffn, router = mats * h * m.hidden_dim / tp, 0
        muon += attention + ffn + (2 * h * h if layer >= m.n_layers else 0)
        total += attention + ffn + router + 2 * h + (2 * h * h + 3 * h if layer >= m.n_layers else 0)
    total += V * h / tp * (1 if m.tie_embeddings else 2) + h
    return muon, total


def zero_one_tensors(m: ModelConfig, tp: int) -> list[tuple[float, float, int | None]] | None:
    """Every parameter of the whole model as (global elements, elements on one tp rank,
    kind), in registration order, for the models ``chunk_param_sizes`` knows: kind None for
    AdamW's, j for a block's j-th matrix of ``block_matrices``, -1 for another Muon matrix
    (multi-token prediction's eh_proj). What ZeRO-1's whole-parameter ownership
    (optim/muon/ownership.py) is computed from."""
    whole, local = chunk_param_sizes(m, 1, m.n_layers, True, True), chunk_param_sizes(m, tp, m.n_layers, True, True)
    if whole is None or local is None:
        return untp_tensors(m) if tp == 1 else None
    mats = 3 if m.gated_mlp else 2
    block = [None, 0, 1, 2, 3, None] + list(range(4, 4 + mats))  # norm, wq, wk, wv, wo, norm, w1, w2 (, w3)
    kinds = [None] + block * m.n_layers + [None] + ([] if m.tie_embeddings else [None])
    kinds += ([None, None, -1] + block + [None]) * m.mtp_depth  # enorm, hnorm, eh_proj, block, norm
    if len(kinds) != len(whole):
        return None
    return list(zip(whole, local, kinds))


def untp_tensors(m: ModelConfig) -> list[tuple[float, float, int | None]] | None:
    """``zero_one_tensors`` without tp for the MoE / latent-attention models
    ``moe_chunk_param_sizes`` knows (kind -1 for every Muon matrix): the attention's matrices
    are its ``gemms`` in order, the rest of its tensors norms; a MoE layer's router AdamW's,
    its expert stacks and shared experts Muon's."""
    every = moe_chunk_param_sizes(m, m.n_layers, True, True)
    if every is None:
        return None
    terms = attention_terms(m)
    gemms = [r * c for r, c in terms.gemms(m, 1)]
    attention, g = [], 0
    for size in terms.param_sizes(m):
        hit = g < len(gemms) and size == gemms[g]
        attention.append(hit)
        g += hit
    mats = 3 if m.gated_mlp else 2

    def block(layer: int) -> list[bool]:  # (moe_chunk_param_sizes' order)
        ffn = ([False, True, True] + [True] * (mats if m.moe_shared_experts else 0) if m.is_moe_layer(layer)
               else [True] * mats)
        return [False] + attention + [False] + ffn

    muon = [False] + [x for layer in range(m.n_layers) for x in block(layer)] + [False]
    muon += [] if m.tie_embeddings else [False]
    for k in range(m.mtp_depth):
        muon += [False, False, True] + block(m.n_layers + k) + [False]
    if len(muon) != len(every):
        return None
    return [(e, e, -1 if mat else None) for (e, _), mat in zip(every, muon)]


class AdamWPricing:
    """AdamW: priced by ``StepTime`` and ``Memory`` themselves; nothing to add."""

    zero_one_shards = True  # ZeRO-1 shards its states (optim/sharded.py)

    def model_states(self, cost, L: Layout, states: dict, zero: int) -> dict:
        """A rank's parameter, gradient and optimizer bytes as ``Memory`` counted them for AdamW."""
        return states

    def step_time(self, cost, L: Layout, layers: int) -> float:
        return 0.0

    def collectives(self, cost, L: Layout, layers: int) -> list[tuple[str, int, float]]:
        return []


class MuonPricing(AdamWPricing):
    """Muon on the dense models whose matrices ``block_matrices`` lists (exchange and FLOPs
    exact); elsewhere only its memory is priced. ZeRO-1 is whole-parameter ownership
    (optim/muon/zero_one.py): exact where ``zero_one_tensors`` knows the model and pp = 1,
    else the states' 1/n share."""

    zero_one_shards = False  # not AdamW's flat segments: its own gather (``collectives``)

    def model_states(self, cost, L: Layout, states: dict, zero: int) -> dict:
        w = cost.w
        ob = DTYPE_BYTES[w.dtype][2]
        muon, total = muon_params_local(w.model, L.tp, max(1, L.ep))
        saved = min(1.0, muon / total) * MOMENT_BYTES[w.dtype] / ob  # one moment instead of two
        optimizer = states["optimizer"] * (1 - saved)
        owned = self.zero_one_owned(cost, L) if zero == 1 else None
        if owned is not None:  # the fullest rank's owned states: a matrix one momentum, the rest AdamW's
            moment = MOMENT_BYTES[w.dtype]
            optimizer = max(sum(lo * (ob if kind is None else ob - moment) for _, lo, kind in mine) for mine in owned)
        # fp32 values are not sharded (bf16-amp's ZeRO-1 by AdamW's segments shards them)
        whole = L.dp_shard * L.cp if zero == 1 else 1
        params = states["params"] * (whole if w.dtype == "bf16-amp" else 1)
        return {**states, "params": params, "optimizer": optimizer}

    @staticmethod
    def zero_one_owned(cost, L: Layout) -> list[list[tuple[float, float, int | None]]] | None:
        """ZeRO-1's parameters of each dp_shard x cp rank (``assign_owners``), where known."""
        n = L.dp_shard * L.cp
        tensors = zero_one_tensors(cost.w.model, L.tp) if L.pp == 1 and max(1, L.ep) == 1 and n > 1 else None
        if tensors is None:
            return None
        owners = assign_owners([g for g, _, _ in tensors], [kind is not None for _, _, kind in tensors], n)
        return [[t for t, r in zip(tensors, owners) if r == k] for k in range(n)]

    def zero_one_gather(self, cost, L: Layout) -> tuple[int, float]:
        """ZeRO-1's all-gather of the owners' updated parameters, in their dtype: (group size,
        bytes of its output); every rank's piece is the fullest rank's (the 1/n share where
        ``zero_one_owned`` does not know the model)."""
        n = L.dp_shard * L.cp
        owned = self.zero_one_owned(cost, L)
        if owned is None:
            segment = muon_params_local(cost.w.model, L.tp, max(1, L.ep))[1] / L.pp / n
        else:
            segment = max(sum(lo for _, lo, _ in mine) for mine in owned)
        return n, n * segment * DTYPE_BYTES[cost.w.dtype][0]

    def buckets(self, cost, L: Layout, layers: int) -> list[tuple[int, int, int, int, int]]:
        """Rank 0's same-shape buckets over ``layers`` blocks: (rows, cols, matrices, group
        size, group stride, largest piece in elements); group size 1 where the matrices are
        whole here. (FSDP's group alone is ``tp`` ranks apart; with tp, one flattened group.)
        Under ZeRO-1 the matrices rank 0 owns (``zero_one_owned``)."""
        mats = block_matrices(cost.w.model, L.tp)
        if mats is None:
            return self.untp_buckets(cost, L, layers) if L.tp == 1 else []
        fsdp = L.dp_shard * L.cp if L.zero >= 2 else 1
        counts = [layers] * len(mats)
        owned = self.zero_one_owned(cost, L) if L.zero == 1 else None
        if owned is not None:
            counts = [sum(1 for *_, kind in owned[0] if kind == j) for j in range(len(mats))]
        grouped: dict[tuple, int] = {}
        for (rows, cols, tp_dim), count in zip(mats, counts):
            tp = L.tp if tp_dim is not None else 1
            key = (rows, cols, tp_dim if tp > 1 else None)
            grouped[key] = grouped.get(key, 0) + count
        out = []
        for (rows, cols, tp_dim), k in grouped.items():
            if not k:
                continue
            if not k:
                continue
            tp = L.tp if tp_dim is not None else 1
            # FSDP2 shards dim 0 (after tp's own split of it): uneven pieces padded to the largest
            r = rows // tp if tp_dim == 0 else rows
            c = cols // tp if tp_dim == 1 else cols
            out.append((rows, cols, k, fsdp * tp, L.tp if tp == 1 else 1, -(-r // fsdp) * c))
        return out

    @staticmethod
    def untp_buckets(cost, L: Layout, layers: int) -> list[tuple[int, int, int, int, int]]:
        """``buckets`` without tp for any block (``layer_matrices``: MoE, latent attention,
        multi-token prediction; the first ``layers`` blocks, and the depths where pp = 1).
        FSDP2 shards a matrix's rows over dp_shard x cp (padded), and a stack of E_l experts
        over its own group (edp with ep, else the same) on ``expert_shard_dim``'s dimension:
        the stack's (whole matrices on the rank, ceil(E_l / n) of them: no exchange) or a
        matrix dimension (an exchange, a bucket of its own). ZeRO-0/1: every matrix whole."""
        m = cost.w.model
        ep = max(1, L.ep)
        fsdp = L.dp_shard * L.cp if L.zero >= 2 else 1
        edp = (L.dp_shard * L.cp // ep if ep > 1 else fsdp) if L.zero >= 2 else 1
        # (the multi-token prediction depths where rank 0 holds the last stage: pp = 1)
        blocks = list(range(layers)) + [m.n_layers + k for k in range(mtp.heads_on(m, L.pp == 1))]
        grouped: dict[tuple, int] = {}
        for layer in blocks:
            for rows, cols, k, expert in layer_matrices(m, layer):
                if L.zero == 1 and L.dp_shard * L.cp > 1:  # ZeRO-1: rank 0's share, whole (ownership balanced)
                    k = -(-k // (L.dp_shard * L.cp))
                if not expert:
                    key = (rows, cols, fsdp, 0 if fsdp > 1 else None, "dense")
                    grouped[key] = grouped.get(key, 0) + k
                    continue
                E_l = k // ep
                d = expert_shard_dim((E_l, rows, cols), edp)
                if edp == 1 or d == 0:  # whole matrices here: rank 0's share of the stack
                    key = (rows, cols, 1, None, "experts")
                    grouped[key] = grouped.get(key, 0) + -(-E_l // edp)
                else:
                    key = (rows, cols, edp, d, "experts")
                    grouped[key] = grouped.get(key, 0) + E_l
        out = []
        for (rows, cols, n, d, _), k in grouped.items():
            piece = rows * cols if n == 1 else (-(-rows // n) * cols if d in (0, 1) else rows * -(-cols // n))
            out.append((rows, cols, k, n, 1, piece))
        return out

    def step_time(self, cost, L: Layout, layers: int) -> float:
        w, c = cost.w, cost.c
        fast = w.dtype in ("bf16", "bf16-amp")
        rate = cost.peak * c.device.matmul_eff * (1.0 if fast else SLOW_GEMM)
        pb = DTYPE_BYTES[w.dtype][0]
        total = 0.0
        for rows, cols, k, n, stride, piece in self.buckets(cost, L, layers):
            total += math.ceil(k / n) * newton_schulz_flops(rows, cols, w.muon_ns_steps) / rate
            if n > 1:
                total += 2 * cost.ct("all_to_all", n * math.ceil(k / n) * piece * pb, n, stride)
        if L.zero == 1 and L.dp_shard * L.cp > 1:  # ZeRO-1's gather of the owners' parameters
            n, gathered = self.zero_one_gather(cost, L)
            total += cost.ct("all_gather", gathered, n, L.tp) + c.collective_overhead_us * 1e-6
        return total

    def collectives(self, cost, L: Layout, layers: int) -> list[tuple[str, int, float]]:
        """Two all-to-alls per exchanged bucket, in the parameters' dtype, on the ledger's
        dimension of the group's outermost mesh dimension (dp when FSDP shards, else tp)."""
        pb = DTYPE_BYTES[cost.w.dtype][0]
        dim = "dp" if L.zero >= 2 and L.dp_shard * L.cp > 1 else "tp"
        out = []
        for rows, cols, k, n, _, piece in self.buckets(cost, L, layers):
            if n > 1:
                out.append((dim, 2, 2 * RING["all_to_all"](n) * n * math.ceil(k / n) * piece * pb))
        if L.zero == 1 and L.dp_shard * L.cp > 1:
            n, gathered = self.zero_one_gather(cost, L)
            out.append(("dp", 1, RING["all_gather"](n) * gathered))
        return out


OPTIMIZERS = {"adamw": AdamWPricing(), "muon": MuonPricing()}
def optimizer_pricing(w: Workload) -> AdamWPricing:
    """The pricing of ``w.optimizer`` (``train.optimizer``)."""
    if w.optimizer not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer = {w.optimizer}: only `meshfold plan` chooses one; "
                          f"set it to one of {', '.join(OPTIMIZERS)} to price a given layout")
    return OPTIMIZERS[w.optimizer]
