"""``ParallelConfig`` -> one ``DeviceMesh`` with named dimensions.

Dimension order, outermost first: worker (low-communication outer dimension), pp,
dp_replicate, dp_shard, cp, tp. Ranks are laid out row-major, so tp neighbours are adjacent
ranks (same node) and the outer dimensions span nodes: the cheapest links carry the most
traffic. The planner assumes the same order.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshfold.layout import ParallelConfig

MESH_DIMS = ("worker", "pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    """Sizes of every mesh dimension, and (once built) the mesh with flattened views:
    ``dp`` (dp_replicate x dp_shard), ``dp_shard_cp`` (what FSDP shards over) and
    ``dp_cp`` (every rank that holds a different part of the batch)."""

    parallel: ParallelConfig
    workers: int = 1
    mesh: DeviceMesh | None = None
    flat: dict = field(default_factory=dict)

    def size(self, name: str) -> int:
        if name == "worker":
            return self.workers
        if name == "dp":
            return self.parallel.dp
        if name == "dp_cp":
            return self.parallel.dp * self.parallel.cp
        if name == "dp_shard_cp":
            return self.parallel.dp_shard * self.parallel.cp
        return getattr(self.parallel, name)

    @property
    def world_size(self) -> int:
        return self.workers * self.parallel.world_size()

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def __getitem__(self, name: str) -> DeviceMesh:
        assert self.mesh is not None, "no mesh in a one-process run"
        if isinstance(name, str) and name in self.flat:
            return self.flat[name]
        return self.mesh[name]

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: (dp_shard x cp), with dp_replicate as an HSDP
        replica dimension in front when it is > 1."""
        shard = "dp_shard" if self.parallel.cp == 1 else "dp_shard_cp"
        if self.parallel.dp_replicate == 1:
            return self[shard]
        if shard == "dp_shard":
            return self.mesh["dp_replicate", "dp_shard"]
        with warnings.catch_warnings():  # a 2-D slice holding a flattened dim: no other API yet
            warnings.simplefilter("ignore")
            return self.mesh["dp_replicate", shard]

    def rank(self, name: str) -> int:
        if self.mesh is None or self.size(name) == 1:
            return 0
        return self[name].get_local_rank()

    def group(self, name: str) -> dist.ProcessGroup | None:
        if self.mesh is None:
            return None
        return self[name].get_group()

    def enabled(self, name: str) -> bool:
        return self.size(name) > 1

    def rank_lists(self, name: str) -> list[list[int]]:
        """The ranks of every group along mesh dimension ``name`` (the other coordinates in
        row-major order), the same lists on every rank: for groups made with
        ``dist.new_group``, which every rank creates in the same order. Read off the mesh's
        rank table (a host tensor) once, then indexed in plain Python: a tensor op on the
        table would, under the dry-run's fake tensors, make a tensor without values."""
        assert self.mesh is not None, "no mesh in a one-process run"
        axis = self.mesh.mesh_dim_names.index(name)
        table, shape = self.mesh.mesh.tolist(), list(self.mesh.mesh.shape)

        out = []
        for rest in itertools.product(*(range(n) for j, n in enumerate(shape) if j != axis)):
            out.append([_entry(table, rest[:axis] + (i,) + rest[axis:]) for i in range(shape[axis])])
        return out


def _entry(table: list, index: tuple) -> int:
    for i in index:
        table = table[i]
    return table


def build_mesh(parallel: ParallelConfig, workers: int = 1, device_type: str = "cpu") -> ParallelDims:
    dims = ParallelDims(parallel, workers)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dims
    shape = tuple(dims.size(n) for n in MESH_DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    # Flattened views used by data parallel, FSDP and the loss reduction.
    dims.flat = {
        "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
        "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
        "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
    }
    dims.mesh = mesh
    return dims
