"""ZeRO-1 under Muon with whole-parameter ownership (Megatron-Core's layer-wise
distributed optimizer): each data-parallel rank owns whole parameters (``ownership.py``'s
rule), keeps Muon momentum and AdamW moments only for those, orthogonalises and updates
them, and one all-gather of every rank's updated parameters (end to end, padded to the
largest rank's) hands every rank the new values. Flat segments (``optim/sharded.py``)
would cut matrices that Newton-Schulz needs whole.

Gradients arrive already averaged over the group (DDP or ``GradReducer``), as for AdamW's
ZeRO-1. With tensor parallel a parameter's owner is a data-parallel coordinate: the tp
ranks there own its pieces together and exchange them over tp as without ZeRO-1
(``exchange.py``). Expert stacks are owned over their own replica group (edp), the rest
over dp_shard x cp; a group of one rank owns everything."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.optim.muon.exchange import local_of
from meshfold.optim.muon.ownership import assign_owners, gather_segment


class WholeOwnership:
    """The parameters ``params`` replicated over ``group``: which this rank owns, and the
    all-gather that sends the owners' updated values to every rank of the group."""

    def __init__(self, params: list[torch.Tensor], muon: list[bool], group):
        self.params, self.group = params, group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.owners = assign_owners([p.numel() for p in params], muon, self.n)
        self.owned = {id(p) for p, r in zip(params, self.owners) if r == self.rank}
        locals_ = [local_of(p) for p in params]
        dtypes = {t.dtype for t in locals_}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO-1 under Muon gathers one parameter dtype, got {sorted(map(str, dtypes))}: "
                             "use one train.dtype for every parameter, or parallel.zero = 0")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.device = locals_[0].device if locals_ else torch.device("cpu")
        self.segment = gather_segment([t.numel() for t in locals_], self.owners, self.n)

    @torch.no_grad()
    def gather(self) -> None:
        """Every rank's updated parameters into every rank's (one all-gather, counted on dp)."""
        mine = torch.zeros(self.segment, dtype=self.dtype, device=self.device)
        offset = 0
        for p, r in zip(self.params, self.owners):
            if r == self.rank:
                t = local_of(p)
                mine[offset: offset + t.numel()].copy_(t.reshape(-1))
                offset += t.numel()
        flat = torch.empty(self.n * self.segment, dtype=self.dtype, device=self.device)
        comm.all_gather_into_tensor(flat, mine, self.group, "dp")
        offsets = [r * self.segment for r in range(self.n)]
        for p, r in zip(self.params, self.owners):
            if r != self.rank:
                t = local_of(p)
                t.copy_(flat[offsets[r]: offsets[r] + t.numel()].view_as(t))
            offsets[r] += local_of(p).numel()


class ZeroOneOwnership:
    """The ownership domains of one model (dense parameters over dp_shard x cp, expert
    stacks over edp): ``owns`` a parameter, ``gather`` them all after the update."""

    def __init__(self, domains: list[WholeOwnership]):
        self.domains = [d for d in domains if d.params and d.n > 1]
        self._kept = {id(p) for d in self.domains for p in d.params}
        self._owned = set().union(*(d.owned for d in self.domains))

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) not in self._kept or id(p) in self._owned

    def gather(self) -> None:
        for d in self.domains:
            d.gather()
