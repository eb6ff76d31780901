"""Expert parallel's token exchanges and dispatchers (what ``MoE.dispatcher`` takes): the
all-to-all of variable split sizes to the experts' ranks and back, optionally in chunks
that overlap the expert computation (``AllToAllDispatcher``); the experts split over tp
(``TensorParallelExpertDispatcher``); and, under sequence parallel, the gathers of each tp
rank's routed tokens around the experts (``tokens_in`` / ``tokens_out``). The layout is
``parallel/ep/plan.py``'s."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshfold.comm import all_to_all_single
from meshfold.models.moe import CapacitySlots, balanced_counts, combine
from meshfold.models.moe_experts import count_rows, fixed_groups, gather_rows, read_counts, scatter_add_rows
from meshfold.parallel.tp.collectives import TensorParallelGroup, _on_wire, wire_dtype


def _a2a(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] if out_splits is None else sum(out_splits),) + tuple(x.shape[1:]))
    all_to_all_single(out, x.contiguous(), group, "ep", out_splits=out_splits, in_splits=in_splits)
    return out


def tokens_in(tp: TensorParallelGroup, x, token, expert, weight) -> tuple:
    """Tokens and their routing into experts split over tp (``x`` [rows, dim]; ``token``,
    ``expert``, ``weight``: one entry per assignment). Without sp every tp rank holds the same
    tokens: f on ``x`` (all-reduce backward, wire dtype) and the gates' gradient summed over
    tp. With sp each tp rank routed only its 1/tp of the sequence: ``x``, the chosen experts
    and the gates are all-gathered over tp, rank-major (reduce-scatter backward), so every tp
    rank sees every token of the sequence for its expert column (Megatron's all-gather token
    dispatcher). Gates and their gradients cross in the wire dtype, as the tokens do."""
    # The gates are cast to the compute dtype before they cross and the k weighted outputs are
    # still added in fp32 after (``combine``): the experts apply a gate in the compute dtype
    # anyway (GroupedExperts._run), and an assignment's gate gradient is non-zero on the one tp
    # rank owning its expert, so the sum over tp adds zeros to one bf16 value: exact in bf16.
    # Summing in fp32 instead would only double the bytes of that exchange.
    weight = _on_wire(weight, wire_dtype(weight))
    if not tp.sp:
        return tp.enter(x), token, expert, tp.grad_sum(weight)
    rows = x.shape[0]
    # every rank's assignments are its rows' top-k in row order, so rank r's token ids are
    # this rank's shifted by r * rows (a capacity's slots come in this order: sequence_capacity)
    shift = rows * torch.arange(tp.size, device=token.device, dtype=token.dtype)
    token = (token[None] + shift[:, None]).flatten()
    return tp.gather_tokens(x), token, tp.all_gather(expert, 0), tp.gather_tokens(weight)


def sequence_capacity(tp: TensorParallelGroup):
    """``MoE.sequence_capacity`` under sp: a capacity is per whole sequence (first choices
    first, then by position), and each tp rank routed only its 1/tp slice of every sequence.
    The chosen experts are all-gathered over tp along the sequence (int64), every tp rank
    computes the whole sequences' slots exactly as one process does, and hands the
    dispatcher its keep/slot per assignment in ``tokens_in``'s rank-major order; the rank
    keeps its own assignments' keep for the balance statistics (summed over tp there)."""

    def capacity(moe, idx: torch.Tensor, batch: int, seq: int) -> tuple:
        k, n = idx.shape[-1], tp.size
        whole = tp.all_gather(idx.reshape(batch, seq, k), 1)  # [batch, n * seq, k], in sequence order
        keep, slot = moe.capacity_slots(whole.reshape(-1, k), batch, n * seq)
        ranked = lambda t: t.view(batch, n, seq, k).transpose(0, 1).reshape(-1)  # noqa: E731
        mine = keep.view(batch, n, seq, k)[:, tp.rank].reshape(-1, k)
        return mine, (ranked(keep), ranked(slot), batch * moe.capacity(n * seq))

    return capacity


def tokens_out(tp: TensorParallelGroup, out: torch.Tensor) -> torch.Tensor:
    """The per-token partial sums of this tp rank's experts, summed over tp: all-reduce
    (no sp), or reduce-scatter back to each rank's own rows (sp)."""
    return tp.scatter_tokens(out) if tp.sp else tp.leave(out)


class AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits (None: equal ones); its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.args = (out_splits, in_splits, group)
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.args
        return _a2a(grad, in_splits, out_splits, group), None, None, None


class _InFlight:
    """One asynchronous all-to-all, started by one autograd node (``_Start``) and finished
    by a later one (``_Finish``). In backward the roles swap: ``_Finish``'s backward starts
    the reverse exchange of the gradient and ``_Start``'s backward waits for it, so whatever
    autograd runs between the two (the experts' backward) overlaps it as in the forward."""

    def __init__(self, out_splits: list[int] | None, in_splits: list[int] | None, group):
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.work = self.grad = None


def _a2a_async(x: torch.Tensor, out_splits, in_splits, group):
    out = x.new_empty((x.shape[0] if out_splits is None else sum(out_splits),) + tuple(x.shape[1:]))
    return out, all_to_all_single(out, x.contiguous(), group, "ep", out_splits=out_splits, in_splits=in_splits,
                                  async_op=True)


class _Start(torch.autograd.Function):
    """Start the exchange of ``x``; the result is valid once the matching ``_Finish`` ran."""

    @staticmethod
    def forward(ctx, x, flight: _InFlight):
        ctx.flight = flight
        out, flight.work = _a2a_async(x, flight.out_splits, flight.in_splits, flight.group)
        return out

    @staticmethod
    def backward(ctx, _placeholder):
        f = ctx.flight
        f.work.wait()  # the reverse exchange _Finish's backward started
        grad, f.work, f.grad = f.grad, None, None
        return grad, None


class _Finish(torch.autograd.Function):
    """Wait for the exchange ``_Start`` began (NCCL: the compute stream waits, the host does not)."""

    @staticmethod
    def forward(ctx, out, flight: _InFlight):
        ctx.flight = flight
        flight.work.wait()
        flight.work = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        f = ctx.flight
        f.grad, f.work = _a2a_async(grad, f.in_splits, f.out_splits, f.group)
        return grad, None  # a placeholder: _Start's backward returns the exchanged gradient


def overlapped_exchange(sends: list[torch.Tensor], splits: list[tuple | None], compute, group) -> list[torch.Tensor]:
    """Chunk i's rows ``sends[i]`` go to their experts (all-to-all with ``splits[i]`` = (out,
    in) sizes, None: equal) and come back through ``compute(i, rows)``, software-pipelined:
    chunk i+1's dispatch is in flight while the experts compute chunk i, and chunk i's
    combine while they compute chunk i+1. Only the first dispatch and the last combine are
    exposed. Every rank issues the same exchanges in the same order (dispatch 0, dispatch 1,
    combine 0, dispatch 2, combine 1, ...); backward issues their reverses in autograd's
    (deterministic, the same on every rank) order, the last chunk's first."""
    n = len(sends)

    def start(i: int, x: torch.Tensor, back: bool):
        out_splits, in_splits = splits[i] if splits[i] is not None else (None, None)
        flight = _InFlight(in_splits, out_splits, group) if back else _InFlight(out_splits, in_splits, group)
        return _Start.apply(x, flight), flight

    going = [start(0, sends[0], False)] + [None] * (n - 1)
    coming = []
    for i in range(n):
        if i + 1 < n:
            going[i + 1] = start(i + 1, sends[i + 1], False)
        rows = _Finish.apply(*going[i])
        going[i] = None
        coming.append(start(i, compute(i, rows), True))
    return [_Finish.apply(y, flight) for y, flight in coming]


def _dealt(start: int, stop: int, n: int) -> list[int]:
    """Assignments [start, stop) of a rank dealt to n experts in turn (assignment i to expert
    i mod n): a balanced router's counts for one chunk; over all chunks they add up to
    ``balanced_counts`` of the whole, so the chunked dry-run sends the unchunked bytes."""
    return [len(range(start + (e - start) % n, stop, n)) for e in range(n)]


