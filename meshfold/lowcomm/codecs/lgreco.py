"""L-GreCo (Markov et al. 2024): PowerSGD with a rank per layer chosen by a knapsack
dynamic program under an error budget."""

from __future__ import annotations

import math

import torch

from meshfold.lowcomm.codecs.base import all_reduce_mean, work_dtype
from meshfold.lowcomm.codecs.powersgd import PowerSGD, as_matrix, orthogonalize


class LGreCo(PowerSGD):
    """PowerSGD whose rank is chosen per layer by L-GreCo's dynamic program.

    Every ``every`` steps (and at the first step; never in between) each rank estimates,
    for each matrix l and candidate rank r in {1, 2, 4, .., 2 * default} plus
    "uncompressed", the error of the best rank-r approximation of its compensated
    gradient, e(l, r) = ||M||^2 - sum_{i<=r} sigma_i^2, and the size s(l, r) = r (n_l + m_l)
    elements. The top singular values come from a seeded randomized range finder on the
    gradient's device in its precision (exact when min(n, m) is small enough for a plain
    SVD). The error table is averaged over the group in one all-reduce (so every rank
    solves the same problem) and read to the host once; then

        minimise sum_l s(l, r_l)  subject to  sum_l e(l, r_l) <= budget * sum_l ||M_l||^2

    is solved by a knapsack DP over the error axis discretised into ``bins`` steps (errors
    rounded *up*, so the budget always holds)."""

    def __init__(self, group, default_rank: int, budget: float, every: int = 50, bins: int = 200, seed: int = 0):
        super().__init__(group, default_rank, seed)
        self.budget, self.every, self.bins = budget, every, bins
        self.candidates = sorted({1, 2, 4, 8, 16, 32, 2 * default_rank} - {0})
        self.candidates = [r for r in self.candidates if r <= max(1, 2 * default_rank)]

    @classmethod
    def from_config(cls, group, lc, seed: int = 0) -> LGreCo:
        return cls(group, lc.powersgd_rank, lc.lgreco_error_budget, lc.lgreco_every, seed=seed)

    def reduce(self, named):
        if (self.step - 1) % self.every == 0:
            self.choose_ranks(named)
        super().reduce(named)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "ranks": dict(self.ranks)}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.ranks = dict(sd.get("ranks", {}))

    def _top_sigma2(self, mat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(squared top-k singular values, padded with zeros to k; ||mat||_F^2), on device."""
        energy = mat.pow(2).sum()
        n, m = mat.shape
        if min(n, m) <= 4 * k:
            s2 = torch.linalg.svdvals(mat) ** 2
        else:  # randomized range finder with two power iterations (Halko et al. 2011)
            gen = torch.Generator(device=mat.device).manual_seed(self.seed * 104729 + self.step)
            omega = torch.randn(m, k + 8, generator=gen, dtype=mat.dtype, device=mat.device)
            basis = orthogonalize(mat @ omega)
            for _ in range(2):
                basis = orthogonalize(mat @ orthogonalize(mat.t() @ basis))
            s2 = torch.linalg.svdvals(basis.t() @ mat) ** 2
        out = torch.zeros(k, dtype=mat.dtype, device=mat.device)
        out[:min(k, s2.numel())] = s2[:k]
        return out, energy

    def choose_ranks(self, named) -> None:
        mats = [(name, g) for name, g in named if g.ndim >= 2]
        if not mats:
            return
        kmax = max(self.candidates)
        sizes, rows = [], []  # per layer: the options' (rank or -1 = dense, size); error row
        for name, g in mats:
            err = self.state.get(name, {}).get("error")
            mat = as_matrix(g).to(work_dtype(g.dtype))
            if err is not None:
                mat = mat + err
            n, m = mat.shape
            s2, energy = self._top_sigma2(mat, kmax)
            kept = torch.cumsum(s2, 0)
            opts = [(r, r * (n + m)) for r in self.candidates if r * (n + m) < n * m]
            idx = torch.tensor([r - 1 for r, _ in opts], dtype=torch.long, device=mat.device)
            row = torch.cat([(energy - kept[idx]).clamp(min=0), torch.zeros(1, dtype=mat.dtype, device=mat.device),
                             energy.reshape(1)])
            sizes.append(opts + [(-1, n * m)])
            rows.append(row)
        width = max(r.numel() for r in rows)
        table = torch.zeros(len(rows), width, dtype=rows[0].dtype, device=rows[0].device)
        for i, row in enumerate(rows):
            table[i, :row.numel()] = row
        all_reduce_mean(table, self.group)
        host = table.cpu().tolist()  # one small read every ``every`` steps
        limit = self.budget * sum(host[i][len(opts)] for i, opts in enumerate(sizes))
        choice = knapsack_min_size([[s for _, s in opts] for opts in sizes],
                                   [host[i][:len(opts)] for i, opts in enumerate(sizes)], limit, self.bins)
        for (name, _), opts, c in zip(mats, sizes, choice):
            r = opts[c][0]
            self.ranks[name] = 0 if r == -1 else r  # 0: not compressible -> dense all-reduce


def knapsack_min_size(sizes: list[list[int]], errors: list[list[float]], limit: float, bins: int) -> list[int]:
    """Pick one option per layer minimising total size with total error <= ``limit``.
    Errors are discretised up to multiples of limit / bins; each layer must offer a
    zero-error option (dense), so a solution always exists."""
    unit = limit / bins if limit > 0 else 0.0
    inf = float("inf")
    best = [0.0] + [inf] * bins  # best[b]: min size with discretised error exactly b
    picks: list[list[list[int]]] = []
    for lsizes, lerrs in zip(sizes, errors):
        new = [inf] * (bins + 1)
        arg = [-1] * (bins + 1)
        for o, (s, e) in enumerate(zip(lsizes, lerrs)):
            cost = 0 if e <= 0 else (math.ceil(e / unit) if unit > 0 else bins + 1)
            if cost > bins:
                continue
            for b in range(bins + 1 - cost):
                if best[b] + s < new[b + cost]:
                    new[b + cost] = best[b] + s
                    arg[b + cost] = o
        picks.append([arg, best])
        best = new
    # Backtrack from the cheapest reachable error level.
    b = min(range(bins + 1), key=lambda i: best[i])
    choice = []
    for (arg, prev), lsizes, lerrs in zip(reversed(picks), reversed(sizes), reversed(errors)):
        o = arg[b]
        choice.append(o)
        e = lerrs[o]
        b -= 0 if e <= 0 else math.ceil(e / unit)
    return list(reversed(choice))

