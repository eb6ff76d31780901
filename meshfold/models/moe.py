"""Mixture-of-experts feed-forward block, free of parallelism.

``MoE(cfg)`` replaces the dense MLP of a block (every ``moe_every``-th layer after the first
``moe_first_dense``). Per token x (rows of the flattened [batch*seq, dim] input):

    logits = x W_r^T (+ b_r with ``moe_bias``)         (router, E experts)
    scores = softmax(logits)   or   sigmoid(logits)    (``moe_router``)
    chosen = top-k of (scores + b)                     (b = ``expert_bias``, only with
                                                        ``moe_bias_balance``; selection only)
    g_j    = scores[chosen_j], divided by their sum when ``moe_norm_topk``
    y      = sum_j g_j * Expert_{chosen_j}(x) + SharedExperts(x)
             (``moe_gate_input``, top-1: Expert_{chosen}(g * x) + SharedExperts(x), Llama 4)

Dropless by default. With ``moe_capacity_factor`` c > 0 each expert accepts at most
C = ceil(c * s * k / E) assignments *per sequence* (s tokens); assignments are queued
first-choice before second-choice, then by position, and the rest are dropped. Because the
queue is per sequence, the same tokens are dropped whatever the data-parallel layout. The
kept assignments then run in fixed slots, batch x C per expert (``CapacitySlots``, padded):
fixed shapes, no host read (dropless reads the routing's counts where its shapes need them).

Auxiliary losses (added to the training loss by the trainer through ``moe_aux_loss``):

    L_bal = a * E * sum_i f_i * P_i        f_i = tokens choosing expert i / (N * k)
                                           P_i = mean over tokens of p_i (softmax scores, or
                                                 sigmoid scores divided by their row sum)
    L_z   = z * mean over tokens of logsumexp(logits)^2

f and N are *global*: ``reduce_stats`` (injected by ``parallel/ep/plan.py``; the identity in a
one-process run) sums the per-expert counts over every data-parallel (and context-parallel)
rank, so each rank's term uses the global-batch f ("Demons in the Detail", Qiu et al. 2025)
and the rank terms add up to exactly the one-process value. Under gradient accumulation f
is the running total over the micro-batches seen so far in the step (the paper's buffer);
with one micro-batch per rank this is the exact global-batch loss.

The expert computation goes through ``self.dispatcher``: ``LocalDispatcher`` here; expert
parallel swaps in an all-to-all dispatcher that holds only this rank's experts. The experts'
grouped GEMM is ``models/moe_experts.py``.

Routing counts are data: their shapes and host reads depend on the values. Every place that
counts rows per expert or reads a count on the host goes through ``count_rows`` /
``read_counts``, which on tensors without values (a ``FakeTensorMode``: ``meshfold
dry-run``) give what a perfectly balanced router gives (``balanced_counts``: the planner's
assumption), and otherwise are exactly ``torch.bincount`` / ``tolist``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models import registry
from meshfold.models.config import ModelConfig
from meshfold.models.feedforward import FeedForward
from meshfold.models.moe_experts import (GroupedExperts, _compute_dtype, _Groups, _local, count_rows, expert_kernel,
                                         fixed_groups, gather_rows, read_counts, scatter_add_rows)


def balanced_counts(total: int, n: int) -> list[int]:
    """``total`` (token, expert) assignments spread over ``n`` experts by a perfectly balanced
    router: ``total // n`` each, the first ``total % n`` experts one more."""
    return [total // n + (e < total % n) for e in range(n)]


def combine(x: torch.Tensor, token: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over t's assignments of gate * expert output; summed in >= fp32 (expert
    outputs are bf16 under autocast), returned in the experts' dtype like a dense MLP's."""
    acc = torch.promote_types(y.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    return out.index_add(0, token, y.to(acc) * weight[:, None].to(acc)).to(y.dtype)


class CapacitySlots:
    """Capacity mode's fixed layout, built on the device without a host read: every expert
    has ``per`` slots (``MoE.capacity_slots``: batch x C, one block of C per sequence), expert-
    major, [E * per] in all. A kept assignment goes to slot ``expert * per + slot``; a dropped
    one to a spare slot past the end (then cut off). Per slot: its token (0 where empty) and
    whether it is filled; ``gates`` puts each kept assignment's gate in its slot (0 where
    empty), differentiably. Empty slots compute zero rows that add nothing to any token."""

    def __init__(self, token: torch.Tensor, expert: torch.Tensor, keep: torch.Tensor, slot: torch.Tensor,
                 per: int, n_experts: int):
        n = n_experts * per
        self.per, self.keep = per, keep
        self.dest = torch.where(keep, expert * per + slot, n)
        # scatter-adds: each slot receives at most one kept assignment (the spare one only zeros)
        self.token = torch.zeros(n + 1, dtype=token.dtype, device=token.device).scatter_add_(
            0, self.dest, torch.where(keep, token, 0))[:n]
        self.filled = torch.zeros(n + 1, dtype=torch.int64, device=token.device).scatter_add_(
            0, self.dest, keep.long())[:n].bool()

    def gates(self, weight: torch.Tensor) -> torch.Tensor:
        n = self.token.shape[0]
        return weight.new_zeros(n + 1).scatter_add(0, self.dest, torch.where(self.keep, weight, 0))[:n]

    def rows(self, x: torch.Tensor, pick=lambda t: t) -> tuple[torch.Tensor, torch.Tensor]:
        """(the token of each slot that ``pick`` selects from [E * per], its row of x: zeros where empty)."""
        token, filled = pick(self.token), pick(self.filled)
        return token, gather_rows(x, token).masked_fill(~filled[:, None], 0)


class LocalDispatcher(nn.Module):
    """All experts on this rank: group the assignments by expert (a sort for the grouped
    GEMM; none for the padded kernel, which places rows by slot), run with the gates folded
    into the experts' hidden activations, and add the rows per token. Under a capacity
    (``capacity``) the rows go to their fixed slots instead: one batched matmul, no host read."""

    def forward(self, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
                experts: GroupedExperts, n_experts: int, capacity: tuple | None = None) -> torch.Tensor:
        if capacity is not None:  # (keep, slot, per) of every assignment (``MoE.capacity_slots``)
            slots = CapacitySlots(token, expert, *capacity, n_experts)
            token, rows = slots.rows(x)
            y = experts(rows, None, fixed_groups(n_experts, slots.per), slots.gates(weight))
            return scatter_add_rows(x, token, y)
        counts = count_rows(expert, n_experts, lambda: balanced_counts(expert.shape[0], n_experts))
        kernel = expert_kernel(x.to(_compute_dtype(x)), experts.kernel)
        if kernel == "padded_bmm":
            y = experts(gather_rows(x, token), counts, _Groups(counts, token.shape[0], kernel, expert), weight)
            return scatter_add_rows(x, token, y)
        order = torch.argsort(expert, stable=True)
        token = token[order]
        y = experts(gather_rows(x, token), counts, gates=weight[order])
        return scatter_add_rows(x, token, y)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts = cfg.moe_experts
        self.topk = cfg.moe_topk
        self.router_kind = cfg.moe_router
        self.norm_topk = cfg.moe_norm_topk
        self.gate_input = cfg.moe_gate_input
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coef = cfg.moe_aux_loss_coef
        self.z_coef = cfg.moe_z_loss_coef
        self.bias_rate = cfg.moe_bias_update_rate
        # DeepSeek routing: group-limited choice, scaled gates, sequence-wise balance loss.
        self.groups, self.topk_groups = cfg.moe_groups, cfg.moe_topk_groups
        self.routed_scale = cfg.moe_routed_scale
        self.seq_aux_coef = cfg.moe_seq_aux_loss_coef
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=cfg.moe_bias)
        glu = registry.mlps().get(cfg.mlp)  # a family's gated activation (gpt-oss's clamped SwiGLU)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, cfg.expert_dim, cfg.mlp, cfg.moe_bias,
                                      registry.load(glu)(cfg) if glu else None)
        self.shared_experts = (FeedForward(cfg.dim, cfg.moe_shared_experts * cfg.expert_dim, cfg.mlp, cfg.bias)
                               if cfg.moe_shared_experts else None)
        if cfg.moe_bias_balance:
            self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))
        else:
            self.expert_bias = None
        self.dispatcher: nn.Module = LocalDispatcher()
        # Sums a tensor over the ranks holding different tokens (identity in one process).
        self.reduce_stats = None
        # Wraps the router weight where this rank routes only part of a sequence (tensor
        # parallel with sp: its gradient is summed over tp); identity in one process.
        self.router_weight_hook = None
        # Ranks splitting each sequence (tp with sp) and the sum of per-sequence expert counts
        # over them, for the sequence-wise balance loss (1 and None in one process).
        self.seq_shards, self.reduce_seq_counts = 1, None
        # Where ranks split each sequence (tp with sp): the capacity slots of the whole
        # sequences, (this rank's keep [T, k], the dispatcher's capacity tuple) (None in one process).
        self.sequence_capacity = None
        self._aux: torch.Tensor | None = None
        self._step_stats: torch.Tensor | None = None  # global [counts(E), tokens, dropped]
        self._replay: list = []  # (f, tokens) of this step's forwards, for recomputation

    # ------------------------------------------------------------------ routing

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities used for the balance loss [T, E], chosen experts [T, k], gates [T, k])."""
        if self.router_kind == "softmax":
            scores = logits.softmax(-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        choice = scores.detach()
        if self.expert_bias is not None:
            choice = choice + self.expert_bias.to(choice.dtype)
        if self.groups > 1:
            choice = self.limit_groups(choice)
        idx = choice.topk(self.topk, dim=-1).indices
        gates = scores.gather(-1, idx)
        if self.norm_topk:
            gates = gates / gates.sum(-1, keepdim=True)
        if self.routed_scale != 1.0:
            gates = gates * self.routed_scale
        return probs, idx, gates

    def limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited (node-limited) routing: the experts form ``groups`` equal groups, a
        token keeps the ``topk_groups`` best groups and the others' experts leave the choice
        (-inf). A group's score is its best expert's (DeepSeek-V2, softmax router) or the sum of
        its two best (DeepSeek-V3, sigmoid router with the balancing bias)."""
        grouped = choice.view(choice.shape[0], self.groups, -1)
        if self.router_kind == "sigmoid":
            score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            score = grouped.amax(-1)
        best = score.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def capacity(self, seq: int) -> int:
        """C: the assignments an expert accepts per sequence of ``seq`` tokens."""
        return math.ceil(self.capacity_factor * seq * self.topk / self.n_experts)

    def capacity_keep(self, idx: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """[T, k] bool: which assignments fit in their expert's per-sequence capacity."""
        if self.capacity_factor <= 0:
            return torch.ones_like(idx, dtype=torch.bool)
        return self.capacity_slots(idx, batch, seq)[0]

    def capacity_slots(self, idx: torch.Tensor, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, k] bool, [T, k] int64): which assignments fit in their expert's per-sequence
        capacity C, and each one's slot among its expert's batch x C: C times its sequence
        plus its place in the expert's queue (first choices first, then by position)."""
        cap, k = self.capacity(seq), self.topk
        queue_idx = idx.view(batch, seq, k).transpose(1, 2).reshape(batch, k * seq)  # first choices first
        onehot = F.one_hot(queue_idx, self.n_experts)  # [b, k s, E]
        place = (onehot.cumsum(1) - 1).gather(2, queue_idx[..., None]).squeeze(2)  # place in the expert's queue
        slot = place + cap * torch.arange(batch, device=idx.device)[:, None]
        back = lambda t: t.view(batch, k, seq).transpose(1, 2).reshape(-1, k)  # noqa: E731
        return back(place < cap), back(slot)

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        w = _local(self.router.weight)
        b = None if self.router.bias is None else _local(self.router.bias)  # (model.moe_bias)
        if self.router_weight_hook is not None:
            w = self.router_weight_hook(w)
            b = None if b is None else self.router_weight_hook(b)
        logits = F.linear(flat, w, b).to(torch.promote_types(x.dtype, torch.float32))
        probs, idx, gates = self.route(logits)
        # Under a capacity every expert gets its batch x C slots (padded): fixed shapes, no
        # host read, the same tokens dropped (docs/gpu.md)
        capacity = None
        if self.capacity_factor > 0 and self.sequence_capacity is not None:
            keep, capacity = self.sequence_capacity(self, idx, batch, seq)
        elif self.capacity_factor > 0:
            keep, slot = self.capacity_slots(idx, batch, seq)
            capacity = (keep.flatten(), slot.flatten(), batch * self.capacity(seq))
        else:  # dropless keeps every assignment
            keep = torch.ones_like(idx, dtype=torch.bool)
        if self.training and torch.is_grad_enabled():
            self._aux_terms(logits, probs, idx, keep, seq)

        tokens = torch.arange(flat.shape[0], device=x.device).repeat_interleave(self.topk)
        expert, gate = idx.flatten(), gates.flatten()
        routed = flat
        if self.gate_input:  # (top-1) the gate scales the token on its way in; any dispatcher carries it
            routed, gate = flat * gate[:, None].to(flat.dtype), torch.ones_like(gate)
        out = self.dispatcher(routed, tokens, expert, gate, self.experts, self.n_experts, capacity)
        out = out.view(batch, seq, dim)
        if self.shared_experts is not None:  # on [batch, seq, dim]: sequence parallel splits dim 1
            out = out + self.shared_experts(x)
        return out

    def _aux_terms(self, logits, probs, idx, keep, seq: int) -> None:
        """Global routing statistics of this forward, and this rank's share of the aux losses.

        Activation recomputation re-runs this forward inside backward: it must build the same
        autograd graph (the checkpoint matches saved tensors one by one) but neither count the
        tokens again nor issue the collective, so it replays the statistics of the original
        forward (first in, first out: a module's backwards run in the order of its forwards)."""
        recomputing = torch._C._current_graph_task_id() != -1
        if recomputing and self._replay:
            f, n_tokens = self._replay.pop(0)
        else:
            counts = count_rows(idx.flatten(), self.n_experts,
                                lambda: balanced_counts(idx.numel(), self.n_experts)).to(torch.float64)
            extra = torch.stack([torch.full((), idx.shape[0], dtype=torch.float64, device=idx.device),
                                 (~keep).sum().to(torch.float64)])  # on the device: no host read
            stats = torch.cat([counts, extra])
            if self.reduce_stats is not None:
                stats = self.reduce_stats(stats)
            self._step_stats = stats if self._step_stats is None else self._step_stats + stats
            n_tokens = stats[self.n_experts]  # tokens of this forward over all ranks
            step_counts, step_tokens = self._step_stats[: self.n_experts], self._step_stats[self.n_experts]
            f = (step_counts / (step_tokens * self.topk)).to(probs.dtype)
            self._replay.append((f, n_tokens))
        if not (self.aux_coef or self.z_coef or self.seq_aux_coef):
            return  # no loss terms: nothing joins the backward
        aux = logits.new_zeros(())
        if self.aux_coef:
            aux = aux + self.aux_coef * self.n_experts * (f * probs.sum(0)).sum() / n_tokens
        if self.z_coef:
            aux = aux + self.z_coef * torch.logsumexp(logits, -1).pow(2).sum() / n_tokens
        if self.seq_aux_coef:
            full = seq * self.seq_shards  # tokens per whole sequence
            aux = aux + self.seq_aux_coef * self.sequence_balance(probs, idx, seq) / (n_tokens / full)
        if not recomputing:
            self._aux = aux if self._aux is None else self._aux + aux

    def sequence_balance(self, probs: torch.Tensor, idx: torch.Tensor, seq: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance term, summed over this rank's sequences (whole
        sequences: context parallel is refused with it): per sequence of s tokens,
        sum_i f_i P_i with f_i = E/(k s) * (tokens choosing i), P_i = mean over its tokens of
        the normalised scores. The caller divides by the global number of sequences. With the
        sequence split over ``seq_shards`` ranks (``seq`` tokens here) the counts are summed
        over them and P_i is this slice's share of the mean, so the ranks' terms add up."""
        per_seq = idx.view(-1, seq * self.topk)
        counts = torch.zeros(per_seq.shape[0], self.n_experts, dtype=probs.dtype, device=probs.device)
        counts.scatter_add_(1, per_seq, torch.ones_like(per_seq, dtype=probs.dtype))
        if self.reduce_seq_counts is not None:
            counts = self.reduce_seq_counts(counts)
        full = seq * self.seq_shards
        f = counts * (self.n_experts / (self.topk * full))  # no gradient, as in the paper
        P = probs.view(-1, seq, self.n_experts).sum(1) / full
        return (f * P).sum()

    # ------------------------------------------------------------------ step bookkeeping

    def pop_aux(self) -> torch.Tensor | None:
        aux, self._aux = self._aux, None
        return aux

    @torch.no_grad()
    def end_step(self) -> dict | None:
        """Step statistics (global, identical on every rank); updates the balancing bias."""
        stats, self._step_stats = self._step_stats, None
        self._replay = []
        if stats is None:
            return None
        load = stats[: self.n_experts]
        if self.expert_bias is not None:
            # DeepSeek-V3 aux-loss-free balancing: raise under-loaded experts, lower the rest.
            self.expert_bias.add_(self.bias_rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype))
        return {"load": load, "dropped": stats[self.n_experts + 1]}


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of this rank's auxiliary-loss terms since the last call (None without MoE)."""
    total = None
    for _, m in moe_layers(model):
        aux = m.pop_aux()
        if aux is not None:
            total = aux if total is None else total + aux
    return total


def moe_end_step(model: nn.Module) -> dict:
    """metrics.jsonl fields for the step just taken: ``expert_load`` (tokens per expert, per MoE
    layer, whole global batch), ``expert_imbalance`` (max over layers of max/mean load) and
    ``dropped_tokens`` (token-expert assignments dropped by capacity, summed over layers).
    One host read for all layers (their loads and dropped counts stacked on the device)."""
    outs = [(name, m.end_step()) for name, m in moe_layers(model)]
    outs = [(name.split("layers.", 1)[-1].split(".", 1)[0], out) for name, out in outs if out is not None]
    if not outs:
        return {}
    rows = torch.stack([torch.cat([out["load"].double(), out["dropped"].double().reshape(1)]) for _, out in outs])
    values = read_counts(rows, lambda: [[0.0] * rows.shape[1]] * rows.shape[0])
    loads, imbalance, dropped = {}, 0.0, 0
    for (layer, _), row in zip(outs, values):
        load = row[:-1]
        loads[layer] = [int(v) for v in load]
        imbalance = max(imbalance, max(load) / max(sum(load) / len(load), 1e-12))
        dropped += int(row[-1])
    return {"expert_imbalance": imbalance, "expert_load": loads, "dropped_tokens": dropped}
