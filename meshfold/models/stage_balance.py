"""Split the layers into pipeline stages balanced by compute cost, not by layer count.

A stage's cost is the forward FLOPs per token of what it holds (backward is a fixed
multiple of it, so balancing forward balances both):

    transformer block i : 2 * (attention + feed-forward matmul params of block i)
                          + 2 * s * n_heads * head_dim             (causal attention, half of 4 s d)
    input embedding     : 2 * dim                                  (a gather: memory, not math)
    output layer + loss : 2 * dim * vocab + 5 * vocab              (projection, softmax, cross-entropy)

The output layer of a large-vocabulary model costs several blocks (Llama-3 8B: 128k x 4096,
about 2.3 blocks), so the last stage should hold fewer blocks; see "Balancing Pipeline
Parallelism with Vocabulary Parallelism" (Yeung et al. 2024). The split is contiguous
(stage k holds the next ``split[k]`` blocks) and minimises the most expensive stage,
found exactly by dynamic programming; ties go to the split with the smaller spread.

Pure Python (no torch): the runtime (``parallel/pp/stage_modules.py``) and the planner
(``planner/pipeline.py``) both take their split from ``stage_split_of``, so the stage the
planner prices is the stage the runtime builds.
"""

from __future__ import annotations

from meshfold.models.config import ModelConfig
from meshfold.models.counts import attention_params, ffn_params


def block_cost(cfg: ModelConfig, layer: int, seq_len: int | None = None) -> float:
    s = seq_len or cfg.seq_len
    matmul = attention_params(cfg) + ffn_params(cfg, layer, active=True)
    return 2.0 * matmul + 2.0 * s * cfg.n_heads * cfg.head_dim


def embedding_cost(cfg: ModelConfig) -> float:
    return 2.0 * cfg.dim


def output_cost(cfg: ModelConfig) -> float:
    return 2.0 * cfg.dim * cfg.vocab_size + 5.0 * cfg.vocab_size


def stage_costs(cfg: ModelConfig, split: list[int], seq_len: int | None = None) -> list[float]:
    """Forward FLOPs per token of every stage for a given split (blocks per stage)."""
    costs, first = [], 0
    for k, n in enumerate(split):
        c = sum(block_cost(cfg, i, seq_len) for i in range(first, first + n))
        if k == 0:
            c += embedding_cost(cfg)
        if k == len(split) - 1:
            c += output_cost(cfg)
        costs.append(c)
        first += n
    return costs


def balanced_split(cfg: ModelConfig, n_stages: int, seq_len: int | None = None) -> list[int]:
    """Blocks per stage (each >= 1) minimising the largest stage cost."""
    L = cfg.n_layers
    if not 1 <= n_stages <= L:
        raise ValueError(f"cannot split {L} layers into {n_stages} stages")
    blocks = [block_cost(cfg, i, seq_len) for i in range(L)]
    prefix = [0.0]
    for b in blocks:
        prefix.append(prefix[-1] + b)

    first_extra, last_extra = embedding_cost(cfg), output_cost(cfg)
    last = n_stages - 1
    # best[(k, lo)]: stages k.. over blocks lo..L as (max cost, sum of squares) of the best
    # split and its first stage's end. Among options tied on both, the smallest end (the
    # lexicographically smallest split: options differ in their first stage).
    best: dict[tuple[int, int], tuple[float, float, int]] = {}

    def solve(k: int, lo: int) -> tuple[float, float, int]:
        hit = best.get((k, lo))
        if hit is not None:
            return hit
        extra = first_extra if k == 0 else 0.0
        if k == last:
            c = prefix[L] - prefix[lo] + extra + last_extra
            hit = best[(k, lo)] = (c, c * c, L)
            return hit
        top, sq, end = float("inf"), 0.0, lo + 1
        start = prefix[lo]
        # once this stage alone costs more than the best option's max, every longer stage
        # does too (the planner asks for every count)
        for hi in range(lo + 1, L - (last - k) + 1):
            c = prefix[hi] - start + extra
            if c > top:
                break
            rest_max, rest_sq, _ = solve(k + 1, hi)
            m, q = (c if c > rest_max else rest_max), c * c + rest_sq
            if m < top or (m == top and q < sq):  # (ties keep the earlier, smaller end)
                top, sq, end = m, q, hi
        hit = best[(k, lo)] = (top, sq, end)
        return hit

    split, lo = [], 0
    for k in range(n_stages):
        hi = solve(k, lo)[2]
        split.append(hi - lo)
        lo = hi
    return split


def stage_split_of(cfg: ModelConfig, n_stages: int, pp_split=()) -> tuple[list[int], str]:
    """Blocks per stage and where they come from: ``pp_split`` (``parallel.pp_split``,
    checked by the config's validation) if given, else the cost-balanced split."""
    if pp_split:
        return list(pp_split), "parallel.pp_split"
    return balanced_split(cfg, n_stages), "balanced by cost"


def describe_split(cfg: ModelConfig, split: list[int], stage_rank: list[int], source: str) -> str:
    """One line per stage, for printing at start-up."""
    costs = stage_costs(cfg, split)
    mean = sum(costs) / len(costs)
    lines = [f"pipeline split ({source}): {split} blocks per stage, max/mean cost {max(costs) / mean:.3f}"]
    first = 0
    for k, (n, c) in enumerate(zip(split, costs)):
        parts = (["embedding"] if k == 0 else []) + [f"blocks {first}-{first + n - 1}" if n else "no blocks"]
        parts += ["norm+output+loss"] if k == len(split) - 1 else []
        lines.append(f"  stage {k} (rank {stage_rank[k]}): {', '.join(parts)}; "
                     f"{c / 1e6:.3f} MFLOP/token ({c / mean:.2f} x mean)")
        first += n
    return "\n".join(lines)
