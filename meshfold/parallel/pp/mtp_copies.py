"""Multi-token prediction's stage copy: its depths embed the shifted tokens on the last
stage (``models/deepseek/mtp.py``), so with pp > 1 that stage keeps a copy of the first stage's
embedding; the executor sums the two copies' gradients (``executor.py``,
``sum_weight_copy_grads``). Registered in ``stage_modules.WEIGHT_COPIES``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def mtp_embedding_copy(cfg: Config, n_stages: int) -> dict[str, tuple[int, ...]]:
    """{module name: stages holding it} for the embedding's copy on the last stage."""
    if not cfg.model.mtp_depth or n_stages < 2:
        return {}
    return {"tok_embeddings": (0, n_stages - 1)}
