"""Point-to-point plan of a pipeline step, pure (no torch): from every rank's schedule,
which activations and gradients each rank sends and receives, batched per action, in an
order that cannot deadlock under NCCL's rules. The executor (``executor.py``) posts the
batches through ``comm.exchange``. ``schedule`` is the registered schedule object
(``meshfold/schedules``): its layout says which rank owns a stage.

NCCL matches point-to-point messages in issue order per (sender, receiver) pair; tags
mean nothing. So every rank derives, from every rank's order, the sequence of messages
on each channel (the sender's issue order) and posts its receives in exactly that order:
matching needs no tag, and an activation can never meet a gradient's receive.
docs/pipeline.md gives the argument; ``replay`` checks it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from meshfold.schedules import Action, Schedule, neighbours

Message = tuple[str, int, int]  # (kind "act" | "grad", destination stage, micro-batch)


def action_messages(schedule: Schedule, pp: int, n_stages: int, rank: int,
                    a: Action) -> tuple[tuple[int, Message] | None, tuple[int, Message] | None]:
    """(peer rank, message) that ``a`` needs before it runs and that it sends after it
    runs (None when nothing); a peer equal to ``rank`` is a hand-over inside the rank."""
    s = schedule.stage_of(pp, rank, a.chunk)

    def owner(stage: int) -> int:
        return schedule.rank_chunk_of_stage(pp, stage)[0]

    before, after = neighbours(a, s, n_stages)  # s-1, s+1 but on skippipe's paths
    need = send = None
    if a.kind == "F":
        if before is not None:
            need = (owner(before), ("act", s, a.mb))
        if after is not None:
            send = (owner(after), ("act", after, a.mb))
    elif a.kind == "B":
        if after is not None:
            need = (owner(after), ("grad", s, a.mb))
        if before is not None:
            send = (owner(before), ("grad", before, a.mb))
    return need, send


@dataclass
class ExchangePlan:
    """One rank's point-to-point traffic for one step. ``batches[k]`` is posted as one
    ``comm.exchange`` before action k (k = 0) or right after action k-1 finished: the sends
    action k-1 produced plus receives, in channel order, posted no later than just before
    the action that needs them. ``needs[k]``: (batch, message) action k waits for, or None."""

    batches: list[tuple[list[tuple[int, Message]], list[tuple[int, Message]]]]
    needs: list[tuple[int, Message] | None]


def _channels(schedule: Schedule, orders: list[list[Action]], n_stages: int) -> dict[tuple[int, int], list[Message]]:
    """(src, dst) -> the messages src sends dst, in src's issue order."""
    channel: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for r, order in enumerate(orders):
        for a in order:
            _, send = action_messages(schedule, len(orders), n_stages, r, a)
            if send is not None and send[0] != r:
                channel[(r, send[0])].append(send[1])
    return channel


def _build_plan(schedule: Schedule, orders: list[list[Action]], early: dict) -> list[ExchangePlan]:
    """Receives go out in the batch just before the action that needs them, or earlier
    where ``early[(rank, src, index on the channel)]`` says; FIFO order kept per channel."""
    pp, n_stages = len(orders), schedule.n_stages(orders)
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


def replay(schedule: Schedule, orders: list[list[Action]], plans: list[ExchangePlan]):
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
            raise RuntimeError(f"{schedule.name}: message {idx} from rank {src} to {dst} is {msg} on one side and "
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


def exchange_plan(schedule: Schedule, orders: list[list[Action]]) -> list[ExchangePlan]:
    """Every rank's exchange batches for these orders, checked deadlock-free under NCCL's
    rules (``replay``). A receive goes out with the previous action's sends, before the
    action that needs it runs; where a sender would
    block on a receive its peer posts too late, that receive moves into the peer's
    latest batch at that point, and the replay runs again (interleaved needs this)."""
    early: dict = {}
    for _ in range(10 * sum(len(o) for o in orders) + 10):
        plans = _build_plan(schedule, orders, early)
        blocked = replay(schedule, orders, plans)
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
            raise RuntimeError(f"{schedule.name}: no deadlock-free exchange found; replay stopped at {blocked}")
    raise RuntimeError(f"{schedule.name}: exchange planning did not converge")


def plan_exists(schedule: Schedule, orders: list[list[Action]]) -> bool:
    """Whether ``exchange_plan`` finds a deadlock-free plan for these orders (a schedule
    that plans its orders per run keeps only orders that have one: ``nccl_check``)."""
    try:
        exchange_plan(schedule, orders)
    except RuntimeError:
        return False
    return True


@lru_cache(maxsize=None)
def nccl_check(schedule: Schedule):
    """``plan_exists`` for ``schedule`` as one function of the orders, the same object on
    every call (``RunFacts.feasible``: the schedule's per-run planning caches by it)."""
    return lambda orders: plan_exists(schedule, orders)
