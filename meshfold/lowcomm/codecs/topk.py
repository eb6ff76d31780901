"""Top-k sparsification with error feedback, DGC's momentum correction and exponential
sparsity warm-up (Lin et al. 2018)."""

from __future__ import annotations

import torch

from meshfold import comm
from meshfold.lowcomm.codecs.base import Codec


class TopK(Codec):
    """Top-k sparsification with error feedback and DGC's momentum correction:

        u <- m u + g          (momentum correction; m = 0 gives plain error feedback)
        v <- v + u            (accumulate)
        S = top-k(|v|);  send v[S];  v[S] <- 0;  u[S] <- 0   (momentum factor masking)

    Warm-up (DGC): the kept fraction decays exponentially from 25% to ``ratio`` over
    ``warmup`` steps. Values (the gradient's dtype on the wire) and int32 indices are
    all-gathered on the gradient's device; each rank sums the n sparse vectors there."""

    def __init__(self, group, ratio: float, momentum: float = 0.0, warmup: int = 0):
        super().__init__(group)
        self.ratio, self.momentum, self.warmup = ratio, momentum, warmup

    @classmethod
    def from_config(cls, group, lc, seed: int = 0) -> TopK:
        return cls(group, lc.topk_ratio, lc.dgc_momentum, lc.dgc_warmup_steps)

    def current_ratio(self) -> float:
        if self.warmup <= 0 or self.step > self.warmup:
            return self.ratio
        start = 0.25
        frac = (self.step - 1) / max(1, self.warmup)
        return max(self.ratio, start * (self.ratio / start) ** frac)

    def reduce(self, named):
        ratio = self.current_ratio()
        for name, g in named:
            flat = g.view(-1)
            u = self._buf(name, "momentum", flat)
            v = self._buf(name, "error", flat)
            if self.momentum:
                u.mul_(self.momentum).add_(flat)
                v.add_(u)
            else:
                v.add_(flat)
            k = max(1, int(round(ratio * flat.numel())))
            idx = v.abs().topk(k, sorted=False).indices
            values = v[idx].clone()
            v[idx] = 0
            if self.momentum:
                u[idx] = 0
            flat.copy_(self._gather_sum(values, idx.to(torch.int32), flat.numel(), flat.dtype) / self.n)

    def _gather_sum(self, values, idx, numel, dtype) -> torch.Tensor:
        out = torch.zeros(numel, dtype=dtype, device=values.device)
        if self.n == 1:
            out[idx.long()] = values
            return out
        all_v = torch.empty(values.numel() * self.n, dtype=values.dtype, device=values.device)
        all_i = torch.empty(idx.numel() * self.n, dtype=idx.dtype, device=idx.device)
        comm.all_gather_into_tensor(all_v, values, self.group, "dp")
        comm.all_gather_into_tensor(all_i, idx, self.group, "dp")
        for v, i in zip(all_v.chunk(self.n), all_i.chunk(self.n)):  # rank order, as before
            out.index_add_(0, i.long(), v)
        return out

