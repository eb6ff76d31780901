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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshfold.comm import ledger
from meshfold.config import Config, ConfigError
from meshfold.models.llama import Transformer, init_weights
from meshfold.parallel.materialize import build_on_meta

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
    from meshfold.parallel.stage_balance import balanced_split

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
    from meshfold.parallel.timeline import bubble_fractions

    fr = bubble_fractions(simulate(schedule, schedule_actions(schedule, pp, virtual, m)))
    return sum(fr.values()) / len(fr)


# --------------------------------------------------------------------------- execution


class PipelineModel(nn.Module):
    """This rank's stage modules (chunks), in chunk order."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)


class Pipeline:
    """Builds this rank's stages and runs the schedule for a trainer."""

    TAG = {"act": 1, "grad": 2}

    def __init__(self, trainer):
        from meshfold.parallel import parallelize
        from meshfold.parallel.data import grad_reducers, unwrap, uses_fsdp
        from meshfold.parallel.stage_balance import describe_split

        self.trainer = trainer
        cfg, dims = trainer.cfg, trainer.dims
        p = cfg.parallel
        self.schedule, self.pp, self.virtual = p.pp_schedule, p.pp, p.pp_virtual_stages
        self.n_chunks = chunks_per_rank(self.schedule, self.virtual)
        self.n_stages = self.pp * self.n_chunks
        self.rank = dims.rank("pp")
        self.split, source = stage_split(cfg)
        self.stages = [stage_of(self.schedule, self.pp, self.rank, c) for c in range(self.n_chunks)]
        if trainer.rank == 0:
            owners = [rank_chunk_of_stage(self.schedule, self.pp, s)[0] for s in range(self.n_stages)]
            print(describe_split(cfg.model, self.split, owners, source), flush=True)
        # Global ranks of the pp peers of this rank (same coordinates on every other dim).
        # (The group's rank list, not the mesh tensor: no tensor ops, so dry-run's fake
        # tensors can build stages too; pp ranks ascend with the stage index.)
        self.peers = dist.get_process_group_ranks(dims.group("pp")) if dims.distributed else [0]
        self.group = dims.group("pp")
        chunks = []
        for s in self.stages:
            stage = build_stage(cfg, self.split, s, meta=True, dtype=trainer.param_dtype)
            chunks.append(unwrap(parallelize(stage, cfg, dims, trainer.device)))
        self.model = PipelineModel(chunks)
        trainer.model_parts = chunks  # checkpoints save each chunk under the full model's names
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

    # ---------------------------------------------------------------- p2p

    def _peer(self, stage: int) -> tuple[int, int]:
        """(global rank, chunk) holding ``stage``."""
        r, c = rank_chunk_of_stage(self.schedule, self.pp, stage)
        return self.peers[r], c

    def _tag(self, kind: str, stage: int, mb: int) -> int:
        return (self.TAG[kind] * 1024 + stage) * 4096 + mb

    def _send(self, tensor: torch.Tensor, kind: str, to_stage: int, mb: int) -> None:
        dst, _ = self._peer(to_stage)
        if dst == dist.get_rank():
            self.local[(kind, to_stage, mb)] = tensor
            return
        tensor = tensor.contiguous()
        self.pending.append((dist.isend(tensor, dst=dst, tag=self._tag(kind, to_stage, mb)), tensor))
        ledger().add_sent("pp", tensor.numel() * tensor.element_size())

    def _recv(self, kind: str, stage: int, mb: int, shape) -> torch.Tensor:
        src_stage = stage - 1 if kind == "act" else stage + 1
        src, _ = self._peer(src_stage)
        if src == dist.get_rank():
            return self.local.pop((kind, stage, mb))
        buf = torch.empty(shape, dtype=self.trainer.param_dtype, device=self.trainer.device)
        dist.recv(buf, src=src, tag=self._tag(kind, stage, mb))
        return buf

    # ---------------------------------------------------------------- one step

    def _act_shape(self, mb: dict) -> tuple[int, int, int]:
        """Hidden states between stages: [micro-batch, sequence, dim]; under sequence
        parallel each tp rank holds (and sends to its tp peer) a 1/tp slice of the sequence."""
        p = self.trainer.cfg.parallel
        b, s = mb["inputs"].shape[:2]
        return b, s // (p.tp if p.sp else 1), self.trainer.cfg.model.dim

    def orders_for(self, m: int) -> list[Action]:
        if m not in self.orders:
            self.orders[m] = schedule_actions(self.schedule, self.pp, self.virtual, m)
        return self.orders[m][self.rank]

    def _forward(self, chunk: int, x: torch.Tensor, mb: dict) -> torch.Tensor:
        tr = self.trainer
        doc_ids = mb["doc_ids"] if tr.use_doc_mask else None
        with tr.autocast():
            return self.model.chunks[chunk](x, positions=mb.get("positions"), doc_ids=doc_ids)

    def forward_backward(self, micro: list[dict], global_tokens: torch.Tensor) -> torch.Tensor:
        tr = self.trainer
        scale = tr.grad_reducers / global_tokens.clamp(min=1)
        m = len(micro)
        order = self.orders_for(m)
        self.local, self.pending = {}, []
        saved: dict[tuple[int, int], tuple] = {}
        wgrad: dict[tuple[int, int], list] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=tr.device)
        events = []
        last_grad_action = {}
        for i, a in enumerate(order):
            if a.kind != "F":
                last_grad_action[a.chunk] = i
        self._set_grad_sync(None)
        self._barrier()
        t0 = time.perf_counter()
        for i, a in enumerate(order):
            if last_grad_action.get(a.chunk) == i:
                self._set_grad_sync(a.chunk)
            s = self.stages[a.chunk]
            mb = micro[a.mb]
            shape = self._act_shape(mb)
            if a.kind == "F":
                x = mb["inputs"] if s == 0 else self._recv("act", s, a.mb, shape).requires_grad_(True)
                start = time.perf_counter()
                out = self._forward(a.chunk, x, mb)
                aux = self._moe_aux(a.chunk, m)
                if s == self.n_stages - 1:
                    loss = tr.loss_fn(out, mb["labels"])
                    loss_sum += loss.detach().double()
                    out = loss * scale.to(loss.dtype)
                else:
                    out = out.to(tr.param_dtype)
                    self._send(out.detach(), "act", s + 1, a.mb)
                saved[(a.chunk, a.mb)] = (x, out, aux)
            elif a.kind == "B":
                x, out, aux = saved.pop((a.chunk, a.mb))
                grad = None if s == self.n_stages - 1 else self._recv("grad", s, a.mb, shape)
                start = time.perf_counter()
                outs, grads = [out], [torch.ones_like(out) if grad is None else grad]
                if aux is not None and aux.requires_grad:  # MoE balance terms of this chunk join its backward
                    outs.append(aux)
                    grads.append(torch.ones_like(aux))
                if self.split_backward and s > 0:
                    from torch.distributed.pipelining._backward import stage_backward_input

                    _, groups = stage_backward_input(outs, grads, [x], self.model.chunks[a.chunk].parameters())
                    wgrad[(a.chunk, a.mb)] = groups
                else:
                    torch.autograd.backward(outs, grads)
                if s > 0:
                    self._send(x.grad, "grad", s - 1, a.mb)
                del x, out, aux
            else:
                start = time.perf_counter()
                from torch.distributed.pipelining._backward import stage_backward_weight

                groups = wgrad.pop((a.chunk, a.mb), None)
                if groups is not None:
                    stage_backward_weight(self.model.chunks[a.chunk].parameters(), groups)
            events.append({"stage": self.rank, "chunk": a.chunk, "mb": a.mb, "kind": a.kind,
                           "start": start - t0, "end": time.perf_counter() - t0})
        for work, _ in self.pending:
            work.wait()
        span = time.perf_counter() - t0
        self.pending, self.local = [], {}
        for reducers in self.reducers:
            for reducer in reducers:
                reducer.finish()
        self._set_grad_sync("all")
        self._record_bubble(events, span, m)
        self._log_events()
        # The loss lives on the last stage; every pp rank returns the same sum.
        if dist.is_initialized() and self.pp > 1:
            dist.all_reduce(loss_sum, group=self.group)
            ledger().record("pp", "all_reduce", 8, self.pp)
        return loss_sum

    def _moe_aux(self, chunk: int, m: int) -> torch.Tensor | None:
        """This chunk's MoE auxiliary losses for the micro-batch just run, scaled like the
        trainer's (``Trainer.moe_aux``): their sum over ranks is the global-batch value."""
        from meshfold.models.moe import moe_aux_loss

        aux = moe_aux_loss(self.model.chunks[chunk])
        return None if aux is None else aux * (self.trainer.grad_reducers / m)

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

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

    def _record_bubble(self, events: list[dict], span: float, m: int) -> None:
        """bubble of stage r = 1 - busy_r / makespan, makespan = the slowest rank's span
        from the common barrier. Per-rank numbers travel to every pp rank."""
        busy = sum(e["end"] - e["start"] for e in events)
        stats = torch.zeros(2 * self.pp, dtype=torch.float64)
        stats[self.rank], stats[self.pp + self.rank] = busy, span
        if self.group is not None:
            dist.all_reduce(stats, group=self.group)
            ledger().record("pp", "all_reduce", stats.numel() * 8, self.pp)
        busy_all, makespan = stats[: self.pp], float(stats[self.pp:].max())
        per_stage = [max(0.0, 1.0 - float(b) / makespan) if makespan > 0 else 0.0 for b in busy_all]
        self.last_bubble = per_stage
        self.events = events
        self.trainer.step_metrics.update({
            "bubble_frac": sum(per_stage) / len(per_stage),
            "bubble_frac_stages": [round(b, 4) for b in per_stage],
            "bubble_theory": theoretical_bubble(self.schedule, self.pp, self.virtual, m),
            "pp_microbatches": m,
        })

    def micro_batches(self, batch: dict) -> list[dict]:
        """Split this rank's batch into the schedule's micro-batches: ``pp_microbatches``,
        or max(pp, local / micro_batch); ``validate`` checks that it divides."""
        local = batch["inputs"].shape[0]
        p, micro = self.trainer.cfg.parallel, self.trainer.cfg.train.micro_batch or local
        m = p.pp_microbatches or max(p.pp, local // micro)
        size = local // m
        return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(m)]

    # ---------------------------------------------------------------- timeline log

    def _log_events(self) -> None:
        """Append this step's events of all stages to RUN_DIR/pipeline_timeline.jsonl
        (global rank 0) on the steps metrics are logged; ``meshfold timeline RUN_DIR`` draws them."""
        tr = self.trainer
        if (tr.step + 1) % max(1, tr.cfg.train.log_every) and tr.step + 1 != tr.cfg.train.steps:
            return
        events = self.gather_events()
        if tr.rank != 0 or events is None:
            return
        tr.run_dir.mkdir(parents=True, exist_ok=True)
        record = {"step": tr.step + 1, "schedule": self.schedule, "pp": self.pp, "virtual": self.virtual,
                  "microbatches": self.trainer.step_metrics.get("pp_microbatches"), "events": events}
        with open(tr.run_dir / TIMELINE_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def gather_events(self) -> list[dict] | None:
        """This step's events of every pp rank, on pp rank 0 (None elsewhere)."""
        if self.group is None:
            return self.events
        out = [None] * self.pp if self.rank == 0 else None
        dist.gather_object(self.events, out, group=self.group, group_dst=0)
        return [e for evs in out for e in evs] if out is not None else None

    # ---------------------------------------------------------------- eval, inspection

    @torch.no_grad()
    def forward_loss_sum(self, batch: dict) -> torch.Tensor:
        """Forward of one batch through all stages in stage order; the loss sum on every pp
        rank. Sends are asynchronous, so visiting stages in global order cannot deadlock."""
        self.local, self.pending = {}, []
        loss = torch.zeros((), dtype=torch.float64, device=self.trainer.device)
        shape = self._act_shape(batch)
        for c, s in sorted(enumerate(self.stages), key=lambda cs: cs[1]):
            x = batch["inputs"] if s == 0 else self._recv("act", s, 0, shape)
            out = self._forward(c, x, batch)
            if s == self.n_stages - 1:
                loss += self.trainer.loss_fn(out, batch["labels"]).double()
            else:
                self._send(out.to(self.trainer.param_dtype), "act", s + 1, 0)
        for work, _ in self.pending:
            work.wait()
        self.pending = []
        if self.group is not None:
            dist.all_reduce(loss, group=self.group)
        return loss

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded parameters (or gradients) of the whole model, on pp rank 0."""
        mine = {}
        for chunk in self.model.chunks:
            for name, p in chunk.named_parameters():
                t = p.grad if grads else p
                if t is None:
                    continue
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                mine[name] = full.detach().clone().cpu()
        if self.group is None:
            return mine
        out = [None] * self.pp if self.rank == 0 else None
        dist.gather_object(mine, out, group=self.group, group_dst=0)
        if out is None:
            return {}
        merged = {}
        for part in out:
            merged.update(part)
        return merged



