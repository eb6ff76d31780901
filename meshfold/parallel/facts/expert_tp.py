"""Expert tensor parallelism's layout facts (pure: no torch; the runtime's checks and the
planner's prices use one rule).

Two foldings of the routed experts onto the ep x tp ranks of a MoE layer
(``parallel.expert_tp``; Megatron-Core's ``expert_tensor_parallel_size``, MoE Parallel
Folding):

* ``expert_tp = 1`` (whole experts): each ep rank's E/ep experts are split again, whole, over
  its tp ranks; tp rank r dispatches only the assignments of its expert column. Needs
  ``ep * tp`` to divide E.
* ``expert_tp = tp`` (experts split inside): every rank holds the E/ep experts of its ep rank,
  each expert's FFN split over the tp group (w13 by columns, w2 by rows); every tp rank
  dispatches all assignments of its (tp-replicated) tokens over its ep group and the partial
  outputs are summed over tp after the combine. Needs ep to divide E and tp the expert width.
"""

from __future__ import annotations

from meshfold.errors import ConfigError, divisors


def inside(p) -> bool:
    """Whether each expert's FFN is split over the tp group (rather than whole experts)."""
    return p.expert_tp > 1


def local_experts(n_experts: int, ep: int, tp: int, expert_tp: int) -> int:
    """Routed experts a rank holds (whole, or a 1/tp slice of each)."""
    return n_experts // (ep if expert_tp > 1 else ep * tp)


def dispatch_share(tp: int, expert_tp: int) -> int:
    """How many ways a tp group divides its tokens' assignments among its ranks for dispatch:
    tp with whole experts (each rank its expert column), 1 with experts split inside."""
    return 1 if expert_tp > 1 else tp


def check(cfg) -> None:
    """``parallel.expert_tp`` against the model (``config.validate``)."""
    m, p = cfg.model, cfg.parallel
    if p.expert_tp == 1:
        return
    if not m.moe_experts:
        raise ConfigError("parallel.expert_tp > 1 splits routed experts; it needs an MoE model "
                          "(model.moe_experts) or parallel.expert_tp = 1")
    hidden = m.expert_dim
    if hidden % p.expert_tp:
        raise ConfigError(f"parallel.expert_tp = {p.expert_tp} must divide the experts' width {hidden} "
                          f"(model.moe_ffn_dim); expert_tp could be one of {divisors(hidden)} (and equal tp)")
    if m.moe_bias:
        raise ConfigError("parallel.expert_tp > 1 with biased experts (model.moe_bias) is not supported; "
                          "set parallel.expert_tp = 1")


def foldings(m, tp: int, ep: int) -> tuple[int, ...]:
    """The ``parallel.expert_tp`` values valid for a MoE model ``m`` at (tp, ep), whole
    experts first (the layout search tries each): whole experts need ep * tp to divide E
    (tp alone: any E, ``shard_range``), experts split inside need tp to divide their width
    and no expert biases."""
    if tp == 1 or not m.moe_experts:
        return (1,)
    whole = (1,) if ep == 1 or m.moe_experts % (ep * tp) == 0 else ()
    split = (tp,) if m.expert_dim % tp == 0 and not m.moe_bias and m.moe_experts % ep == 0 else ()
    return whole + split
