"""Cost-aware assignment of variable-length documents to data-parallel ranks.

Attention costs grow with the square of a document's length and everything else linearly,
so equal tokens per rank is not equal work. Each document (piece) ``i`` of ``l_i`` tokens
costs

    W(l) = a * l**2 + b * l                 (a, b measured: ``cost_calibration.py``)

and a rank's load is the sum of its documents' W. Ranks synchronise at the gradient
reduction, so the step takes as long as the most loaded rank; the figure of merit is the
imbalance  lambda = max_r W_r / mean_r W_r  (1.0 is perfect).

* ``greedy_lpt``: longest processing time first: documents by decreasing W, each to the
  least loaded rank whose token limit (memory) still fits it. Within 4/3 of optimal.
* ``solve_exact``: the MILP  min z  s.t. each document on one rank, sum_i W_i x_ir <= z,
  sum_i l_i x_ir <= cap_r,  x binary  (scipy / HiGHS). Its answer is kept only when it
  beats the greedy one, so it is never worse.
* ``plan_step``: one step: documents -> ranks (greedy, refined exactly when the greedy
  imbalance is above a tolerance) -> micro-batches within each rank (greedy, token cap per
  micro-batch), plus lambda of W and of tokens for the naive token-equal split and for
  the plan.
* ``plan_context_parallel``: per-sequence context parallel: documents too long for one
  rank's memory, or costlier than a rank's fair share, are spread over an aligned group of
  ``k`` ranks (k a power of two, the smallest that fits); the rest stay whole on one rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np


class BalanceError(ValueError):
    pass


@dataclass(frozen=True)
class DocumentCost:
    """W(l) = a l^2 + b l, in seconds (or any unit) per document of l tokens."""

    a: float
    b: float

    def __call__(self, lengths) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.a * lengths * lengths + self.b * lengths


def imbalance(loads) -> float:
    """max / mean (1.0 when every load is equal, or all are zero)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean() if len(loads) else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def loads_of(assignment, values, n_bins: int) -> np.ndarray:
    return np.bincount(np.asarray(assignment, dtype=np.int64), weights=np.asarray(values, dtype=np.float64),
                       minlength=n_bins)


def _caps(cap, n_bins: int) -> np.ndarray:
    if cap is None:
        return np.full(n_bins, np.inf)
    caps = np.broadcast_to(np.asarray(cap, dtype=np.float64), (n_bins,)).copy()
    return caps


def greedy_lpt(weights, tokens, n_bins: int, cap=None, load: np.ndarray | None = None,
               used: np.ndarray | None = None) -> np.ndarray:
    """Bin (rank) of every item: items by decreasing weight (ties: index), each to the
    least loaded bin (ties: lowest index) whose token cap still fits it. ``load``/``used``
    give bins a head start (updated in place), e.g. the share of documents spread over them."""
    weights = np.asarray(weights, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    caps = _caps(cap, n_bins)
    load = np.zeros(n_bins) if load is None else load
    used = np.zeros(n_bins) if used is None else used
    out = np.empty(len(weights), dtype=np.int64)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], -tokens[i], i)):
        fits = used + tokens[i] <= caps
        if not fits.any():
            raise BalanceError(f"an item of {int(tokens[i])} tokens fits no rank (token limits {caps.tolist()}, "
                               f"used {used.tolist()}); raise data.max_tokens or lower train.global_batch")
        b = int(np.argmin(np.where(fits, load, np.inf)))
        out[i] = b
        load[b] += weights[i]
        used[b] += tokens[i]
    return out


