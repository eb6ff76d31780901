"""The features a run may have (``train/feature.py``), one registration line each. The
trainer builds them in this order (``Features.build``) and runs each hook in this order:
a feature that replaces what another wraps comes after it (live recovery after
``[lowcomm]``: it takes over the sampler and heals after the outer step)."""

from __future__ import annotations

from meshfold.data.mixture import build_mixture_tokens
from meshfold.lowcomm.feature import build_lowcomm
from meshfold.parallel.balanced_loader import build_balance
from meshfold.parallel.fp8.feature import build_fp8
from meshfold.train.live import build_live
from meshfold.train.moe_stats import build_moe_stats
from meshfold.train.mtp import build_mtp

FEATURES = (
    build_balance,  # data.balance: whole documents to dp ranks by cost (parallel/balanced_loader.py)
    build_lowcomm,  # [lowcomm]: per-worker data, outer optimizer, compression, 1-bit Adam (lowcomm/feature.py)
    build_mtp,  # model.mtp_depth: the depths' loss, their inputs and mtp_loss (train/mtp.py)
    build_moe_stats,  # MoE load, imbalance, dropped tokens, router-bias update (train/moe_stats.py)
    build_live,  # train.live_recovery: quorum, heal and cross-replica reduce (train/live.py)
    build_mixture_tokens,  # data.mix_sources: tokens drawn per source (data/mixture.py)
    build_fp8,  # train.fp8: fp8 weight scales for FSDP2's next gathers (parallel/fp8/feature.py)
)
