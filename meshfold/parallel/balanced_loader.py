"""The data path of ``data.balance = greedy|exact``: whole documents per step, assigned to
data-parallel ranks and micro-batches by cost, fed as flat packed rows.

Per step (every rank computes the same thing from the seed, no communication except in
``exact`` mode, where global rank 0's MILP answer is broadcast because a solver's time
limit could make ranks disagree):

1. ``PieceBatchSampler`` takes the next document pieces of the seeded epoch order until
   the step's token budget (``train.global_batch * model.seq_len``) is reached. Every
   piece of an epoch is used exactly once (the last step of an epoch may be shorter);
   ``state_dict`` = (epoch, cursor) resumes exactly.
2. ``balance.plan_step`` assigns the pieces to the dp ranks (LPT, MILP refinement) and
   to the fixed number of micro-batches per rank (under ``data.max_tokens`` per
   micro-batch), and reports lambda before (naive token-equal split) and after.
3. This rank's micro-batches become ``[1, T_m]`` rows (``packing.packed_row``) with
   per-piece ``doc_ids`` and ``positions``; T_m differs between ranks and micro-batches.

Fixed for a run: the pieces (documents cut at ``model.seq_len``), the number of
micro-batches per rank, the token limit, the cost model (a, b). Dynamic per step: which
pieces a step holds and which rank/micro-batch each goes to.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.errors import ConfigError
from meshfold.data.balance import (DocumentCost, StepPlan, imbalance, loads_of, naive_split, plan_context_parallel,
                                   plan_step)
from meshfold.data.cost_calibration import cost_model_for
from meshfold.data.micro import micro_batch_count
from meshfold.data.packing import DocumentPieces, packed_row
from meshfold.models.varlen_attention import use_varlen_attention
from meshfold.parallel.cp.per_sequence import SpreadContext, build_groups, make_plan, spread_span


class PieceBatchSampler:
    """Seeded epochs of documents (expanded to their pieces, in order), cut into steps of
    at most ``tokens_per_step`` tokens (at least one piece each)."""

    def __init__(self, lengths: np.ndarray, doc_pieces: list[list[int]], tokens_per_step: int, seed: int):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.doc_pieces = doc_pieces
        self.tokens_per_step, self.seed = tokens_per_step, seed
        self.epoch, self.cursor = 0, 0
        self._order: np.ndarray | None = None
        self._cum: np.ndarray | None = None
        if len(self.lengths) == 0:
            raise ConfigError("the corpus has no document with two or more tokens; use a larger data.source")

    def order(self) -> np.ndarray:
        """The epoch's piece order: documents shuffled by (seed, epoch), pieces in order."""
        if self._order is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch + 7_777)
            docs = torch.randperm(len(self.doc_pieces), generator=gen).tolist()
            self._order = np.asarray([p for d in docs for p in self.doc_pieces[d]], dtype=np.int64)
            self._cum = np.cumsum(self.lengths[self._order])
        return self._order

    def next(self) -> np.ndarray:
        order = self.order()
        if self.cursor >= len(order):
            self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
            order = self.order()
        before = self._cum[self.cursor - 1] if self.cursor else 0
        stop = int(np.searchsorted(self._cum, before + self.tokens_per_step, side="right"))
        stop = max(stop, self.cursor + 1)
        out = order[self.cursor: stop]
        self.cursor = stop
        return out

    def state_dict(self) -> dict:
        return {"kind": "pieces", "epoch": self.epoch, "cursor": self.cursor, "n": len(self.lengths),
                "tokens_per_step": self.tokens_per_step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "pieces" or state.get("n") != len(self.lengths):
            raise ConfigError(
                "the checkpoint's data loader does not match this run (data.balance, data.source, model.seq_len "
                "or the tokenizer changed); resume with the same data settings"
            )
        if state.get("tokens_per_step") != self.tokens_per_step:
            raise ConfigError(
                f"the checkpoint took {state.get('tokens_per_step')} tokens per step, this run "
                f"{self.tokens_per_step}; resume with the same train.global_batch and model.seq_len"
            )
        self.epoch, self.cursor, self._order = int(state["epoch"]), int(state["cursor"]), None


class BalancedBatches:
    """Cost-balanced micro-batches for one data-parallel rank. A trainer feature
    (``train/feature.py``): it replaces the run's sampler, supplies the batches (cut into
    micro-batches by ``micro_sizes``, ``data/micro.py``) and reports the step's balance."""

    name = None  # no checkpoint state of its own: the sampler it installs is saved as the sampler

    def __init__(self, pieces: DocumentPieces, cost: DocumentCost, n_ranks: int, rank: int, n_micro: int,
                 micro_cap: int, tokens_per_step: int, seed: int, method: str = "greedy",
                 tolerance: float = 1.02, time_limit: float = 1.0, broadcast: bool = False,
                 seq_cp_max: int = 1, cp_groups: dict | None = None, device: torch.device | str = "cpu"):
        self.pieces, self.cost = pieces, cost
        # Per-sequence context parallel (parallel/cp/per_sequence.py): groups made once, plans per step.
        self.seq_cp_max, self.cp_groups, self.spread = seq_cp_max, cp_groups or {}, SpreadContext()
        self.n_ranks, self.rank, self.n_micro, self.micro_cap = n_ranks, rank, n_micro, micro_cap
        self.method, self.tolerance, self.time_limit = method, tolerance, time_limit
        self.broadcast = broadcast and dist.is_initialized() and dist.get_world_size() > 1
        self.device = torch.device(device)  # where the plan broadcast runs (NCCL: the GPU)
        self.sampler = PieceBatchSampler(pieces.lengths, pieces.doc_pieces, tokens_per_step, seed)
        self.last_plan: StepPlan | None = None

    def prepare_model(self, model) -> None:
        """Packed rows of whole documents: attention per document, cost sum l^2 (the meta
        model, before ``parallelize``)."""
        use_varlen_attention(model, self.spread)

    def plan(self, ids: np.ndarray) -> StepPlan:
        if self.seq_cp_max > 1 and self.method != "none":
            return self.plan_spread(ids)
        plan = plan_step(self.pieces.lengths[ids], self.cost, self.n_ranks, self.n_micro, self.micro_cap,
                         self.method, self.tolerance, self.time_limit)
        if self.broadcast:  # the exact solver stops at a time limit: rank 0's plan is the plan
            both = torch.from_numpy(np.stack([plan.rank, plan.micro])).to(self.device)
            comm.broadcast(both, 0, None, "data")
            both = both.cpu().numpy()  # the batch is assembled on the host from the plan
            plan.rank, plan.micro = both[0].copy(), both[1].copy()
        return plan

    def plan_spread(self, ids: np.ndarray) -> StepPlan:
        """One micro-batch per rank; documents over the token limit or above a fair share of
        W spread over a group (deterministic: every rank computes the same)."""
        lengths = self.pieces.lengths[ids]
        cp = plan_context_parallel(lengths, self.cost, self.n_ranks, rank_cap=self.micro_cap,
                                   max_degree=self.seq_cp_max)
        naive = naive_split(lengths, self.n_ranks)
        stats = {"imbalance_before": imbalance(loads_of(naive, self.cost(lengths), self.n_ranks)),
                 "imbalance": cp.imbalance,
                 "imbalance_tokens_before": imbalance(loads_of(naive, lengths, self.n_ranks)),
                 "imbalance_tokens": imbalance(cp.tokens),
                 "spread_docs": int((cp.degree > 1).sum()), "spread_max_degree": int(cp.degree.max(initial=1))}
        return StepPlan(cp.group_start, np.zeros(len(ids), dtype=np.int64), self.n_ranks, 1, stats, cp.degree)

    def next_ids(self) -> list[list[int]]:
        """Piece ids of this rank's micro-batches for the next step."""
        ids = self.sampler.next()
        plan = self.last_plan = self.plan(ids)
        self.last_tokens = int(self.pieces.lengths[ids].sum())
        self.next_ids_of_step = ids
        return [ids[plan.items(self.rank, m)].tolist() for m in range(self.n_micro)]

    def local_batch(self, device: torch.device | str = "cpu") -> dict:
        """Flat ``[1, sum T_m]`` tensors plus ``micro_sizes`` (T_m per micro-batch)."""
        rows = [packed_row(self.pieces, ids) for ids in self.next_ids()]
        if self.seq_cp_max > 1 and self.last_plan.degree is not None:
            rows[0] = self.with_spread(rows[0], self.next_ids_of_step, device)
        batch = {k: torch.cat([r[k] for r in rows], dim=1).to(device) for k in rows[0]}
        batch["micro_sizes"] = [r["inputs"].shape[1] for r in rows]
        return batch

    def with_spread(self, row: dict, ids: np.ndarray, device) -> dict:
        """Prepend this rank's shares of the step's spread documents (in item order, the
        order every group member shares) to its first micro-batch, and publish their ring
        plans to the attention modules."""
        self.spread.by_doc = {}
        parts = []
        for item, k, start in self.last_plan.spread_items(self.rank):
            piece = int(ids[item])
            span, meta = spread_span(self.pieces, piece, k, self.rank - start, self.pieces.corpus.pad_id)
            self.spread.by_doc[piece] = (make_plan(self.cp_groups[(k, start)], k, self.rank - start,
                                                   span["inputs"].shape[1]), meta.to(device))
            parts.append(span)
        if not parts:
            return row
        if bool((row["doc_ids"] == -1).all()):  # the row held only the filler token
            row = None
        parts += [row] if row is not None else []
        return {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}

    def wrap_sampler(self, sampler):
        """The run draws whole documents from this loader's piece sampler instead."""
        return self.sampler

    def after_step(self, step: int) -> dict:
        return self.step_metrics()

    def step_metrics(self) -> dict:
        """lambda of W and of tokens, before (naive split) and after balancing, and the
        step's token count (it varies: whole documents up to the budget)."""
        if self.last_plan is None:
            return {}
        return {**self.last_plan.stats, "step_tokens": self.last_tokens}


def from_config(cfg, dims, corpus, device: torch.device, param_dtype: torch.dtype) -> BalancedBatches:
    """The balanced loader of a run: its config, mesh (``dims``), training corpus, and the
    device and parameter dtype the cost model is measured for."""
    d, t, m = cfg.data, cfg.train, cfg.model
    dp = dims.size("dp")
    local = t.global_batch // dp
    micro = t.micro_batch or local
    n_micro = micro_batch_count(local, t.micro_batch)
    pieces = DocumentPieces(corpus, m.seq_len)
    cost = cost_model_for(cfg, device, param_dtype)
    groups = None
    if d.seq_cp_max > 1:  # config.validate checked it divides dp, one micro-batch per rank
        groups = build_groups(dims.group("dp") if dims.distributed else None, dp, d.seq_cp_max)
    return BalancedBatches(
        pieces, cost, n_ranks=dp, rank=dims.rank("dp"), n_micro=n_micro,
        micro_cap=d.max_tokens or 2 * micro * m.seq_len, tokens_per_step=t.global_batch * m.seq_len,
        seed=t.seed, method=d.balance, tolerance=d.balance_tolerance, time_limit=d.balance_time_limit_s,
        broadcast=d.balance == "exact", seq_cp_max=d.seq_cp_max, cp_groups=groups, device=device,
    )


def build_balance(cfg, parts) -> BalancedBatches | None:
    """The ``data.balance`` feature of a run (registered in ``train/registry.py``), or None."""
    if cfg.data.balance == "none":
        return None
    return from_config(cfg, parts.dims, parts.data.train.corpus, parts.device, parts.param_dtype)