def solve_exact(weights, tokens, n_bins: int, cap=None, time_limit: float = 1.0, node_limit: int = 5000,
                mip_rel_gap: float = 1e-6, start: np.ndarray | None = None) -> np.ndarray:
    """Minimise the largest bin load exactly (MILP, HiGHS), within the limits. Returns the
    MILP's assignment when it beats ``start`` (default: greedy LPT), else ``start``."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix, vstack

    weights = np.asarray(weights, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    n = len(weights)
    if start is None:
        start = greedy_lpt(weights, tokens, n_bins, cap)
    if n == 0 or n_bins == 1:
        return start
    start_max = loads_of(start, weights, n_bins).max()
    scale = weights.mean() if weights.mean() > 0 else 1.0
    w = weights / scale
    caps = _caps(cap, n_bins)
    nv = n * n_bins + 1  # x[i, r] at i * n_bins + r, then z
    rows = np.arange(n).repeat(n_bins)
    cols = np.arange(n * n_bins)
    one_each = coo_matrix((np.ones(n * n_bins), (rows, cols)), shape=(n, nv))
    bin_rows = np.tile(np.arange(n_bins), n)
    load = coo_matrix((np.repeat(w, n_bins), (bin_rows, cols)), shape=(n_bins, nv)).tolil()
    load[:, nv - 1] = -1.0
    mats = [one_each, load.tocoo()]
    lo = [np.ones(n), np.full(n_bins, -np.inf)]
    hi = [np.ones(n), np.zeros(n_bins)]
    if np.isfinite(caps).any():
        mats.append(coo_matrix((np.repeat(tokens, n_bins), (bin_rows, cols)), shape=(n_bins, nv)))
        lo.append(np.full(n_bins, -np.inf))
        hi.append(np.where(np.isfinite(caps), caps, 1e300))
    constraints = LinearConstraint(vstack(mats).tocsr(), np.concatenate(lo), np.concatenate(hi))
    c = np.zeros(nv)
    c[-1] = 1.0
    lower, upper = np.zeros(nv), np.ones(nv)
    upper[-1] = np.inf
    # Bins are interchangeable: pin the heaviest item to bin 0 (when every cap is equal).
    if np.all(caps == caps[0]):
        first = int(np.argmax(weights))
        lower[first * n_bins] = 1.0
    integrality = np.ones(nv)
    integrality[-1] = 0
    res = milp(c, constraints=constraints, integrality=integrality, bounds=Bounds(lower, upper),
               options={"time_limit": time_limit, "node_limit": node_limit, "mip_rel_gap": mip_rel_gap,
                        "disp": False})
    if res.x is None:
        return start
    x = res.x[:-1].reshape(n, n_bins)
    got = np.argmax(x, axis=1).astype(np.int64)
    ok_caps = np.all(loads_of(got, tokens, n_bins) <= caps + 1e-9)
    if ok_caps and loads_of(got, weights, n_bins).max() < start_max * (1 - 1e-12):
        return got
    return start


def naive_split(tokens, n_bins: int) -> np.ndarray:
    """The cost-blind baseline: items kept in order, cut into ``n_bins`` contiguous runs
    of about equal tokens (cut where the running total crosses k * total / n_bins)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.int64)
    mids = np.cumsum(tokens) - tokens / 2  # each item goes where its middle falls
    return np.minimum((mids * n_bins / tokens.sum()).astype(np.int64), n_bins - 1)


# --------------------------------------------------------------------------- one step


@dataclass
class StepPlan:
    """Where every item of a step goes: ``rank[i]`` and ``micro[i]``; loads per rank."""

    rank: np.ndarray
    micro: np.ndarray
    n_ranks: int
    n_micro: int
    stats: dict = field(default_factory=dict)
    degree: np.ndarray | None = None  # per-sequence cp: item i spans ranks [rank, rank + degree)

    def items(self, rank: int, micro: int) -> list[int]:
        """Whole items on (rank, micro), in their step order."""
        mask = (self.rank == rank) & (self.micro == micro)
        if self.degree is not None:
            mask &= self.degree == 1
        return np.flatnonzero(mask).tolist()

    def spread_items(self, rank: int) -> list[tuple[int, int, int]]:
        """(item, degree, group start) of the spread items ``rank`` holds a share of."""
        if self.degree is None:
            return []
        mask = (self.degree > 1) & (self.rank <= rank) & (rank < self.rank + self.degree)
        return [(int(i), int(self.degree[i]), int(self.rank[i])) for i in np.flatnonzero(mask)]