def _bounds(total: int, n: int) -> list[int]:
    """n contiguous ranges covering [0, total): index t is in range t * n // total."""
    return [-(-c * total // n) for c in range(n + 1)]


class AllToAllDispatcher(nn.Module):
    """Dispatch (token, expert) assignments to the ranks owning the experts, run the local
    experts grouped, send the results back, weight them and add them per token.

    With tp > 1 (``tp`` set) each ep rank's experts are split again over the tp ranks of
    its tensor-parallel group: the tokens are replicated over tp, and tp rank r dispatches
    only the assignments to experts of its column (the r-th 1/tp of every ep rank's
    experts), so every assignment is computed once; the partial per-token sums are added
    over tp (Megatron's f/g pair around the MoE, as for a row-parallel linear). With
    ``columns = False`` (expert tp, ``expert_tp.py``) the experts are split inside instead:
    every tp rank dispatches all assignments, and the same f/g pair adds the partial sums.

    Dropless, the per-expert counts are exchanged on the device; the variable all-to-all
    needs its split sizes on the host, read once per forward (both directions in one
    transfer), as torchtitan's and Megatron's all-to-all dispatchers do. Under a capacity
    (``capacity``) every expert has its fixed slots (``CapacitySlots``, padded): the
    all-to-alls have equal splits and nothing is read on the host (Megatron's
    ``moe_pad_expert_input_to_capacity``)."""

    def __init__(self, group: dist.ProcessGroup, ep_rank: int, ep: int, tp: TensorParallelGroup | None = None,
                 chunks: int = 1, columns: bool = True):
        super().__init__()
        self.group, self.ep_rank, self.ep = group, ep_rank, ep
        self.tp = tp if tp is not None and tp.size > 1 else None
        # With tp: whole experts in tp columns (``columns``: this rank dispatches its column's
        # assignments), or each expert split over tp (expert tp, ``ep/expert_tp.py``: all of them)
        self.cols, self.col = (self.tp.size, self.tp.rank) if self.tp is not None and columns else (1, 0)
        self.chunks = chunks  # parallel.ep_overlap_chunks: > 1 pipelines the exchange (overlapped_exchange)
        # The dispatch's exchange of rows to their experts ``(rows, out_splits, in_splits, group)``
        # (an autograd function; parallel/fp8/dispatch.py puts an fp8 one here); the combine's is AllToAll
        self.send_rows = AllToAll.apply

    def forward(self, x, token, expert, weight, experts, n_experts: int, capacity: tuple | None = None):
        P, per_ep = self.ep, n_experts // self.ep
        if self.tp is not None:  # the tokens enter like a column-parallel layer's input (no sp: f; sp: gathered)
            x, token, expert, weight = tokens_in(self.tp, x, token, expert, weight)
        local_e = per_ep // self.cols
        if capacity is not None:
            return self._fixed(x, CapacitySlots(token, expert, *capacity, n_experts), weight, experts, local_e)
        if self.cols == 1:
            key = expert
        else:
            within = expert % per_ep - self.col * local_e  # index among this tp column's experts
            mine = (within >= 0) & (within < local_e)
            key = torch.where(mine, (expert // per_ep) * local_e + within, P * local_e)  # others sort last
        if min(self.chunks, x.shape[0]) > 1:
            out = self._dropless_chunks(x, token, key, weight, experts, n_experts, local_e)
            return out if self.tp is None else tokens_out(self.tp, out)
        order = torch.argsort(key, stable=True)
        # (without values: a balanced router's counts, the same on every rank)
        column = lambda: self._balanced_column(expert.shape[0], n_experts, local_e)  # noqa: E731
        counts = count_rows(key, P * local_e + 1,
                            lambda: sum(column(), []) + [expert.shape[0] - sum(map(sum, column()))])
        counts = counts[: P * local_e]  # experts of rank j contiguous
        # Tell every rank how many rows it gets for each of its experts: recv[src, e_local].
        recv = torch.empty_like(counts)
        all_to_all_single(recv, counts, self.group, "ep")
        recv = recv.view(P, local_e)
        send_splits, recv_splits = read_counts(  # the one host read
            torch.stack([counts.view(P, local_e).sum(1), recv.sum(1)]),
            lambda: [[sum(c) for c in column()], [sum(column()[self.ep_rank])] * P])
        order = order[: sum(send_splits)]  # with tp: this column's assignments only
        token = token[order]
        rows = self.send_rows(gather_rows(x, token), recv_splits, send_splits, self.group)

        # Rows arrive grouped by source rank, then expert; the experts want expert, then source.
        local_expert = torch.arange(P * local_e, device=x.device) % local_e
        row_expert = torch.repeat_interleave(local_expert, recv.flatten(), output_size=rows.shape[0])
        by_expert = torch.argsort(row_expert, stable=True)
        y = experts(rows[by_expert], recv.sum(0))
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=x.device)
        y = AllToAll.apply(y[back], send_splits, recv_splits, self.group)
        out = combine(x, token, y, weight[order])
        return out if self.tp is None else tokens_out(self.tp, out)

    def _dropless_chunks(self, x, token, key, weight, experts, n_experts: int, local_e: int) -> torch.Tensor:
        """Dropless, pipelined (``overlapped_exchange``): the tokens are split into n
        contiguous ranges and each range's assignments go out as one chunk. The per-chunk
        counts travel in one all-to-all and reach the host in one read for all chunks."""
        P, T, A = self.ep, x.shape[0], key.shape[0]
        n, k, width = min(self.chunks, T), A // T, P * local_e + 1  # k assignments per token
        bounds = _bounds(T, n)
        # sort by (chunk of the token, expert): chunk c's assignments to this column's experts,
        # expert-major, start at k * bounds[c]; with tp the other columns' follow them
        chunk_key = token * n // T * width + key
        order = torch.argsort(chunk_key, stable=True)
        counts = count_rows(chunk_key, n * width).view(n, width)[:, : P * local_e]
        counts = counts.reshape(n, P, local_e).transpose(0, 1).contiguous()  # [destination rank, chunk, expert]
        recv = torch.empty_like(counts)
        all_to_all_single(recv, counts, self.group, "ep")  # recv[source rank, chunk, expert]
        counts, recv = counts.transpose(0, 1), recv.transpose(0, 1)  # [chunk, rank, expert]

        def balanced():  # a balanced router's rows, chunk by chunk (no values: meshfold dry-run)
            cols = [self._balanced_column(0, n_experts, local_e, _dealt(k * bounds[c], k * bounds[c + 1], n_experts))
                    for c in range(n)]
            return [[[sum(e) for e in col] for col in cols], [[sum(col[self.ep_rank])] * P for col in cols]]

        send_splits, recv_splits = read_counts(torch.stack([counts.sum(2), recv.sum(2)]), balanced)  # one read
        local_expert = torch.arange(P * local_e, device=x.device) % local_e
        orders, sends, regroup = [], [], []
        for c in range(n):
            mine = order[k * bounds[c]: k * bounds[c] + sum(send_splits[c])]
            orders.append(mine)
            sends.append(gather_rows(x, token[mine]))
            # rows arrive grouped by source rank, then expert; the experts want expert, then source
            row_expert = torch.repeat_interleave(local_expert, recv[c].flatten(), output_size=sum(recv_splits[c]))
            by_expert = torch.argsort(row_expert, stable=True)
            back = torch.empty_like(by_expert)
            back[by_expert] = torch.arange(by_expert.numel(), device=x.device)
            regroup.append((by_expert, back, recv[c].sum(0)))

        def feed(run, sends):
            def compute(c, rows):
                by_expert, back, per_expert = regroup[c]
                return run(rows[by_expert], per_expert)[back]

            splits = [(recv_splits[c], send_splits[c]) for c in range(n)]
            return overlapped_exchange(sends, splits, compute, self.group)

        order = torch.cat(orders)
        return combine(x, token[order], torch.cat(experts(feed, sends=sends)), weight[order])

    def _fixed(self, x, slots: CapacitySlots, weight, experts, local_e: int) -> torch.Tensor:
        """Capacity mode: the slots of this tp column's experts on every ep rank (padded rows,
        zeros where empty) go out and come back in equal-split all-to-alls."""
        P, per = self.ep, slots.per
        r, t = self.col, self.cols
        pick = lambda v: v.view(P, t, -1)[:, r].reshape(-1)  # noqa: E731  ep rank j's column-r experts' slots
        token, rows = slots.rows(x, pick)
        if min(self.chunks, per) > 1:
            out = self._fixed_chunks(x, token, rows, pick(slots.gates(weight)), experts, local_e, per)
            return out if self.tp is None else tokens_out(self.tp, out)
        rows = self.send_rows(rows, None, None, self.group)  # [source rank, local expert, slot, dim]
        dim = rows.shape[1]
        rows = rows.view(P, local_e, per, dim).transpose(0, 1).reshape(local_e * P * per, dim)
        y = experts(rows, None, fixed_groups(local_e, P * per))
        y = y.view(local_e, P, per, -1).transpose(0, 1).reshape(P * local_e * per, -1)
        y = AllToAll.apply(y, None, None, self.group)
        out = combine(x, token, y, pick(slots.gates(weight)))
        return out if self.tp is None else tokens_out(self.tp, out)

    def _fixed_chunks(self, x, token, rows, gates, experts, local_e: int, per: int) -> torch.Tensor:
        """Capacity mode, pipelined (``overlapped_exchange``): every expert's ``per`` slots are
        split into n ranges and range c of every expert goes out as chunk c (equal splits, no
        host read)."""
        P, dim, n = self.ep, rows.shape[1], min(self.chunks, per)
        bounds = _bounds(per, n)
        sl = [slice(bounds[c], bounds[c + 1]) for c in range(n)]
        rows, token, gates = rows.view(P, local_e, per, dim), token.view(P, local_e, per), gates.view(P, local_e, per)
        sends = [rows[:, :, s].reshape(-1, dim) for s in sl]  # [destination rank, local expert, slot, dim]

        def feed(run, sends):
            def compute(c, got):
                w = bounds[c + 1] - bounds[c]
                got = got.view(P, local_e, w, dim).transpose(0, 1).reshape(local_e * P * w, dim)
                y = run(got, None, fixed_groups(local_e, P * w))
                return y.view(local_e, P, w, -1).transpose(0, 1).reshape(P * local_e * w, -1)

            return overlapped_exchange(sends, [None] * n, compute, self.group)

        y = torch.cat(experts(feed, sends=sends))
        return combine(x, torch.cat([token[:, :, s].reshape(-1) for s in sl]), y,
                       torch.cat([gates[:, :, s].reshape(-1) for s in sl]))

    def _balanced_column(self, assignments: int, n_experts: int, local_e: int,
                         every: list[int] | None = None) -> list[list[int]]:
        """A balanced router's rows from this rank to each ep rank's experts of this tp column
        (``balanced_counts`` over all experts, by global expert id; or ``every``'s)."""
        every = every if every is not None else balanced_counts(assignments, n_experts)
        per_ep, r = n_experts // self.ep, self.col
        return [every[j * per_ep + r * local_e: j * per_ep + (r + 1) * local_e] for j in range(self.ep)]


class TensorParallelExpertDispatcher(nn.Module):
    """tp > 1 without ep: every tp rank holds the same tokens; tp rank r computes only its
    slice [start, stop) of the experts for all of them, and the partial outputs are summed
    over tp (Megatron's f/g pair: inputs and gates enter with an all-reduce in backward, the
    output leaves with an all-reduce in forward). No expert FLOP is done twice."""

    def __init__(self, tp: TensorParallelGroup, start: int, stop: int):
        super().__init__()
        self.tp, self.start, self.stop = tp, start, stop

    def forward(self, x, token, expert, weight, experts, n_experts: int, capacity: tuple | None = None):
        x, token, expert, weight = tokens_in(self.tp, x, token, expert, weight)  # as AllToAllDispatcher's
        n_local = self.stop - self.start
        if capacity is not None:  # this rank's experts' fixed slots (padded): no host read
            slots = CapacitySlots(token, expert, *capacity, n_experts)
            pick = lambda v: v[self.start * slots.per: self.stop * slots.per]  # noqa: E731
            token, rows = slots.rows(x, pick)
            y = experts(rows, None, fixed_groups(n_local, slots.per), pick(slots.gates(weight)))
            return tokens_out(self.tp, scatter_add_rows(x, token, y))
        local = (expert >= self.start) & (expert < self.stop)
        key = torch.where(local, expert - self.start, n_local)  # other ranks' experts sort last
        mine = lambda: balanced_counts(expert.shape[0], n_experts)[self.start:self.stop]  # noqa: E731
        counts = count_rows(key, n_local + 1, lambda: mine() + [expert.shape[0] - sum(mine())])[:n_local]
        rows = int(read_counts(local.sum(), lambda: sum(mine())))  # host read: this rank's row count
        order = torch.argsort(key, stable=True)[:rows]
        token = token[order]
        y = experts(gather_rows(x, token), counts, gates=weight[order])
        return tokens_out(self.tp, scatter_add_rows(x, token, y))
