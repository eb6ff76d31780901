"""Owner-computes: every Muon matrix is orthogonalised by exactly one rank of the group
that shards it, per step (docs/optimizers.md, "Ownership").

A parameter is a stack of matrices (its last two dimensions; an expert weight [E, a, b]
is E of them). Mesh dimensions that shard only its stack dimension (experts over ep and
edp) leave whole matrices on the rank: they are orthogonalised there, no communication.
Mesh dimensions that shard the matrix dimensions (FSDP2 over dp_shard, tp, both at once)
form its exchange group (one flattened group for FSDP x tp); replicated dimensions (HSDP's
dp_replicate, DDP, ZeRO-1's dp) compute the same update side by side, exchanging nothing.

Matrices of one shape and placements in one group form a bucket; its i-th matrix is owned
by group rank i mod n. One uniform all-to-all brings every owner the pieces of its
matrices (padded to the largest piece: FSDP2's uneven shards), the owner assembles and
orthogonalises them as one batch, and a second all-to-all sends the pieces back. Every
group rank's piece box follows from its mesh coordinates (computed here at construction,
no communication), so the step needs no host sync."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshfold import comm
from meshfold.optim.muon.newton_schulz import orthogonalize
from meshfold.parallel.materialize import local_box

# The ledger's dimension for an exchange group, by its outermost mesh dimension.
LEDGER_DIM = {"dp_shard": "dp", "dp_shard_cp": "dp", "dp_replicate": "dp", "edp": "dp", "tp": "tp", "ep": "ep"}


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def matrix_mesh_dims(p: torch.Tensor) -> tuple[int, ...]:
    """The mesh dimensions of ``p`` that shard one of its two matrix dimensions."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(i for i, pl in enumerate(p.placements) if isinstance(pl, (Shard, _StridedShard)) and pl.dim >= p.ndim - 2)


