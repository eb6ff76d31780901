"""The per-step part of FP8 training, behind the trainer's feature protocol
(``train/feature.py``): with per-tensor scales gathered in fp8 by FSDP2
(``train.fp8 = tensorwise``, ``train.fp8_all_gather``) every weight's amax and scale are
computed for all of them at once right after the optimizer step (torchao's
``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce of the amaxes instead of one
per weight inside the next forward). The other recipes scale inside each GEMM: no feature."""

from __future__ import annotations

from meshfold.parallel.dp.plan import uses_fsdp


class Float8ScalePrecompute:
    """``after_update``: the fp8 weight scales for the next step's all-gathers."""

    name = None  # no state: scales are recomputed from the weights

    def __init__(self):
        self.model_parts: list = []

    def attach(self, parts) -> None:
        self.model_parts = list(parts.model_parts) or [parts.model]

    def after_update(self) -> dict:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for model in self.model_parts:
            precompute_float8_dynamic_scale_for_fsdp(model)
        return {}


def build_fp8(cfg, parts):
    """The feature where the recipe needs it, else None."""
    t = cfg.train
    if t.fp8 == "tensorwise" and t.fp8_all_gather and parts.dims.distributed and uses_fsdp(parts.dims):
        return Float8ScalePrecompute()
    return None
