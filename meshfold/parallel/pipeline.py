"""Pipeline parallel: stages, schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble V) and
their execution with measured per-stage timings.

Layout. The model is cut into S contiguous stages (``stage_balance.py`` balances them by
cost; ``parallel.pp_split`` overrides). Each pp rank holds ``chunks`` of them:

* ``gpipe``, ``1f1b``: one stage per rank, stage = rank.
* ``interleaved``: v = ``pp_virtual_stages`` chunks, stage = chunk * pp + rank (Narayanan
  et al. 2021), so a micro-batch loops through the ranks v times.
* ``zbv``: two chunks in a V: rank r holds stage r and stage 2pp-1-r (Qi et al., "Pipeline
  Parallelism with Controllable Memory"); the loss stage is back on rank 0 and the two
  middle stages share rank pp-1 (their hand-over needs no communication).

A stage is a ``Transformer`` with the other layers deleted (``layers`` keys are global
layer indices, init is name-seeded, so its values equal the full model's) and then
``parallelize``d like any model (tensor parallel, FSDP), so pp composes with tp and dp.

Schedules are per-rank ordered lists of actions F (forward), B (backward; input gradient
only when a W follows) and W (weight gradient) on (chunk, micro-batch). GPipe, 1F1B and
interleaved orders are the published closed forms; zbv comes from a greedy list
scheduler (B first, then F within an activation budget of 2·pp chunk-micro-batches, W to
fill what is left). ``simulate`` replays any schedule with given action costs; it is the
proof that an order cannot deadlock (every receive's send comes earlier in simulated time)
and it gives the theoretical bubble.

Why not ``torch.distributed.pipelining`` schedules directly: we need every action timed
(the measured bubble and the timeline), stages built by deleting layers rather than by
tracing, the zbv order for any micro-batch count with our executor, and a single p2p
path whose bytes go into the comm ledger. We keep torch's split backward
(``stage_backward_input`` / ``stage_backward_weight``), which computes the input gradient
first and the weight gradients later from saved intermediate gradients, without redoing
the backward.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from meshfold import comm
from meshfold.errors import ConfigError
from meshfold.models.llama import Transformer, init_weights
from meshfold.parallel import parallelize
from meshfold.parallel.data import grad_reducers, unwrap, uses_fsdp
from meshfold.parallel.materialize import build_on_meta
from meshfold.parallel.stage_balance import balanced_split, describe_split
from meshfold.parallel.timeline import bubble_fractions

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")
TIMELINE_FILE = "pipeline_timeline.jsonl"


# --------------------------------------------------------------------------- layout


def chunks_per_rank(schedule: str, virtual: int) -> int:
    return {"interleaved": virtual, "zbv": 2}.get(schedule, 1)


def stage_of(schedule: str, pp: int, rank: int, chunk: int) -> int:
    if schedule == "interleaved":
        return chunk * pp + rank
    if schedule == "zbv":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return rank


def rank_chunk_of_stage(schedule: str, pp: int, stage: int) -> tuple[int, int]:
    if schedule == "interleaved":
        return stage % pp, stage // pp
    if schedule == "zbv":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage, 0


def microbatch_problem(schedule: str, pp: int, m: int) -> str | None:
    """Why ``m`` micro-batches cannot run on ``schedule`` with ``pp`` ranks, or None."""
    if m < 1:
        return f"{m} micro-batches"
    # gpipe, 1f1b and zbv run any count (below pp they degenerate towards GPipe's bubble;
    # torch's Schedule1F1B/ZBV refuse that, our executor does not need to). Interleaved's
    # closed-form order walks micro-batches in groups of pp.
    if schedule == "interleaved" and m % pp:
        return f"interleaved needs a multiple of pp = {pp} micro-batches, got {m}"
    return None


def stage_split(cfg: Config) -> tuple[list[int], str]:
    """Blocks per stage: ``parallel.pp_split`` if given, else the cost-balanced split."""

    p = cfg.parallel
    n = p.pp * chunks_per_rank(p.pp_schedule, p.pp_virtual_stages)
    if p.pp_split:
        return list(p.pp_split), "parallel.pp_split"
    return balanced_split(cfg.model, n), "balanced by cost"


def build_stage(cfg: Config, split: list[int], stage: int, meta: bool = False,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """The full model with everything outside ``stage`` deleted, initialised by name (or,
    ``meta``, left on the meta device for ``parallelize`` to shard and materialise)."""
    first = sum(split[:stage])
    keep = {str(i) for i in range(first, first + split[stage])}
    model = build_on_meta(lambda: Transformer(cfg.model), dtype)
    for key in [k for k in model.layers.keys() if k not in keep]:
        del model.layers[key]
    if stage > 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage < len(split) - 1:
        model.norm = None
        model.output = None
    if not meta:
        model.to_empty(device="cpu")
        init_weights(model, cfg.model, cfg.train.seed)
    return model


# --------------------------------------------------------------------------- schedules


@dataclass(frozen=True)
class Action:
    kind: str  # F | B | W
    chunk: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def schedule_actions(schedule: str, pp: int, virtual: int, m: int) -> list[list[Action]]:
    """Per pp rank, the ordered actions of one optimizer step over ``m`` micro-batches."""
    problem = microbatch_problem(schedule, pp, m)
    if problem:
        raise ConfigError(f"parallel.pp_microbatches: {problem}")
    if schedule == "gpipe":
        return [[Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)] for _ in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(pp, r, m) for r in range(pp)]
    if schedule == "interleaved":
        return [_interleaved(pp, r, virtual, m) for r in range(pp)]
    if schedule == "zbv":
        return _greedy_zero_bubble(pp, m)
    raise ConfigError(f"parallel.pp_schedule = {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def _one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    out = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return out + [Action("B", 0, i) for i in range(m - warmup, m)]


def _interleaved(pp: int, rank: int, v: int, m: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches go in groups of pp through chunk 0, then
    the same group through chunk 1, ...; backward visits chunks in reverse."""
    total = m * v

    def fwd(k: int) -> Action:
        return Action("F", (k // pp) % v, (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        return Action("B", v - 1 - (k // pp) % v, (k // (pp * v)) * pp + k % pp)

    warmup = total if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    out = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        out += [fwd(warmup + i), bwd(i)]
    return out + [bwd(k) for k in range(total - warmup, total)]


def _deps(schedule: str, pp: int, n_stages: int, a: Action, rank: int) -> list[tuple[int, Action]]:
    """(rank, action) pairs that must finish before ``a`` on ``rank`` can start."""
    s = stage_of(schedule, pp, rank, a.chunk)
    if a.kind == "F":
        if s == 0:
            return []
        r, c = rank_chunk_of_stage(schedule, pp, s - 1)
        return [(r, Action("F", c, a.mb))]
    if a.kind == "B":
        out = [(rank, Action("F", a.chunk, a.mb))]
        if s < n_stages - 1:
            r, c = rank_chunk_of_stage(schedule, pp, s + 1)
            out.append((r, Action("B", c, a.mb)))
        return out
    return [(rank, Action("B", a.chunk, a.mb))]


def _greedy_zero_bubble(pp: int, m: int) -> list[list[Action]]:
    """Zero-bubble V order by list scheduling with unit costs: whenever a rank is free it
    runs a ready B (input grad, on the critical path), else a ready F (the deeper chunk
    first; a new micro-batch enters chunk 0 only while fewer than 2·pp chunk-micro-batches
    hold activations), else a pending W (weight grads fill the bubbles).
    Stage 0's backward is whole (no input to differentiate), so it has no W."""
    n_stages = 2 * pp
    done: dict[tuple[int, Action], float] = {}
    orders: list[list[Action]] = [[] for _ in range(pp)]
    free_at = [0.0] * pp
    pending_w: list[list[Action]] = [[] for _ in range(pp)]
    inflight = [0] * pp
    todo = {r: [Action("F", c, i) for i in range(m) for c in (0, 1)] + [Action("B", c, i) for i in range(m)
                                                                          for c in (0, 1)] for r in range(pp)}
    cost = {"F": 1.0, "B": 1.0, "W": 1.0}
    blocked: set[int] = set()  # ranks waiting for an action nobody has scheduled yet
    while any(todo.values()) or any(pending_w):
        # Event order: the rank that is free earliest decides next (ties: lowest rank); all
        # completions up to its clock are known, so its choice sees the true ready set.
        waiting = [q for q in range(pp) if q not in blocked]
        if not waiting:
            raise RuntimeError("zbv scheduler made no progress")
        r = min(waiting, key=lambda q: (free_at[q], q))
        now = free_at[r]

        def ready(a: Action) -> bool:
            return all(done.get(d, float("inf")) <= now for d in _deps("zbv", pp, n_stages, a, r))

        bs = [a for a in todo[r] if a.kind == "B" and ready(a)]
        fs = [a for a in todo[r] if a.kind == "F" and ready(a)]
        pick = None
        if bs:
            pick = min(bs, key=lambda a: (a.mb, -stage_of("zbv", pp, r, a.chunk)))
        elif fs:
            # Deeper chunk first (it drains toward the loss); a new micro-batch enters
            # chunk 0 only within the activation budget.
            f = min(fs, key=lambda a: (-a.chunk, a.mb))
            if f.chunk == 1 or inflight[r] < 2 * pp:
                pick = f
        if pick is None and pending_w[r]:
            pick = pending_w[r].pop(0)
        if pick is None:  # idle until the next completion, or until another rank schedules one
            later = [t for t in done.values() if t > now]
            if later:
                free_at[r] = min(later)
            else:
                blocked.add(r)
            continue
        blocked.clear()
        if pick.kind != "W":
            todo[r].remove(pick)
        whole = pick.kind == "B" and stage_of("zbv", pp, r, pick.chunk) == 0
        end = now + cost[pick.kind] * (2 if whole else 1)
        done[(r, pick)] = free_at[r] = end
        orders[r].append(pick)
        if pick.kind == "F":
            inflight[r] += 1
        elif pick.kind == "B":
            inflight[r] -= 1
            if not whole:
                pending_w[r].append(Action("W", pick.chunk, pick.mb))
    return orders


def simulate(schedule: str, orders: list[list[Action]], cost: dict[str, float] | None = None) -> list[dict]:
    """Replay per-rank orders with action costs (default F=1, B=2, W=0; with W actions
    present B=W=1) and return timeline events. Raises if the orders deadlock."""
    pp = len(orders)
    split_w = any(a.kind == "W" for o in orders for a in o)
    cost = cost or ({"F": 1.0, "B": 1.0, "W": 1.0} if split_w else {"F": 1.0, "B": 2.0, "W": 0.0})
    n_stages = pp * (max(a.chunk for o in orders for a in o) + 1) if schedule != "zbv" else 2 * pp
    done: dict[tuple[int, Action], float] = {}
    pos, clock, events = [0] * pp, [0.0] * pp, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                deps = _deps(schedule, pp, n_stages, a, r)
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                s = stage_of(schedule, pp, r, a.chunk)
                c = cost[a.kind]
                if a.kind == "B" and split_w and s == 0:
                    c += cost["W"]  # stage 0 runs its whole backward at once
                done[(r, a)] = clock[r] = start + c
                events.append({"stage": r, "chunk": a.chunk, "mb": a.mb, "kind": a.kind, "start": start,
                               "end": start + c})
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise RuntimeError(f"{schedule} schedule deadlocks; waiting actions by rank: {stuck}")
    return events


def theoretical_bubble(schedule: str, pp: int, virtual: int, m: int) -> float:
    """Closed forms (share of the step each stage idles): (p-1)/(m+p-1) for GPipe and 1F1B,
    (p-1)/(v·m+p-1) for interleaved (the bubble shrinks by v); zbv: the unit-cost
    simulation of its order (zero once m is large enough)."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved":
        return (pp - 1) / (virtual * m + pp - 1)
    fr = bubble_fractions(simulate(schedule, schedule_actions(schedule, pp, virtual, m)))
    return sum(fr.values()) / len(fr)



# --------------------------------------------------------------------------- exchange plan
#
# NCCL matches point-to-point messages in issue order per (sender, receiver) pair; tags
# mean nothing. So every rank derives, from every rank's order, the sequence of messages
# on each channel (the sender's issue order) and posts its receives in exactly that order:
# matching needs no tag, and an activation can never meet a gradient's receive.
# docs/pipeline.md gives the argument; ``check_exchange`` replays it.

Message = tuple[str, int, int]  # (kind "act" | "grad", destination stage, micro-batch)


def action_messages(schedule: str, pp: int, n_stages: int, rank: int,
                    a: Action) -> tuple[tuple[int, Message] | None, tuple[int, Message] | None]:
    """(peer rank, message) that ``a`` needs before it runs and that it sends after it
    runs (None when nothing); a peer equal to ``rank`` is a hand-over inside the rank."""
    s = stage_of(schedule, pp, rank, a.chunk)

    def owner(stage: int) -> int:
        return rank_chunk_of_stage(schedule, pp, stage)[0]

    need = send = None
    if a.kind == "F":
        if s > 0:
            need = (owner(s - 1), ("act", s, a.mb))
        if s < n_stages - 1:
            send = (owner(s + 1), ("act", s + 1, a.mb))
    elif a.kind == "B":
        if s < n_stages - 1:
            need = (owner(s + 1), ("grad", s, a.mb))
        if s > 0:
            send = (owner(s - 1), ("grad", s - 1, a.mb))
    return need, send


@dataclass
class ExchangePlan:
    """One rank's point-to-point traffic for one step. ``batches[k]`` is posted as one
    ``comm.exchange`` before action k (k = 0) or right after action k-1 finished: the sends
    action k-1 produced plus receives, in channel order, posted no later than just before
    the action that needs them. ``needs[k]``: (batch, message) action k waits for, or None."""

    batches: list[tuple[list[tuple[int, Message]], list[tuple[int, Message]]]]
    needs: list[tuple[int, Message] | None]


def _channels(schedule: str, orders: list[list[Action]], n_stages: int) -> dict[tuple[int, int], list[Message]]:
    """(src, dst) -> the messages src sends dst, in src's issue order."""
    channel: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for r, order in enumerate(orders):
        for a in order:
            _, send = action_messages(schedule, len(orders), n_stages, r, a)
            if send is not None and send[0] != r:
                channel[(r, send[0])].append(send[1])
    return channel


def _n_stages(schedule: str, orders: list[list[Action]]) -> int:
    return 2 * len(orders) if schedule == "zbv" else len(orders) * (max(a.chunk for o in orders for a in o) + 1)


def _build_plan(schedule: str, orders: list[list[Action]], early: dict) -> list[ExchangePlan]:
    """Receives go out in the batch just before the action that needs them, or earlier
    where ``early[(rank, src, index on the channel)]`` says; FIFO order kept per channel."""
    pp, n_stages = len(orders), _n_stages(schedule, orders)
    channel = _channels(schedule, orders, n_stages)
    plans = []
    for r, order in enumerate(orders):
        batches: list[tuple[list, list]] = [([], []) for _ in range(len(order) + 1)]
        at: dict[tuple[int, int], int] = {}  # (src, index) -> batch
        for i, a in enumerate(order):
            need, send = action_messages(schedule, pp, n_stages, r, a)
            if send is not None and send[0] != r:
                batches[i + 1][0].append(send)
            if need is not None and need[0] != r:
                src, msg = need
                at[(src, channel[(src, r)].index(msg))] = i
        for (src, idx), b in list(at.items()):
            at[(src, idx)] = min(b, early.get((r, src, idx), b))
        for (src, dst), chan in channel.items():  # FIFO: no receive after a later one on its channel
            if dst != r:
                continue
            for idx in range(len(chan) - 2, -1, -1):
                at[(src, idx)] = min(at[(src, idx)], at[(src, idx + 1)])
        for (src, idx), b in sorted(at.items(), key=lambda kv: (kv[1], kv[0][1])):
            batches[b][1].append((src, channel[(src, r)][idx]))
        needs = []
        for i, a in enumerate(order):
            need, _ = action_messages(schedule, pp, n_stages, r, a)
            if need is None or need[0] == r:
                needs.append(None)
                continue
            src, msg = need
            needs.append((at[(src, channel[(src, r)].index(msg))], msg))
        plans.append(ExchangePlan(batches, needs))
    return plans


def _replay(schedule: str, orders: list[list[Action]], plans: list[ExchangePlan]):
    """Replay plans under NCCL's rules; None when every rank finishes, else the sends that
    block (rank, batch, peer, index on the channel) with their receive not yet posted.

    Model (conservative, as NCCL runs grouped p2p on one stream per communicator): each
    rank's batches run one after another, batch k starting once batch k-1 completed; an
    operation completes once its partner (same position on the same channel) is in a
    started batch; a batch completes when all its operations have. A rank runs action k
    once the batch holding the receive it needs has completed, then posts batch k+1."""
    pp = len(orders)
    where: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # (op, src, dst, index) -> (rank, batch)
    label: dict[tuple[str, int, int, int], Message] = {}
    for r, plan in enumerate(plans):
        count: dict[tuple[str, int], int] = defaultdict(int)
        for b, (sends, recvs) in enumerate(plan.batches):
            for peer, msg in sends:
                key = ("send", r, peer, count[("send", peer)])
                count[("send", peer)] += 1
                where[key], label[key] = (r, b), msg
            for peer, msg in recvs:
                key = ("recv", peer, r, count[("recv", peer)])
                count[("recv", peer)] += 1
                where[key], label[key] = (r, b), msg
    for (kind, src, dst, idx), msg in label.items():
        other = ("recv" if kind == "send" else "send", src, dst, idx)
        if label.get(other) != msg:
            raise RuntimeError(f"{schedule}: message {idx} from rank {src} to {dst} is {msg} on one side and "
                               f"{label.get(other)} on the other")
    ops_of: dict[tuple[int, int], list] = defaultdict(list)
    for key, rb in where.items():
        ops_of[rb].append(key)
    posted, complete, pc = [1] * pp, [0] * pp, [0] * pp  # batch 0 goes out before the first action
    while True:
        moved = False
        for r in range(pp):
            while complete[r] < posted[r]:
                ok = True
                for kind, src, dst, idx in ops_of[(r, complete[r])]:
                    pr, pb = where[("recv" if kind == "send" else "send", src, dst, idx)]
                    if not (pb < posted[pr] and pb <= complete[pr]):
                        ok = False
                        break
                if not ok:
                    break
                complete[r] += 1
                moved = True
        for r in range(pp):
            while pc[r] < len(orders[r]):
                need = plans[r].needs[pc[r]]
                if need is not None and complete[r] <= need[0]:
                    break
                pc[r] += 1
                posted[r] = pc[r] + 1
                moved = True
        if all(pc[r] == len(orders[r]) and complete[r] == posted[r] for r in range(pp)):
            return None
        if not moved:
            blocked = []
            for r in range(pp):
                if complete[r] < posted[r]:
                    for kind, src, dst, idx in ops_of[(r, complete[r])]:
                        pr, pb = where[("recv" if kind == "send" else "send", src, dst, idx)]
                        if kind == "send" and pb >= posted[pr]:
                            blocked.append((dst, src, idx, posted[pr] - 1))
            return blocked or [("stuck", [orders[r][pc[r]] if pc[r] < len(orders[r]) else None
                                          for r in range(pp)], complete, posted)]


def exchange_plan(schedule: str, orders: list[list[Action]]) -> list[ExchangePlan]:
    """Every rank's exchange batches for these orders, checked deadlock-free under NCCL's
    rules (``_replay``). A receive goes out with the previous action's sends, before the
    action that needs it runs; where a sender would
    block on a receive its peer posts too late, that receive moves into the peer's
    latest batch at that point, and the replay runs again (interleaved needs this)."""
    early: dict = {}
    for _ in range(10 * sum(len(o) for o in orders) + 10):
        plans = _build_plan(schedule, orders, early)
        blocked = _replay(schedule, orders, plans)
        if blocked is None:
            return plans
        changed = False
        for item in blocked:
            if item[0] == "stuck":
                break
            rank, src, idx, batch = item
            if early.get((rank, src, idx), 1 << 30) > batch:
                early[(rank, src, idx)] = batch
                changed = True
        if not changed:
            raise RuntimeError(f"{schedule}: no deadlock-free exchange found; replay stopped at {blocked}")
    raise RuntimeError(f"{schedule}: exchange planning did not converge")


# --------------------------------------------------------------------------- execution


class PipelineModel(nn.Module):
    """This rank's stage modules (chunks), in chunk order."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)


class Pipeline:
    """This rank's stages and the schedule's execution: the pipeline executor. It owns no
    training policy: the step engine (``train/engine.py``) hands it the forward, the loss
    and the MoE auxiliary terms, and the loss scale, and reads back the loss sum and the
    step's metrics (``self.metrics``)."""

    def __init__(self, cfg: Config, dims, device: torch.device, param_dtype: torch.dtype,
                 wire_dtype: torch.dtype | None = None, announce: bool = False):
        """``wire_dtype``: activations and gradients travel in the compute dtype (bf16 under
        autocast; default the parameter dtype). ``announce``: print the stage split (one rank)."""

        p = cfg.parallel
        self.cfg, self.device, self.param_dtype = cfg, device, param_dtype
        self.wire_dtype = wire_dtype or param_dtype
        self.schedule, self.pp, self.virtual = p.pp_schedule, p.pp, p.pp_virtual_stages
        self.n_chunks = chunks_per_rank(self.schedule, self.virtual)
        self.n_stages = self.pp * self.n_chunks
        self.rank = dims.rank("pp")
        self.split, source = stage_split(cfg)
        self.stages = [stage_of(self.schedule, self.pp, self.rank, c) for c in range(self.n_chunks)]
        if announce:
            owners = [rank_chunk_of_stage(self.schedule, self.pp, s)[0] for s in range(self.n_stages)]
            print(describe_split(cfg.model, self.split, owners, source), flush=True)
        self.group = dims.group("pp")
        chunks = []
        for s in self.stages:
            stage = build_stage(cfg, self.split, s, meta=True, dtype=param_dtype)
            chunks.append(unwrap(parallelize(stage, cfg, dims, device)))
        self.chunks = chunks  # checkpoints save each chunk under the full model's names
        self.model = PipelineModel(chunks)
        # Without FSDP, data-parallel gradients are averaged by each chunk's GradReducer
        # (parallel/data.py; DDP cannot follow interleaved forwards and backwards), armed
        # for the chunk's last backward action so its buckets go out while other chunks and
        # micro-batches still compute; with FSDP the chunk syncs only in that action.
        self.reducers = [grad_reducers(c) for c in chunks]
        self.fsdp = uses_fsdp(dims)
        # zbv under FSDP2 (two root chunks per rank, V order) deadlocks on gloo when the
        # chunks' syncs are deferred; it keeps FSDP2's per-micro-batch reduction for now.
        self.defer_fsdp_sync = self.fsdp and self.schedule != "zbv"
        self.zero = p.zero
        # Split backward (B then W) only where torch's split works: not through FSDP's hooks.
        self.split_backward = self.schedule == "zbv" and not uses_fsdp(dims)
        self.orders = {}
        self.events: list[dict] = []
        self.metrics: dict = {}  # the last step's bubble fields, read by the step engine

    # ---------------------------------------------------------------- p2p

    def _owner(self, stage: int) -> int:
        """pp rank holding ``stage``."""
        return rank_chunk_of_stage(self.schedule, self.pp, stage)[0]

    def _post(self, sends: list[tuple[int, Message]], recvs: list[tuple[int, Message]],
              out: dict[Message, torch.Tensor], micro: list[dict]) -> None:
        """One ``comm.exchange``: the given sends (tensors from ``out``) and fresh receive
        buffers (into ``self.inbox``); no tags, FIFO per peer pair. A receive is later
        waited on alone where the backend gives one work per operation (gloo), else with
        its whole batch (NCCL's grouped call: one work)."""
        send_ops = [(out.pop(msg), peer) for peer, msg in sends]
        recv_ops = []
        for peer, msg in recvs:
            buf = torch.empty(self._act_shape(micro[msg[2]]), dtype=self.wire_dtype, device=self.device)
            self.inbox[msg] = buf
            recv_ops.append((buf, peer))
        works = comm.exchange(send_ops, recv_ops, self.group, "pp")
        per_op = len(works) == len(send_ops) + len(recv_ops)
        for j, (_, msg) in enumerate(recvs):
            self.recv_works[msg] = [works[len(send_ops) + j]] if per_op else works
        self.inflight.append((works, send_ops))  # send buffers stay alive until waited on

    def _take(self, msg: Message) -> torch.Tensor:
        """The received tensor for ``msg`` (waiting on its receive) or the local hand-over."""
        if msg in self.local:
            return self.local.pop(msg)
        comm.wait_all(self.recv_works.pop(msg))
        return self.inbox.pop(msg)

    # ---------------------------------------------------------------- one step

    def _act_shape(self, mb: dict) -> tuple[int, int, int]:
        """Hidden states between stages: [micro-batch, sequence, dim]; under sequence
        parallel each tp rank holds (and sends to its tp peer) a 1/tp slice of the sequence."""
        p = self.cfg.parallel
        b, s = mb["inputs"].shape[:2]
        return b, s // (p.tp if p.sp else 1), self.cfg.model.dim

    def orders_for(self, m: int) -> list[Action]:
        if m not in self.orders:
            orders = schedule_actions(self.schedule, self.pp, self.virtual, m)
            self.orders[m] = (orders, exchange_plan(self.schedule, orders))
        return self.orders[m][0][self.rank]

    def forward_backward(self, micro: list[dict], scale: torch.Tensor, forward, loss_fn, moe_aux) -> torch.Tensor:
        """Run the schedule over ``micro``; returns the loss sum over all stages.

        ``forward(module, x, mb)`` runs one chunk, ``loss_fn(out, labels)`` gives the last
        stage's token-loss sum (multiplied by ``scale`` for backward), ``moe_aux(module, m)``
        a chunk's scaled MoE auxiliary terms or None."""
        m = len(micro)
        order = self.orders_for(m)
        plan = self.orders[m][1][self.rank]
        self.local, self.inbox, self.inflight, self.recv_works = {}, {}, [], {}
        outbox: dict[Message, torch.Tensor] = {}
        saved: dict[tuple[int, int], tuple] = {}
        wgrad: dict[tuple[int, int], list] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        events = []
        last_grad_action = {}
        for i, a in enumerate(order):
            if a.kind != "F":
                last_grad_action[a.chunk] = i
        self._set_grad_sync(None)
        # No barrier: every rank starts when it is ready; the bubble is measured against
        # the wall clock (one host, or NTP-synchronised hosts).
        wall0, t0 = time.time(), time.perf_counter()
        self._post(*plan.batches[0], outbox, micro)
        for i, a in enumerate(order):
            if last_grad_action.get(a.chunk) == i:
                self._set_grad_sync(a.chunk)
            s = self.stages[a.chunk]
            mb = micro[a.mb]
            if a.kind == "F":
                if s == 0:
                    x = mb["inputs"]
                else:
                    x = self._take(("act", s, a.mb)).to(self.param_dtype).requires_grad_(True)
                start = time.perf_counter()
                chunk = self.model.chunks[a.chunk]
                out = forward(chunk, x, mb)
                aux = moe_aux(chunk, m)
                if s == self.n_stages - 1:
                    loss = loss_fn(out, mb["labels"])
                    loss_sum += loss.detach().double()
                    out = loss * scale.to(loss.dtype)
                else:
                    out = out.to(self.param_dtype)
                    self._hand_over(outbox, ("act", s + 1, a.mb), out.detach())
                saved[(a.chunk, a.mb)] = (x, out, aux)
            elif a.kind == "B":
                x, out, aux = saved.pop((a.chunk, a.mb))
                grad = None if s == self.n_stages - 1 else self._take(("grad", s, a.mb)).to(out.dtype)
                start = time.perf_counter()
                outs, grads = [out], [torch.ones_like(out) if grad is None else grad]
                if aux is not None and aux.requires_grad:  # MoE balance terms of this chunk join its backward
                    outs.append(aux)
                    grads.append(torch.ones_like(aux))
                if self.split_backward and s > 0:
                    _, groups = stage_backward_input(outs, grads, [x], self.model.chunks[a.chunk].parameters())
                    wgrad[(a.chunk, a.mb)] = groups
                else:
                    torch.autograd.backward(outs, grads)
                if s > 0:
                    self._hand_over(outbox, ("grad", s - 1, a.mb), x.grad)
                del x, out, aux
            else:
                start = time.perf_counter()
                groups = wgrad.pop((a.chunk, a.mb), None)
                if groups is not None:
                    stage_backward_weight(self.model.chunks[a.chunk].parameters(), groups)
            events.append({"stage": self.rank, "chunk": a.chunk, "mb": a.mb, "kind": a.kind,
                           "start": start - t0, "end": time.perf_counter() - t0})
            self._post(*plan.batches[i + 1], outbox, micro)
        for works, _ in self.inflight:
            comm.wait_all(works)
        span = time.perf_counter() - t0
        self.inflight, self.local, self.inbox, self.recv_works = [], {}, {}, {}
        for reducers in self.reducers:
            for reducer in reducers:
                reducer.finish()
        self._set_grad_sync("all")
        self.metrics = {}
        return self._reduce_step(loss_sum, events, wall0, span, m)

    def _hand_over(self, outbox: dict, msg: Message, tensor: torch.Tensor) -> None:
        """A stage output (or input gradient) for ``msg``: kept for a stage on this rank,
        else queued, in the compute dtype, for the next batch's sends."""
        if self._owner(msg[1]) == self.rank:
            self.local[msg] = tensor
        else:
            outbox[msg] = tensor.to(self.wire_dtype).contiguous()

    def _reduce_step(self, loss_sum: torch.Tensor, events: list[dict], wall0: float, span: float,
                     m: int) -> torch.Tensor:
        """One all-gather over pp carries the loss (it lives on the last stage) and the
        timings: per rank [loss sum, busy seconds, wall-clock start, wall-clock end]. The
        bubble fields go to ``self.metrics``."""
        busy = sum(e["end"] - e["start"] for e in events)
        mine = torch.stack([loss_sum, torch.full_like(loss_sum, busy), torch.full_like(loss_sum, wall0),
                            torch.full_like(loss_sum, wall0 + span)])
        every = torch.empty(4 * self.pp, dtype=torch.float64, device=self.device)
        comm.all_gather_into_tensor(every, mine, self.group, "pp")
        every = every.view(self.pp, 4)
        stats = every[:, 1:].tolist()  # the step's one host read of pipeline timings (metrics)
        begin, end = min(r[1] for r in stats), max(r[2] for r in stats)
        makespan = end - begin
        offset = wall0 - begin  # events on the common clock, from the earliest rank's start
        for e in events:
            e["start"] += offset
            e["end"] += offset
        per_stage = [max(0.0, 1.0 - r[0] / makespan) if makespan > 0 else 0.0 for r in stats]
        self.last_bubble = per_stage
        self.events = events
        self.metrics = {
            "bubble_frac": sum(per_stage) / len(per_stage),
            "bubble_frac_stages": [round(b, 4) for b in per_stage],
            "bubble_theory": theoretical_bubble(self.schedule, self.pp, self.virtual, m),
            "pp_microbatches": m,
        }
        return every[:, 0].sum()

    def _set_grad_sync(self, chunk) -> None:
        """None: no chunk reduces (start of the schedule); an index: that chunk's next
        backward action is its last of the step, so it reduces there; "all": back to
        syncing everywhere (evaluation, other callers)."""
        for c, part in enumerate(self.model.chunks):
            on = chunk == "all" or chunk == c
            if self.fsdp:
                if not self.defer_fsdp_sync:
                    continue
                if chunk is None or on:
                    part.set_requires_gradient_sync(on)
                    if self.zero == 2:
                        part.set_reshard_after_backward(on)
            elif on and chunk != "all":
                for reducer in self.reducers[c]:
                    reducer.arm()

    # ---------------------------------------------------------------- timeline log

    def log_events(self, step: int, path, write: bool) -> None:
        """Append this step's events of all stages (``step``: its number) to ``path``
        (``RUN_DIR/pipeline_timeline.jsonl``); every pp rank calls it (the events are
        gathered), the rank with ``write`` writes. ``meshfold timeline RUN_DIR`` draws them."""
        events = self.gather_events()
        if not write or events is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": step, "schedule": self.schedule, "pp": self.pp, "virtual": self.virtual,
                  "microbatches": self.metrics.get("pp_microbatches"), "events": events}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def gather_events(self) -> list[dict] | None:
        """This step's events of every pp rank, on pp rank 0 (None elsewhere)."""
        if self.group is None:
            return self.events
        out = comm.gather_object(self.events, self.group, 0)
        return [e for evs in out for e in evs] if out is not None else None

    # ---------------------------------------------------------------- eval, inspection

    @torch.no_grad()
    def forward_loss_sum(self, batch: dict, forward, loss_fn) -> torch.Tensor:
        """Forward of one batch through all stages in stage order; the loss sum on every pp
        rank. Each rank receives a stage's input only after sending every output of the
        stages before it, so the chain 0 -> 1 -> ... cannot deadlock (docs/pipeline.md)."""
        self.local, self.inbox, self.inflight, self.recv_works = {}, {}, [], {}
        outbox: dict[Message, torch.Tensor] = {}
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for c, s in sorted(enumerate(self.stages), key=lambda cs: cs[1]):
            if s == 0:
                x = batch["inputs"]
            else:
                msg = ("act", s, 0)
                if msg not in self.local:
                    self._post([], [(self._owner(s - 1), msg)], outbox, [batch])
                x = self._take(msg).to(self.param_dtype)
            out = forward(self.model.chunks[c], x, batch)
            if s == self.n_stages - 1:
                loss += loss_fn(out, batch["labels"]).double()
            else:
                msg = ("act", s + 1, 0)
                self._hand_over(outbox, msg, out.to(self.param_dtype))
                if msg in outbox:
                    self._post([(self._owner(s + 1), msg)], [], outbox, [batch])
        for works, _ in self.inflight:
            comm.wait_all(works)
        self.inflight = []
        if self.group is not None:
            comm.all_reduce(loss, self.group, "pp")
        return loss

    def gather_state(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every pp rank's part of a by-name state (``mine``: this rank's chunks), merged on
        pp rank 0 (empty elsewhere)."""
        if self.group is None:
            return mine
        out = comm.gather_object(mine, self.group, 0)
        if out is None:
            return {}
        merged = {}
        for part in out:
            merged.update(part)
        return merged