def rank_token_cap(micro_cap: int, n_micro: int, longest: int) -> int:
    """Tokens a rank may take so that any-fit always splits them into ``n_micro``
    micro-batches of at most ``micro_cap`` tokens: if an item of <= ``longest`` tokens
    fitted no micro-batch, each would hold more than ``micro_cap - longest``."""
    return n_micro * (micro_cap - longest) + longest


def plan_step(lengths, cost: DocumentCost, n_ranks: int, n_micro: int = 1, micro_cap: int | None = None,
              method: str = "greedy", tolerance: float = 1.02, time_limit: float = 1.0) -> StepPlan:
    """Assign a step's items (of ``lengths`` tokens) to ranks and micro-batches.

    ``method``: ``none`` (the naive token-equal split, micro-batches in order),
    ``greedy`` (LPT) or ``exact`` (LPT, then the MILP when LPT's imbalance > tolerance)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    w = cost(lengths)
    naive = naive_split(lengths, n_ranks)
    if micro_cap is not None and len(lengths) and lengths.max() > micro_cap:
        raise BalanceError(f"an item of {int(lengths.max())} tokens exceeds the {micro_cap}-token micro-batch "
                           f"limit; raise data.max_tokens to at least model.seq_len")
    if method == "none":
        rank = naive
    else:
        cap = None
        if micro_cap is not None and len(lengths):
            cap = rank_token_cap(micro_cap, n_micro, int(lengths.max()))
        rank = greedy_lpt(w, lengths, n_ranks, cap)
        # LPT is a heuristic: keep the naive split when it happens to be better and fits.
        if (loads_of(naive, w, n_ranks).max() < loads_of(rank, w, n_ranks).max()
                and (cap is None or loads_of(naive, lengths, n_ranks).max() <= cap)):
            rank = naive
        if method == "exact" and imbalance(loads_of(rank, w, n_ranks)) > tolerance:
            rank = solve_exact(w, lengths, n_ranks, cap, time_limit=time_limit, start=rank)
    micro = np.zeros(len(lengths), dtype=np.int64)
    for r in range(n_ranks):
        mine = np.flatnonzero(rank == r)
        if n_micro > 1 and len(mine):
            if method == "none":  # in order, about equal tokens
                micro[mine] = naive_split(lengths[mine], n_micro)
            else:
                micro[mine] = greedy_lpt(w[mine], lengths[mine], n_micro, micro_cap)
    stats = {
        "imbalance_before": imbalance(loads_of(naive, w, n_ranks)),
        "imbalance": imbalance(loads_of(rank, w, n_ranks)),
        "imbalance_tokens_before": imbalance(loads_of(naive, lengths, n_ranks)),
        "imbalance_tokens": imbalance(loads_of(rank, lengths, n_ranks)),
    }
    return StepPlan(rank, micro, n_ranks, n_micro, stats)


# --------------------------------------------------------------------------- per-sequence context parallel


@dataclass
class CPPlan:
    """``group_start[i]`` and ``degree[i]``: item i runs on ranks
    [group_start, group_start + degree) (degree 1: one rank, whole). ``loads`` and
    ``tokens`` per rank count 1/degree of a spread item on each rank of its group."""

    group_start: np.ndarray
    degree: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray

    @property
    def imbalance(self) -> float:
        return imbalance(self.loads)


def plan_context_parallel(lengths, cost: DocumentCost, n_ranks: int, rank_cap: int, max_degree: int = 0,
                          share: float = 1.0, tolerance: float | None = 1.02) -> CPPlan:
    """Per-sequence context-parallel degree, then balance.

    An item gets degree k = the smallest power of two (<= ``max_degree``, default
    ``n_ranks``) with ``l/k <= rank_cap`` (memory) and ``W/k <= share * mean load``
    (it would otherwise dominate the step). Spread items go first, longest first, each to
    the aligned group of k ranks whose most loaded member is least loaded (the ring
    splits W evenly over its members); the rest are placed by LPT under the token caps.
    Then, while the imbalance is above ``tolerance`` (None: skip), the heaviest item whose
    degree can still double is tried at twice the degree, kept only if lambda drops
    (few large documents per step leave LPT too coarse a granularity)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    w = cost(lengths)
    n = len(lengths)
    max_degree = max_degree or n_ranks
    if n_ranks & (n_ranks - 1) or max_degree & (max_degree - 1):
        raise BalanceError(f"per-sequence context parallel needs power-of-two rank counts, got {n_ranks} ranks "
                           f"and max degree {max_degree}")
    target = w.sum() / n_ranks * share
    degree = np.ones(n, dtype=np.int64)
    for i in range(n):
        k = 1
        while k < max_degree and (lengths[i] / k > rank_cap or w[i] / k > target):
            k *= 2
        if lengths[i] / k > rank_cap:
            raise BalanceError(f"a document of {int(lengths[i])} tokens exceeds {rank_cap} tokens per rank even "
                               f"spread over {k} ranks; raise data.max_tokens or the context-parallel degree")
        degree[i] = k
    plan = _place_with_degrees(lengths, w, degree, n_ranks, rank_cap)
    if tolerance is None:
        return plan
    for i in sorted(range(n), key=lambda i: (-w[i], i)):
        if plan.imbalance <= tolerance:
            break
        while plan.degree[i] < max_degree:
            trial = plan.degree.copy()
            trial[i] *= 2
            try:
                better = _place_with_degrees(lengths, w, trial, n_ranks, rank_cap)
            except BalanceError:
                break
            if better.imbalance >= plan.imbalance * (1 - 1e-9):
                break
            plan = better
    return plan