def group_boxes(p: DTensor, dims: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """Every rank's piece box ``(row, col, rows, cols)`` of ``p``'s matrices in the exchange
    group over mesh dimensions ``dims``, in group-rank order (a flattened group's ranks run
    row-major over its dimensions)."""
    mesh = p.device_mesh
    mine = list(mesh.get_coordinate())
    out = []
    for r in range(math.prod(mesh.size(i) for i in dims)):
        coords = list(mine)
        for i in reversed(dims):
            r, coords[i] = divmod(r, mesh.size(i))
        lo, size = local_box(tuple(p.shape), p, coords)
        out.append((*lo[-2:], *size[-2:]))
    return out


class _Bucket:
    """Same-shape matrices exchanged over one group: entries (parameter index, matrix index
    in its stack), every group rank's piece box ``(row, col, rows, cols)``."""

    def __init__(self, group, dim: str, shape: tuple[int, int]):
        self.group, self.dim, self.shape = group, dim, shape
        self.entries: list[tuple[int, int]] = []
        self.boxes: list[tuple[int, int, int, int]] = []
        self.n = 1 if group is None else torch.distributed.get_world_size(group)
        self.rank = 0 if group is None else torch.distributed.get_rank(group)

    def owned(self) -> list[int]:
        """Indices of the entries this rank owns."""
        return list(range(self.rank, len(self.entries), self.n))


class OwnerPlan:
    """Which rank orthogonalises each local matrix of ``params`` (named ``names``), and the
    exchange that gets it there. ``orthogonalized`` counts, per matrix name
    (``<fqn>[j]``), how often this rank orthogonalised it; ``owned`` names those it owns."""

    def __init__(self, params: list[torch.Tensor], names: list[str], device: torch.device):
        self.params, self.names, self.device = params, names, device
        self.buckets: dict[tuple, _Bucket] = {}
        groups: dict[tuple, object] = {}
        for pi, p in enumerate(params):
            dims = matrix_mesh_dims(p)
            shape = tuple(p.shape[-2:])
            if dims:
                mesh = p.device_mesh
                names_ = tuple(mesh.mesh_dim_names[i] for i in dims)
                gkey = (id(mesh), names_)
                if gkey not in groups:
                    groups[gkey] = (mesh.get_group(dims[0]) if len(dims) == 1
                                    else mesh[names_]._flatten("muon_" + "_".join(names_)).get_group())
                key = (gkey, shape, str(p.placements))
                dim = LEDGER_DIM.get(names_[0], names_[0])
                boxes = group_boxes(p, dims)
            else:
                key, gkey, dim, boxes = (None, shape), None, None, [(0, 0, *shape)]
            bucket = self.buckets.get(key)
            if bucket is None:
                bucket = self.buckets[key] = _Bucket(groups.get(gkey), dim, shape)
                bucket.boxes = boxes
            for j in range(math.prod(local_of(p).shape[:-2])):
                bucket.entries.append((pi, j))
        self.owned = {self._name(b, i) for b in self.buckets.values() for i in b.owned()}
        self.orthogonalized: dict[str, int] = defaultdict(int)

    def _name(self, b: _Bucket, i: int) -> str:
        pi, j = b.entries[i]
        return f"{self.names[pi]}[{j}]"

    def orthogonalize(self, updates: list[torch.Tensor], steps: int, coefficients, dtype) -> list[torch.Tensor]:
        """The orthogonalised ``updates`` (local pieces, one per parameter, shaped like it)."""
        stacks = [u.reshape(-1, *u.shape[-2:]) for u in updates]
        outs = [torch.empty_like(s) for s in stacks]
        for b in self.buckets.values():
            run = self._local if b.group is None else self._exchange
            run(b, stacks, outs, lambda m: orthogonalize(m, steps, coefficients, dtype))
        return [o.view_as(u) for o, u in zip(outs, updates)]

    def _count(self, b: _Bucket, owned: list[int]) -> None:
        for i in owned:
            self.orthogonalized[self._name(b, i)] += 1

    def _local(self, b: _Bucket, stacks, outs, ns) -> None:
        result = ns(torch.stack([stacks[pi][j] for pi, j in b.entries]))
        for (pi, j), o in zip(b.entries, result):
            outs[pi][j] = o
        self._count(b, list(range(len(b.entries))))

    def _exchange(self, b: _Bucket, stacks, outs, ns) -> None:
        n, rows, cols = b.n, *b.shape
        batches = -(-len(b.entries) // n)
        piece = max(r * c for _, _, r, c in b.boxes)
        dtype = stacks[b.entries[0][0]].dtype
        my_r, my_c = b.boxes[b.rank][2:]
        send = torch.zeros(n, batches, piece, dtype=dtype, device=self.device)
        for i, (pi, j) in enumerate(b.entries):  # entry i goes to its owner i mod n
            t, owner = divmod(i, n)
            send[owner, t, : my_r * my_c] = stacks[pi][j].reshape(-1)
        got = torch.empty_like(send)
        comm.all_to_all_single(got, send, b.group, b.dim)
        owned = b.owned()
        full = torch.zeros(len(owned), rows, cols, dtype=dtype, device=self.device)
        for s, (r0, c0, r, c) in enumerate(b.boxes):
            full[:, r0: r0 + r, c0: c0 + c] = got[s, : len(owned), : r * c].view(-1, r, c)
        done = ns(full) if owned else full
        self._count(b, owned)
        back = torch.zeros_like(send)
        for s, (r0, c0, r, c) in enumerate(b.boxes):
            back[s, : len(owned), : r * c] = done[:, r0: r0 + r, c0: c0 + c].reshape(len(owned), r * c)
        comm.all_to_all_single(got, back, b.group, b.dim)
        for i, (pi, j) in enumerate(b.entries):
            t, owner = divmod(i, n)
            outs[pi][j] = got[owner, t, : my_r * my_c].view(my_r, my_c)
