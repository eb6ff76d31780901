"""Outer optimizers across workers: DiLoCo, Streaming DiLoCo, NoLoCo and CO2.

A *worker* is a group of ranks training one model replica with its own inner layout
(DDP / FSDP / TP / PP inside a fast island). The mesh's outermost dimension "worker" links
rank i of every worker: those ranks hold the same shard of the model, so every outer
exchange here works on this rank's *local* tensors (FSDP / TP shards) and crosses only
the worker group, shard by shard. Notation (docs/lowcomm.md has the full equations):

    theta_i   this worker's parameters (after inner AdamW steps)
    phi       the global copy (identical on every worker for diloco/streaming/co2;
              per-worker for noloco)
    Delta_i   phi - theta_i, the outer gradient ("pseudo-gradient")

The inner optimizer state stays local. ``after_step(step)`` is called by the Trainer after
every inner optimizer step (step counts from 1) and returns per-step metrics fields.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.lowcomm.config import LowCommConfig
from meshfold.lowcomm.codecs.fp4 import fp4_all_reduce_mean, fp4_deflate_all_reduce_mean


def _mean_of(result):
    """The mean of an outer exchange (a deflate-coded one comes as (mean, bytes sent); the
    comm layer has already recorded those bytes)."""
    return result[0] if isinstance(result, tuple) else result


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``p`` (its FSDP/TP shard for a DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p.data


class FlatView:
    """A fixed list of parameters seen as one flat vector (this rank's local parts)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.numels = [local_tensor(p).numel() for p in params]
        self.numel = sum(self.numels)

    @torch.no_grad()
    def read(self) -> torch.Tensor:
        if not self.params:
            return torch.zeros(0, device="cpu")
        return torch.cat([local_tensor(p).detach().reshape(-1) for p in self.params]).clone()

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        for p, chunk in zip(self.params, flat.split(self.numels)):
            t = local_tensor(p)
            t.copy_(chunk.view_as(t))


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() and group is not None else 1


class OuterOptimizer:
    """Shared state: the global copy ``phi`` and outer momentum per fragment."""

    name = "base"

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], lc: LowCommConfig, group,
                 total_steps: int, seed: int = 0, norm_group=None):
        self.lc = lc
        self.group = group
        self.workers = _group_size(group)
        self.worker = dist.get_rank(group) if self.workers > 1 else 0
        self.H = lc.inner_steps
        self.total_steps = total_steps
        self.seed = seed
        self.norm_group = norm_group
        self.fragments = self.split([n for n, _ in named_params], [p for _, p in named_params])
        self.phi = [f.read() for f in self.fragments]
        self.momentum = [torch.zeros_like(x) for x in self.phi]
        self.outer_steps = 0
        # Injection point: live recovery (train/live.py) averages the outer gradient of a
        # fragment over the replica groups of its quorum (in place, ``mean_fn(x, fragment)``,
        # inline); None: over ``group``.
        self.mean_fn = None

    def split(self, names, params) -> list[FlatView]:
        return [FlatView(params)]

    # -- collectives over the worker group, recorded in the ledger under "outer"
    def all_reduce_mean(self, x: torch.Tensor, async_op: bool = False, fragment: int = 0):
        if self.mean_fn is not None:
            self.mean_fn(x, fragment)
            return None
        if self.workers == 1:
            return None
        work = comm.all_reduce(x, self.group, "outer", async_op=async_op)
        if not async_op:
            x.div_(self.workers)
        return work

    def nesterov(self, f: int, delta: torch.Tensor) -> None:
        """phi <- phi - lr (Delta + mu b),  b <- mu b + Delta  (torch SGD, nesterov=True)."""
        mu, lr = self.lc.outer_momentum, self.lc.outer_lr
        b = self.momentum[f]
        b.mul_(mu).add_(delta)
        self.phi[f].sub_(delta + mu * b, alpha=lr)

    def after_step(self, step: int) -> dict:
        raise NotImplementedError

    def exchanged_at(self, step: int) -> set[int]:
        """The fragments whose outer gradient is sent at ``step``."""
        return {0} if step % self.H == 0 else set()

    # -- live recovery's heal (train/live.py): the outer state as plain numbers and tensors,
    # broadcast from a healthy replica in this order (no pickle). ``schedule`` has a fixed
    # length, so a joiner can receive it before it knows what is pending.
    def schedule(self) -> list[int]:
        """[outer steps taken] (Streaming DiLoCo adds its fragments' due steps)."""
        return [self.outer_steps]

    def load_schedule(self, values: list[int]) -> None:
        self.outer_steps = values[0]

    def heal_tensors(self) -> list[torch.Tensor]:
        """The global copy and the outer momentum (Streaming DiLoCo adds its pending results)."""
        return self.phi + self.momentum

    def finish(self) -> None:
        """Complete any exchange still in flight (end of training, before a checkpoint)."""

    # -- checkpoints: everything needed to continue exactly
    def state_dict(self) -> dict:
        self.finish_pending_for_checkpoint()
        return {"method": self.name, "outer_steps": self.outer_steps,
                "phi": [x.clone() for x in self.phi], "momentum": [x.clone() for x in self.momentum],
                **self.extra_state()}

    def load_state_dict(self, sd: dict) -> None:
        if sd["method"] != self.name:
            raise ValueError(f"checkpoint holds {sd['method']} outer state, this run uses {self.name}")
        self.outer_steps = sd["outer_steps"]
        self.phi = [x.clone() for x in sd["phi"]]
        self.momentum = [x.clone() for x in sd["momentum"]]
        self.load_extra_state(sd)

    def finish_pending_for_checkpoint(self) -> None:
        pass

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, sd: dict) -> None:
        pass


