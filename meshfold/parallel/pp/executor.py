"""Pipeline parallel execution: this rank's stages and the run of a schedule with
measured per-action timings.

What a step runs (layout, orders, dependencies, bubble) is the registered schedule object
(``meshfold/schedules``), looked up once here and priced by the planner too; the orders of
this run are ``run_orders.py``'s, the point-to-point plan ``p2p_plan.py``'s; the stage
modules are ``stage_modules.py``; the timeline's file and drawing ``timeline_plot.py``.

A stage (``stage_modules.py``: the model with the other layers deleted) is ``parallelize``d like
any model (tensor parallel, FSDP), so pp composes with tp and dp. The model is cut into S
contiguous stages (``models/stage_balance.py`` balances them by cost; ``parallel.pp_split``
overrides).

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
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from meshfold import comm
from meshfold.device import StepClock
from meshfold.memory import activation_tag
from meshfold.parallel.parallelize import parallelize
from meshfold.parallel.compute_weights import master_parameters
from meshfold.parallel.dp.plan import unwrap, uses_fsdp
from meshfold.parallel.dp.replicate import grad_reducers
from meshfold.parallel.pp.p2p_plan import Message, exchange_plan
from meshfold.models.stage_balance import describe_split
from meshfold.parallel.pp.run_orders import orders_of_run
from meshfold.parallel.pp.stage_modules import build_stage, stage_split, weight_copies
from meshfold.schedules import Action, get_schedule, neighbours

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config

# --------------------------------------------------------------------------- execution


def _weight_pass(params: list, groups) -> None:
    """torch's ``stage_backward_weight``, then each gradient it set laid out like its
    parameter. It assigns autograd's result as it comes (a grouped GEMM's weight gradient
    arrives transposed), where AccumulateGrad would have matched the parameter's strides;
    fused AdamW reads them as if they did (a zbv MoE run trained on scrambled expert
    gradients), and so do flat gradient buffers."""
    stage_backward_weight(params, groups)
    for p in params:
        g = p.grad
        if g is not None and g.stride() != p.stride():
            p.grad = torch.empty_like(p).copy_(g)


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
        """``wire_dtype``: activations and gradients travel, and enter stages, in the compute
        dtype (bf16 under autocast: the residual stream's; default the parameter dtype). ``announce``: print the stage split (one rank)."""

        p = cfg.parallel
        self.cfg, self.device, self.param_dtype = cfg, device, param_dtype
        self.wire_dtype = wire_dtype or param_dtype
        self.schedule = get_schedule(p.pp_schedule)  # the one lookup; the object answers the rest
        self.pp, self.virtual = p.pp, p.pp_virtual_stages
        self.n_chunks = self.schedule.chunks_per_rank(self.virtual)
        self.n_stages = self.pp * self.n_chunks
        self.rank = dims.rank("pp")
        self.split, source = stage_split(cfg)
        self.stages = [self.schedule.stage_of(self.pp, self.rank, c) for c in range(self.n_chunks)]
        # {stage: module names} of weight copies this rank's stages hold (stage_modules.WEIGHT_COPIES)
        self.copies = weight_copies(cfg, self.n_stages)
        if announce:
            owners = [self.schedule.rank_chunk_of_stage(self.pp, s)[0] for s in range(self.n_stages)]
            print(describe_split(cfg.model, self.split, owners, source), flush=True)
        self.group = dims.group("pp")
        chunks = []
        for s in self.stages:
            stage = build_stage(cfg, self.split, s, meta=True, dtype=param_dtype)
            chunks.append(unwrap(parallelize(stage, cfg, dims, device)))
        self.chunks = chunks  # checkpoints save each chunk under the full model's names
        self.model = PipelineModel(chunks)
        # Without FSDP, data-parallel gradients are averaged by each chunk's GradReducer
        # (parallel/dp/replicate.py; DDP cannot follow interleaved forwards and backwards), armed
        # for the chunk's last backward action so its buckets go out while other chunks and
        # micro-batches still compute; with FSDP the chunk syncs only in that action.
        self.reducers = [grad_reducers(c) for c in chunks]
        self.fsdp = uses_fsdp(dims)
        # FSDP2 reduces (and, ZeRO-2, reshards) each chunk only in its last backward of the step.
        self.defer_fsdp_sync = self.fsdp
        self.zero = p.zero
        # Split backward (B then W) only where the schedule splits it and torch's split works:
        # not through FSDP's hooks, nor on a stage holding a weight copy, which takes no
        # gradient through its input (its whole backward runs in B, its W is empty).
        self.split_backward = self.schedule.splits_backward and not uses_fsdp(dims)
        self.orders = {}
        self.events: list[dict] = []
        self.metrics: dict = {}  # the last step's bubble fields, read by the step engine
        # fn(chunk) before each _set_grad_sync (an observer of what is held then: the dry-run)
        self.grad_sync_observers: list = []

    # ---------------------------------------------------------------- p2p

    def _owner(self, stage: int) -> int:
        """pp rank holding ``stage``."""
        return self.schedule.rank_chunk_of_stage(self.pp, stage)[0]

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

    def orders_for(self, m: int, micro_batch: int = 1) -> list[Action]:
        if m not in self.orders:
            orders = orders_of_run(self.cfg, self.split, m, micro_batch, self.wire_dtype.itemsize, self.schedule)
            self.orders[m] = (orders, exchange_plan(self.schedule, orders))
        return self.orders[m][0][self.rank]

    def forward_backward(self, micro: list[dict], scale: torch.Tensor, forward, loss_fn, moe_aux) -> torch.Tensor:
        """Run the schedule over ``micro``; returns the loss sum over all stages.

        ``forward(module, x, mb)`` runs one chunk, ``loss_fn(out, labels)`` gives the last
        stage's token-loss sum (multiplied by ``scale`` for backward), ``moe_aux(module, m)``
        a chunk's scaled MoE auxiliary terms or None."""
        m = len(micro)
        order = self.orders_for(m, micro[0]["inputs"].shape[0])
        plan = self.orders[m][1][self.rank]
        self.local, self.inbox, self.inflight, self.recv_works = {}, {}, [], {}
        outbox: dict[Message, torch.Tensor] = {}
        saved: dict[tuple[int, int], tuple] = {}
        wgrad: dict[tuple[int, int], list] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        events = []
        last_grad_action = {}
        for i, a in enumerate(order):
            # the action that computes the chunk's weight gradients last: its W under the
            # split backward, else its B (a W is then empty)
            if a.kind == "B" or (a.kind == "W" and self.split_backward):
                last_grad_action[a.chunk] = i
        self._set_grad_sync(None)
        # No barrier: every rank starts when it is ready; the bubble is measured against
        # the wall clock (one host, or NTP-synchronised hosts).
        clock = StepClock(self.device)
        clock.start()
        self._post(*plan.batches[0], outbox, micro)
        for i, a in enumerate(order):
            if last_grad_action.get(a.chunk) == i:
                self._set_grad_sync(a.chunk)
            s = self.stages[a.chunk]
            before, after = neighbours(a, s, self.n_stages)  # on this micro-batch's path
            mb = micro[a.mb]
            if a.kind == "F":
                if s == 0:
                    x = mb["inputs"]
                else:
                    x = self._take(("act", s, a.mb)).to(self.wire_dtype).requires_grad_(True)
                start = clock.mark()
                chunk = self.model.chunks[a.chunk]
                with activation_tag(a.chunk):  # (for a counter: held until this chunk's backward)
                    out = forward(chunk, x, mb)
                    aux = moe_aux(chunk, m)
                    if s == self.n_stages - 1:
                        loss = loss_fn(out, mb["labels"])
                        loss_sum += loss.detach().double()
                        out = loss * scale.to(loss.dtype)
                    else:
                        out = out.to(self.wire_dtype)
                        self._hand_over(outbox, ("act", after, a.mb), out.detach())
                saved[(a.chunk, a.mb)] = (x, out, aux)
            elif a.kind == "B":
                x, out, aux = saved.pop((a.chunk, a.mb))
                grad = None if s == self.n_stages - 1 else self._take(("grad", s, a.mb)).to(out.dtype)
                start = clock.mark()
                outs, grads = [out], [torch.ones_like(out) if grad is None else grad]
                if aux is not None and aux.requires_grad:  # MoE balance terms of this chunk join its backward
                    outs.append(aux)
                    grads.append(torch.ones_like(aux))
                if self._splits(s):
                    _, groups = stage_backward_input(outs, grads, [x],
                                                       master_parameters(self.model.chunks[a.chunk]))
                    wgrad[(a.chunk, a.mb)] = groups
                else:
                    torch.autograd.backward(outs, grads)
                if s > 0:
                    self._hand_over(outbox, ("grad", before, a.mb), x.grad)
                del x, out, aux
            else:
                start = clock.mark()
                groups = wgrad.pop((a.chunk, a.mb), None)
                if groups is not None:
                    _weight_pass(list(master_parameters(self.model.chunks[a.chunk])), groups)
            events.append({"stage": self.rank, "chunk": a.chunk, "mb": a.mb, "kind": a.kind,
                           "start": start, "end": clock.mark()})
            self._post(*plan.batches[i + 1], outbox, micro)
        for works, _ in self.inflight:
            comm.wait_all(works)
        span = clock.finish()
        for e in events:  # (GPU: the events' times, read once the step's work is done)
            e["start"], e["end"] = clock.seconds(e["start"]), clock.seconds(e["end"])
        wall0 = clock.wall0
        self.inflight, self.local, self.inbox, self.recv_works = [], {}, {}, {}
        for reducers in self.reducers:
            for reducer in reducers:
                reducer.finish()
        self._set_grad_sync("all")
        self.metrics = {}
        return self._reduce_step(loss_sum, events, wall0, span, m)

    def _splits(self, stage: int) -> bool:
        """Whether ``stage``'s backward runs as B then W (``split_backward``): never on the
        first stage (no input to differentiate), nor on a stage holding a weight copy."""
        holds_copy = any(stage in stages for stages in self.copies.values())
        return self.split_backward and stage > 0 and not holds_copy

    # ---------------------------------------------------------------- weight copies

    def _copies(self) -> list[tuple[tuple[int, ...], dict[int, nn.Parameter]]]:
        """Per registered weight copy (``stage_modules.weight_copies``; multi-token
        prediction's embedding on the last stage): the stages holding it, and {stage:
        weight} of this rank's among them."""
        out = []
        for name, stages in self.copies.items():
            mine = {s: getattr(self.model.chunks[c], name).weight for c, s in enumerate(self.stages) if s in stages}
            if mine:
                out.append((stages, mine))
        return out

    def embedding_copies(self) -> list[nn.Parameter]:
        """The copies beyond each weight's first holder (clipped, not counted in the norm)."""
        return [w for stages, mine in self._copies() for s, w in mine.items() if s != stages[0]]

    def sum_embedding_grads(self) -> None:
        """A copied weight's gradient is the sum of its holders' (the first stage's, main
        model, and the copy's): all get it, so their updates stay equal. One exchange
        between the two owners (already reduced over dp), or a local sum on one rank (zbv).
        Called by the step engine once the gradients are on the parameters (after the step's
        compute weights handed theirs back)."""
        for (first, last), mine in self._copies():
            grads = {s: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for s, p in mine.items()}
            if len(grads) == 2:
                grads[first].add_(grads[last])
                grads[last].copy_(grads[first])
                continue
            (s, g), = grads.items()
            peer = self._owner(last if s == first else first)
            other = torch.empty_like(g)
            comm.wait_all(comm.exchange([(g.contiguous(), peer)], [(other, peer)], self.group, "pp"))
            # the same order of addition on both ranks: first holder's + the copy's
            total = g + other if s == first else other + g
            g.copy_(total)

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
            "bubble_theory": self.schedule.orders_theoretical_bubble(self.pp, self.virtual, m, self.orders[m][0]),
            "pp_microbatches": m,
        }
        return every[:, 0].sum()

    def _set_grad_sync(self, chunk) -> None:
        """None: no chunk reduces (start of the schedule); an index: that chunk's next
        backward action is its last of the step, so it reduces there; "all": back to
        syncing everywhere (evaluation, other callers). The observers see it first."""
        for observe in self.grad_sync_observers:
            observe(chunk)
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
        record = {"step": step, "schedule": self.schedule.name, "pp": self.pp, "virtual": self.virtual,
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
                x = self._take(msg).to(self.wire_dtype)
            out = forward(self.model.chunks[c], x, batch)
            if s == self.n_stages - 1:
                loss += loss_fn(out, batch["labels"]).double()
            else:
                msg = ("act", s + 1, 0)
                self._hand_over(outbox, msg, out.to(self.wire_dtype))
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