def _place_with_degrees(lengths, w, degree, n_ranks: int, rank_cap: int) -> CPPlan:
    """Place items of given degrees: spread ones on aligned groups, then LPT for the rest."""
    n = len(lengths)
    loads = np.zeros(n_ranks)
    used = np.zeros(n_ranks)
    start = np.zeros(n, dtype=np.int64)
    spread = [i for i in sorted(range(n), key=lambda i: (-w[i], i)) if degree[i] > 1]
    for i in spread:
        k = int(degree[i])
        best, best_key = None, None
        for g in range(0, n_ranks, k):
            grp = slice(g, g + k)
            if np.any(used[grp] + lengths[i] / k > rank_cap):
                continue
            key = (loads[grp].max() + w[i] / k, g)
            if best_key is None or key < best_key:
                best, best_key = g, key
        if best is None:
            raise BalanceError(f"no group of {k} ranks has room for a {int(lengths[i])}-token document; "
                               f"raise data.max_tokens")
        start[i] = best
        loads[best: best + k] += w[i] / k
        used[best: best + k] += lengths[i] / k
    whole = np.flatnonzero(degree == 1)
    if len(whole):  # LPT with the spread items' loads already in place
        start[whole] = greedy_lpt(np.asarray(w)[whole], np.asarray(lengths)[whole], n_ranks, rank_cap,
                                  load=loads, used=used)
    return CPPlan(start, degree, loads, used)


# --------------------------------------------------------------------------- reference for tests


def brute_force(weights, tokens, n_bins: int, cap=None) -> tuple[float, np.ndarray]:
    """The optimal largest load by trying every assignment (tiny cases only)."""
    weights = np.asarray(weights, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    caps = _caps(cap, n_bins)
    best, best_a = np.inf, None
    for a in itertools.product(range(n_bins), repeat=len(weights)):
        a = np.asarray(a)
        if np.any(loads_of(a, tokens, n_bins) > caps):
            continue
        m = loads_of(a, weights, n_bins).max()
        if m < best:
            best, best_a = m, a
    return best, best_a