class DiLoCo(OuterOptimizer):
    """Every H inner steps: Delta = mean_workers(phi - theta_i); outer Nesterov SGD on phi;
    theta_i <- phi. One all-reduce of the whole (local shard of the) model."""

    name = "diloco"

    def after_step(self, step: int) -> dict:
        if step % self.H:
            return {}
        view = self.fragments[0]
        delta = self.phi[0] - view.read()
        self.all_reduce_mean(delta)
        self.nesterov(0, delta)
        view.write(self.phi[0])
        self.outer_steps += 1
        return {"outer_step": self.outer_steps}


class StreamingDiLoCo(OuterOptimizer):
    """Streaming DiLoCo: P fragments (transformer blocks strided: block l -> fragment l mod P;
    embeddings with fragment 0, final norm/output with fragment P-1). Fragment p syncs at the
    steps t with t mod H = floor(p H / P) (staggered, so each exchange carries ~1/P of the
    model). At t the outer gradient Delta_p = phi_p - theta_p(t) is sent (4-bit E3M0, see
    codecs/fp4.py) while tau more inner steps run; at t + tau:

        phi_p <- Nesterov(phi_p, mean_workers(Delta_p))
        theta_p <- alpha theta_p(t + tau) + (1 - alpha) phi_p       (alpha = lowcomm.mixing)
    """

    name = "streaming"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: dict[int, tuple[int, Future | torch.Tensor]] = {}  # fragment -> (due step, result)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshfold-streaming")
        P = len(self.fragments)
        self.offsets = [(p * self.H) // P for p in range(P)]

    def split(self, names, params) -> list[FlatView]:
        P = self.lc.fragments
        groups: list[list[torch.Tensor]] = [[] for _ in range(P)]
        for name, p in zip(names, params):
            if name.startswith("layers."):
                groups[int(name.split(".")[1]) % P].append(p)
            elif name.startswith(("tok_embeddings", "pos_embeddings")):
                groups[0].append(p)
            else:
                groups[P - 1].append(p)
        return [FlatView(g) for g in groups]

    def exchange(self, delta: torch.Tensor, fragment: int):
        if self.mean_fn is not None:  # live recovery: over its quorum, inline (the schedule is unchanged)
            self.mean_fn(delta, fragment)
            return delta
        n = self.workers
        if n == 1:
            return delta
        # On the background thread (its own group, see lowcomm.outer_group); the comm layer
        # records the bytes when they are sent.
        if self.lc.quant_bits == 4 and self.lc.quant_coding == "deflate":
            return self.executor.submit(fp4_deflate_all_reduce_mean, delta, self.group, "outer")
        if self.lc.quant_bits == 4:
            return self.executor.submit(fp4_all_reduce_mean, delta, self.group, "outer")

        def full_precision(x=delta):
            comm.all_reduce(x, self.group, "outer")
            return x.div_(n)

        return self.executor.submit(full_precision)

    def after_step(self, step: int) -> dict:
        out = {}
        tau = self.lc.overlap_steps
        for p, offset in enumerate(self.offsets):
            if step % self.H == offset and self.fragments[p].numel and p not in self.pending:
                delta = self.phi[p] - self.fragments[p].read()
                self.pending[p] = (step + tau, self.exchange(delta, p))
        last = step >= self.total_steps
        for p in sorted(self.pending):
            due, result = self.pending[p]
            if due <= step or last:
                self.apply(p, result, mix=not last)
                out["outer_step"] = self.outer_steps
        return out

    def schedule(self) -> list[int]:
        """[outer steps taken, then each fragment's due step of a pending result (-1: none)]."""
        return [self.outer_steps] + [int(self.pending[p][0]) if p in self.pending else -1
                                     for p in range(len(self.phi))]

    def load_schedule(self, values: list[int]) -> None:
        """A peer's schedule; its pending results get buffers that ``heal_tensors`` then fills."""
        self.outer_steps = values[0]
        self.pending = {p: (due, torch.zeros_like(self.phi[p])) for p, due in enumerate(values[1:]) if due >= 0}

    def heal_tensors(self) -> list[torch.Tensor]:
        self.finish_pending_for_checkpoint()
        return self.phi + self.momentum + [self.pending[p][1] for p in sorted(self.pending)]

    def exchanged_at(self, step: int) -> set[int]:
        return {p for p, offset in enumerate(self.offsets) if step % self.H == offset and self.fragments[p].numel}

    def apply(self, p: int, result, mix: bool = True) -> None:
        delta = _mean_of(result.result() if isinstance(result, Future) else result)
        del self.pending[p]
        self.nesterov(p, delta)
        alpha = self.lc.mixing if mix else 0.0
        view = self.fragments[p]
        view.write(alpha * view.read() + (1 - alpha) * self.phi[p])
        self.outer_steps += 1

    def finish(self) -> None:
        for p in sorted(self.pending):
            self.apply(p, self.pending[p][1], mix=False)

    def finish_pending_for_checkpoint(self) -> None:
        # Keep the schedule: wait for the results, store them with their due step.
        for p, (due, result) in list(self.pending.items()):
            if isinstance(result, Future):
                self.pending[p] = (due, _mean_of(result.result()))

    def extra_state(self) -> dict:
        return {"pending": {p: (due, r.clone()) for p, (due, r) in self.pending.items()}}

    def load_extra_state(self, sd: dict) -> None:
        self.pending = {int(p): (due, r.clone()) for p, (due, r) in sd.get("pending", {}).items()}


class NoLoCo(OuterOptimizer):
    """NoLoCo: no collective over the workers. Every H steps the workers are paired by a
    permutation of range(W) seeded by (train.seed, outer step); each worker exchanges
    (phi_i, Delta_i) with its one peer j over point-to-point send/recv, and with
    G = {i, j} (just {i} for the odd one out):

        Delta_bar = mean_G Delta,   phi_bar = mean_G phi
        delta_i <- alpha delta_i - beta Delta_bar - gamma (phi_i - phi_bar)
        phi_i   <- phi_i + delta_i,   theta_i <- phi_i

    with alpha = lowcomm.outer_momentum, beta = lowcomm.outer_lr, gamma = lowcomm.noloco_gamma.
    """

    name = "noloco"

    def pairing(self, outer_step: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + outer_step)
        return torch.randperm(self.workers, generator=gen).tolist()

    def peer(self, outer_step: int) -> int | None:
        perm = self.pairing(outer_step)
        pos = perm.index(self.worker)
        mate = pos ^ 1
        return perm[mate] if mate < len(perm) else None

    def exchange(self, payload: torch.Tensor, peer: int) -> torch.Tensor:
        """Model-sized swap with the peer: send and receive posted together (one batch),
        so the two workers, both sending first, cannot deadlock on NCCL."""
        other = torch.empty_like(payload)
        comm.wait_all(comm.exchange([(payload, peer)], [(other, peer)], self.group, "outer"))
        return other

    def after_step(self, step: int) -> dict:
        if step % self.H:
            return {}
        view = self.fragments[0]
        phi = self.phi[0]
        delta = phi - view.read()
        peer = self.peer(self.outer_steps) if self.workers > 1 else None
        if peer is None:
            delta_bar, phi_bar = delta, phi
        else:
            other = self.exchange(torch.cat([phi, delta]), peer)
            phi_bar = (phi + other[: phi.numel()]) / 2
            delta_bar = (delta + other[phi.numel():]) / 2
        a, b, g = self.lc.outer_momentum, self.lc.outer_lr, self.lc.noloco_gamma
        mom = self.momentum[0]
        mom.mul_(a).sub_(delta_bar, alpha=b).sub_(phi - phi_bar, alpha=g)
        phi.add_(mom)
        view.write(phi)
        self.outer_steps += 1
        return {"outer_step": self.outer_steps, "noloco_peer": -1 if peer is None else peer}


class CO2(OuterOptimizer):
    """CO2: the outer all-reduce of round k overlaps with the inner steps of round k+1 and
    is applied one round late. At the end of round k (step kH), with s_i the point worker i
    started round k from and P_i = s_i - theta_i its progress in the round:

        launch  A_k = mean_workers(P_i)                       (async, over the next round)
        wait    A_{k-1}  (launched one round earlier)
        m   <- mu m + A_{k-1};  m <- m * min(1, c / ||m||)     (outer momentum clipping, c = co2_clip)
        phi <- phi - lr m
        theta_i <- phi - (1 - lambda) P_i;   s_i <- theta_i      (staleness gap penalty lambda)

    P_i is still in flight (it reaches phi one round later), so keeping all of it locally
    would count it twice; lambda in [0, 1] (co2_staleness_penalty) is the share of this
    stale local progress dropped from the local model. The last step drains the pending
    all-reduce and sets theta_i = phi on every worker.
    """

    name = "co2"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = self.fragments[0].read()
        self.pending: tuple | None = None  # (work, buffer) or (None, finished buffer)
        self.last_norm = 0.0
        self.clipped = False

    def wait_pending(self) -> torch.Tensor | None:
        if self.pending is None:
            return None
        work, buf = self.pending
        self.pending = None
        if work is not None:
            work.wait()
            buf.div_(self.workers)
        return buf

    def outer_update(self, avg: torch.Tensor) -> None:
        mu, lr, c = self.lc.outer_momentum, self.lc.outer_lr, self.lc.co2_clip
        m = self.momentum[0]
        m.mul_(mu).add_(avg)
        sq = m.double().pow(2).sum()
        if self.norm_group is not None and _group_size(self.norm_group) > 1:
            comm.all_reduce(sq, self.norm_group, "dp")  # inside the worker: shards of one model
        norm = float(sq.sqrt())
        self.last_norm = norm
        self.clipped = c > 0 and norm > c
        if self.clipped:
            m.mul_(c / norm)
        self.phi[0].sub_(m, alpha=lr)
        self.outer_steps += 1

    def after_step(self, step: int) -> dict:
        last = step >= self.total_steps
        if step % self.H and not last:
            return {}
        view = self.fragments[0]
        theta = view.read()
        progress = self.start - theta
        previous = self.wait_pending()
        if previous is not None:
            self.outer_update(previous)
        buf = progress.clone()
        if self.workers > 1:
            work = self.all_reduce_mean(buf, async_op=True)
            self.pending = (work, buf)
        else:
            self.pending = (None, buf)
        if last:
            self.outer_update(self.wait_pending())
            view.write(self.phi[0])
        else:
            view.write(self.phi[0] - (1 - self.lc.co2_staleness_penalty) * progress)
        self.start = view.read()
        return {"outer_step": self.outer_steps, "outer_momentum_norm": self.last_norm,
                "outer_clipped": self.clipped}

    def finish_pending_for_checkpoint(self) -> None:
        if self.pending is not None and self.pending[0] is not None:
            self.pending = (None, self.wait_pending())

    def extra_state(self) -> dict:
        return {"start": self.start.clone(), "pending": None if self.pending is None else self.pending[1].clone()}

    def load_extra_state(self, sd: dict) -> None:
        self.start = sd["start"].clone()
        self.pending = None if sd["pending"] is None else (None, sd["pending"].clone())


METHODS = {"diloco": DiLoCo, "streaming": StreamingDiLoCo, "noloco": NoLoCo, "co2": CO2}


def build_outer(method: str, named_params, lc: LowCommConfig, group, total_steps: int, seed: int = 0,
                norm_group=None) -> OuterOptimizer:
    return METHODS[method](named_params, lc, group, total_steps, seed, norm_group)
