"""PowerSGD (Vogels et al. 2019): rank-r P Q^T with warm-started Q and error feedback;
the base of L-GreCo's per-layer ranks (``lgreco.py``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from meshfold.gpucheck import on_cuda
from meshfold.lowcomm.codecs.base import Codec, all_reduce_mean


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    # Gram-Schmidt via QR (reduced), deterministic on every rank for identical input.
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


class PowerSGD(Codec):
    """Rank-r PowerSGD with error feedback and warm start (one power iteration per step):

        M = G + E;  P = M Q;  P <- mean_ranks(P);  P <- orth(P);  Q = M^T P;
        Q <- mean_ranks(Q);  G_hat = P Q^T;  E <- M - G_hat

    Vectors (biases, norms) and matrices where r (n + m) >= n m go uncompressed, in the
    same all-reduce as every P of the call: two all-reduces per call whatever the number
    of matrices (one of the uncompressed tensors and all P, one of all Q).

    ``reduce_async`` (the DDP hook's path) on a GPU issues the call's collectives right
    there, on the thread running backward, in the order DDP calls the hook (the same bucket
    order on every rank, interleaved with backward's own collectives, e.g. ring attention's,
    in graph order): NCCL runs collectives of different communicators in the order each rank
    issued them, so a second issuing thread could order them differently on two ranks and
    deadlock. Its waits between the P and Q all-reduces are stream waits there, so backward
    is not held up on the host. On the host (gloo), where a wait blocks, the call runs on one
    communication thread and returns at once, so the exchange overlaps the rest of backward;
    one thread per codec keeps every rank's collectives in hook order (a ``then`` callback
    would issue the Q all-reduce from whichever thread completed the P all-reduce)."""

    def __init__(self, group, rank: int, seed: int = 0):
        super().__init__(group)
        self.rank = rank
        self.seed = seed
        self.ranks: dict[str, int] = {}  # per-layer rank override (L-GreCo)
        self._thread: ThreadPoolExecutor | None = None
        self._inflight: list = []

    @classmethod
    def from_config(cls, group, lc, seed: int = 0) -> PowerSGD:
        return cls(group, lc.powersgd_rank, seed)

    def rank_of(self, name: str, shape) -> int:
        return self.ranks.get(name, self.rank)

    def compressible(self, t: torch.Tensor, r: int) -> bool:
        if t.ndim < 2 or r <= 0:
            return False
        n, m = as_matrix(t).shape
        return r * (n + m) < n * m

    def reduce_async(self, named) -> torch.futures.Future:
        if self.n == 1 or (named and on_cuda(named[0][1])):
            return super().reduce_async(named)
        if self._thread is None:
            device = named[0][1].device if named else None
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="meshfold-powersgd",
                                              initializer=_bind_device, initargs=(device,))
        fut: torch.futures.Future = torch.futures.Future()

        def run():
            try:
                self.reduce(named)
                fut.set_result(None)
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(err)

        self._inflight = [f for f in self._inflight if not f.done()] + [self._thread.submit(run)]
        return fut

    def wait(self) -> None:
        for f in self._inflight:
            f.result()
        self._inflight = []

    def reduce(self, named):
        if not named:
            return
        dense, mats = [], []
        for name, g in named:
            r = self.rank_of(name, g.shape)
            (mats if self.compressible(g, r) else dense).append((name, g, r))
        work = [self._power_begin(name, g, r) for name, g, r in mats]
        # All uncompressed tensors and every P: one all-reduce.
        flat = torch.cat([g.reshape(-1) for _, g, _ in dense] + [w["p"].reshape(-1) for w in work])
        if flat.numel():
            all_reduce_mean(flat, self.group)
        parts = flat.split([g.numel() for _, g, _ in dense] + [w["p"].numel() for w in work])
        for (_, g, _), part in zip(dense, parts):
            g.copy_(part.view_as(g))
        for w, part in zip(work, parts[len(dense):]):
            w["p"] = orthogonalize(part.view_as(w["p"]))
            w["q"] = w["m"].t() @ w["p"]
        if not work:
            return
        # Every Q: one all-reduce.
        qflat = torch.cat([w["q"].reshape(-1) for w in work])
        all_reduce_mean(qflat, self.group)
        for w, q in zip(work, qflat.split([w["q"].numel() for w in work])):
            self._power_end(w, q.view_as(w["q"]))

    def _power_begin(self, name: str, g: torch.Tensor, r: int) -> dict:
        mat = as_matrix(g)
        m = mat.shape[1]
        err = self._buf(name, "error", mat)
        comp = mat + err
        slot = self.state.setdefault(name, {})
        q = slot.get("q")
        if q is None or q.shape != (m, r):
            # Drawn on the host once (the same on every device), then moved.
            gen = torch.Generator(device="cpu").manual_seed(self.seed * 7919 + (hash_name(name) % 100003))
            q = torch.randn(m, r, generator=gen, dtype=torch.float64, device="cpu")
            q = orthogonalize(q.to(device=mat.device, dtype=mat.dtype))
        return {"name": name, "mat": mat, "m": comp, "p": comp @ q}

    def _power_end(self, w: dict, q: torch.Tensor) -> None:
        approx = w["p"] @ q.t()
        slot = self.state[w["name"]]
        slot["q"] = q.clone()
        slot["error"] = w["m"] - approx
        w["mat"].copy_(approx)


def _bind_device(device) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def hash_name(name: str) -> int:
    """A process-independent hash (Python's str hash is salted per process)."""
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % (2 ** 31 - 1)
    return h

