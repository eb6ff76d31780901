"""Checks that relate ``[parallel]`` to ``[model]``: heads over tp, sequence over cp,
layers over pp, experts over ep. The dataclass is ``meshfold.layout.ParallelConfig`` (core,
because ``mesh.py`` builds on it); ``config.validate`` calls ``validate`` here once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.errors import ConfigError, divisors
from meshfold.parallel.facts import expert_tp, mtp
from meshfold.parallel.facts.attention import ATTENTION_LAYOUTS, local_heads, ulysses_degree, ulysses_fits
from meshfold.schedules import get_schedule

if TYPE_CHECKING:  # the composed config is handed in; its module sits above this layer
    from meshfold.config import Config


# The layout rules of the model's extra heads (beside its attention variant's, which
# ``facts/attention.py`` registers), one line each.
EXTRA_HEAD_CHECKS = (mtp.check,)


def validate(cfg: Config) -> None:
    """The layout against the model, before the world size is known."""
    m, p = cfg.model, cfg.parallel
    if m.moe_experts and m.moe_capacity_factor > 0 and p.cp > 1:
        raise ConfigError("model.moe_capacity_factor > 0 (per-sequence capacity) needs whole sequences on a "
                          "rank; use parallel.cp = 1 or moe_capacity_factor = 0 (dropless)")
    if m.moe_experts and m.moe_seq_aux_loss_coef > 0 and p.cp > 1:
        raise ConfigError("model.moe_seq_aux_loss_coef > 0 (sequence-wise balance loss) needs whole sequences on a "
                          "rank; use parallel.cp = 1 or moe_seq_aux_loss_coef = 0")
    ATTENTION_LAYOUTS[m.attention].check(cfg)  # the attention variant's own rules (facts/attention.py)
    # Tensor parallel: heads split across tp ranks.
    if p.tp > 1:
        if p.tp > m.n_heads:
            raise ConfigError(
                f"parallel.tp = {p.tp} is larger than model.n_heads = {m.n_heads}; "
                f"tp could be one of {divisors(m.n_heads)}"
            )
        if m.n_heads % p.tp:
            raise ConfigError(
                f"model.n_heads = {m.n_heads} is not divisible by parallel.tp = {p.tp}; "
                f"tp could be one of {divisors(m.n_heads)}"
            )
        if m.kv_heads % p.tp and p.tp % m.kv_heads:
            raise ConfigError(
                f"model.n_kv_heads = {m.kv_heads} and parallel.tp = {p.tp}: one must divide the other "
                f"(kv heads are split when tp divides them, replicated when they divide tp)"
            )
        if p.sp and m.seq_len % (p.tp * p.cp):
            raise ConfigError(
                f"parallel.sp needs model.seq_len = {m.seq_len} divisible by parallel.tp*cp = {p.tp * p.cp} "
                f"(each rank keeps a 1/tp slice of its sequence); change model.seq_len or set parallel.sp = false"
            )
    if p.cp > 1:
        chunks = 2 * p.cp if (p.cp_mode != "ulysses" and p.cp_balance) else p.cp
        if m.seq_len % chunks:
            raise ConfigError(
                f"model.seq_len = {m.seq_len} is not divisible by {chunks} "
                f"(parallel.cp = {p.cp}, cp_mode = {p.cp_mode}); choose a seq_len that is a multiple of {chunks}"
            )
        if p.cp_mode in ("ulysses",) and m.n_heads % (p.cp * p.tp):
            raise ConfigError(
                f"parallel.cp_mode = ulysses needs model.n_heads = {m.n_heads} divisible by cp*tp = {p.cp * p.tp}"
            )
    check_context(cfg)  # Ulysses/hybrid head split, cp_ulysses
    # Pipeline stages: pp x chunks per rank (interleaved: pp_virtual_stages; zbv: 2, a V).
    schedule = get_schedule(p.pp_schedule)
    pp_stages = p.pp * schedule.chunks_per_rank(p.pp_virtual_stages)
    if p.pp > 1:
        schedule.check_model(p, m)  # (interleaved: pp_virtual_stages >= 2)
    if p.pp > 1 and m.tie_embeddings:
        raise ConfigError("model.tie_embeddings puts one weight on the first and last pipeline stage; "
                          "set it to false (meshfold convert import --untie for a Hugging Face model) "
                          "or parallel.pp = 1")
    for check in EXTRA_HEAD_CHECKS:  # the model's extra heads' own rules
        check(cfg)
    if p.pp > 1 and pp_stages > m.n_layers:
        raise ConfigError(
            f"parallel.pp = {p.pp} with pp_schedule = {p.pp_schedule} needs {pp_stages} stages, more than "
            f"model.n_layers = {m.n_layers}; use fewer stages or more layers"
        )
    if p.pp_split:
        if (len(p.pp_split) != pp_stages or sum(p.pp_split) != m.n_layers
                or any(not isinstance(n, int) or n < 1 for n in p.pp_split)):
            raise ConfigError(
                f"parallel.pp_split = {p.pp_split} must list {pp_stages} layer counts (each >= 1) "
                f"summing to model.n_layers = {m.n_layers}"
            )
    if m.moe_experts and p.ep > 1 and m.moe_experts % p.ep:
        raise ConfigError(
            f"model.moe_experts = {m.moe_experts} is not divisible by parallel.ep = {p.ep}; "
            f"ep could be one of {divisors(m.moe_experts)}"
        )
    if m.moe_experts and p.ep > 1 and p.tp > 1 and p.expert_tp == 1 and m.moe_experts % (p.ep * p.tp):
        raise ConfigError(
            f"model.moe_experts = {m.moe_experts} is not divisible by parallel.ep * parallel.tp = {p.ep * p.tp} "
            "(each ep rank's experts are split again over tp); set parallel.expert_tp = tp (each expert split "
            "over tp) or change parallel.ep, parallel.tp or model.moe_experts"
        )
    expert_tp.check(cfg)
    if p.ep > 1 and not m.moe_experts:
        raise ConfigError("parallel.ep > 1 needs an MoE model; set model.moe_experts or parallel.ep = 1")
    if p.ep > 1 and p.zero < 2:
        check_expert_data_parallel(cfg)


def check_expert_data_parallel(cfg: Config) -> None:
    """Expert parallel over DDP / ZeRO-1 data parallel (``parallel/ep/plan.py``): the experts'
    gradients go through a reducer over edp of their own and their Adam state through a
    second ZeRO-1 optimizer; the features that replace the data-parallel reduction or the
    optimizer, or move the state to the host, are not built for that split."""
    p, t, lc = cfg.parallel, cfg.train, cfg.lowcomm
    where = f"parallel.ep = {p.ep} with parallel.zero = {p.zero}"
    if lc.method != "none":
        raise ConfigError(f"lowcomm.method = {lc.method} with {where} is not supported; "
                          "set lowcomm.method = none or parallel.zero = 2")
    if lc.compression != "none":
        raise ConfigError(f"lowcomm.compression = {lc.compression} (incl. 1-bit Adam) with {where} is not "
                          "supported; set lowcomm.compression = none or parallel.zero = 2")
    # (train.live_recovery's own check: meshfold/live_config.py)
    if t.offload != "none":
        raise ConfigError(f"train.offload = {t.offload} with {where} is not supported; "
                          "set train.offload = none or parallel.zero = 2")


# --------------------------------------------------------------------------- context parallel


def check_context(cfg: Config) -> None:
    """Context-parallel checks for ``config.validate`` (before any process group starts)."""
    p, m = cfg.parallel, cfg.model
    if p.cp_ulysses < 0:
        raise ConfigError(f"parallel.cp_ulysses must be >= 0 (0 = automatic), got {p.cp_ulysses}")
    if p.cp == 1:
        return
    if p.cp_mode == "hybrid" and p.cp_ulysses and p.cp % p.cp_ulysses:
        raise ConfigError(
            f"parallel.cp_ulysses = {p.cp_ulysses} must divide parallel.cp = {p.cp}; "
            f"choose one of {divisors(p.cp)}"
        )
    degree = ulysses_degree(p, m)
    if degree > 1 and not ulysses_fits(m, p.tp, degree):
        heads, kv = local_heads(m, p.tp)
        key = "parallel.cp" if p.cp_mode == "ulysses" else "parallel.cp_ulysses"
        fits = [u for u in divisors(heads) if ulysses_fits(m, p.tp, u)]
        raise ConfigError(
            f"parallel.cp_mode = {p.cp_mode} with Ulysses degree {degree}: each rank's {heads} query heads and "
            f"{kv} key/value heads (model.n_heads/n_kv_heads over tp = {p.tp}) must split evenly over it; "
            f"change {key} (Ulysses degree could be one of {fits}) or use parallel.cp_mode = ring"
        )
