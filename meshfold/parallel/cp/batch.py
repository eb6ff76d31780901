"""Which tokens of each sequence a context-parallel rank holds (contiguous, or the causal
load-balanced chunks m and 2R-1-m), and the batch cut accordingly."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshfold.errors import ConfigError
from meshfold.parallel.cp.groups import ContextParallelPlan
from meshfold.parallel.facts.attention import ulysses_degree

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def token_indices(seq_len: int, cp: int, cp_rank: int, ulysses: int = 1, balance: bool = True) -> torch.Tensor:
    """The sequence positions cp rank ``cp_rank`` holds.

    cp rank = ring_member * ulysses + ulysses_rank. A ring member's share is either one
    contiguous block of seq_len/R or (balanced) chunks m and 2R-1-m of seq_len/(2R); the
    Ulysses ranks of that member split the share contiguously, so after the all-to-all
    each of them holds exactly its member's share."""
    ring = cp // ulysses
    member, sub = divmod(cp_rank, ulysses)
    pieces = 2 * ring if (balance and ring > 1) else ring
    need = pieces * ulysses  # every Ulysses rank gets an equal part of every piece's share
    if seq_len % need:
        raise ConfigError(
            f"sequence length {seq_len} is not divisible by {need} (parallel.cp = {cp}); "
            f"choose a model.seq_len that is a multiple of {need}"
        )
    if pieces == ring:
        share = torch.arange(member * seq_len // ring, (member + 1) * seq_len // ring)
    else:
        c = seq_len // pieces
        share = torch.cat([torch.arange(member * c, (member + 1) * c),
                           torch.arange((pieces - 1 - member) * c, (pieces - member) * c)])
    n = share.numel() // ulysses
    return share[sub * n: (sub + 1) * n]


def shard_batch(batch: dict[str, torch.Tensor], plan: ContextParallelPlan) -> dict[str, torch.Tensor]:
    """This cp rank's slice of every [batch, seq] tensor, plus the matching ``positions``."""
    inputs = batch["inputs"]
    bsz, seq = inputs.shape
    idx = token_indices(seq, plan.cp, plan.cp_rank, plan.ulysses, plan.balance).to(inputs.device)
    out = {k: (v[:, idx].contiguous() if v.dim() >= 2 and v.shape[1] == seq else v) for k, v in batch.items()}
    if "positions" not in batch:
        out["positions"] = idx.unsqueeze(0).expand(bsz, -1).contiguous()
    return out


def shard_for_context_parallel(batch: dict[str, torch.Tensor], cfg: Config, dims) -> dict[str, torch.Tensor]:
    """Trainer hook: the batch unchanged without cp, else this rank's sequence slice."""
    if dims.size("cp") == 1:
        return batch
    degree = ulysses_degree(cfg.parallel, cfg.model)
    plan = ContextParallelPlan(dims.size("cp"), degree, cfg.parallel.cp_balance, dims.rank("cp"), None, None, None)
    return shard_batch(batch, plan)


def default_members(plan: ContextParallelPlan, bsz: int, member_len: int) -> torch.Tensor:
    """What ``_MetaCache.get`` gathers for a batch with default positions and no document
    ids: [ring, 2 (positions, docs), bsz, member_len]."""
    seq = member_len * plan.ring
    pos = torch.stack([torch.cat([token_indices(seq, plan.cp, j * plan.ulysses + k, plan.ulysses, plan.balance)
                                  for k in range(plan.ulysses)]) for j in range(plan.ring)])
    pos = pos[:, None].expand(-1, bsz, -1)
    return torch.stack([pos, torch.zeros_like(pos)], 1).contiguous()
