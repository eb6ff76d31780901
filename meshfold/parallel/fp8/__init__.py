"""FP8 training (``train.fp8``, ``train.fp8_all_gather``; docs/fp8.md): torchao's float8 and
MXFP8 linears put in place of the model's ``nn.Linear`` before any other dimension is
applied, so FSDP2 shards the converted modules (and, with ``fp8_all_gather``, gathers their
weights already cast to float8).

* ``config.py`` (torch-free): the recipes, which linears stay in high precision, the checks;
* ``convert.py``: the conversion ``parallelize`` applies first of all;
* ``feature.py``: the per-step scale precompute after the optimizer step (a trainer feature).

This package init imports nothing, so ``config.py`` loads without torch or torchao.
"""
