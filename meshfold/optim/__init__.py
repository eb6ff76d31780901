"""Optimizers: each one a module that owns its state, its layout variants and its
checkpoint state (``state.py``'s protocol), looked up by name in ``registry.py``.

- ``registry.py``      ``build_optimizer``: the kind by name (``OPTIMIZERS``), one line each
- ``adamw.py``         AdamW's groups and settings, and which variant a layout gets
- ``zero_one.py``      ZeRO-1 through torch's ``ZeroRedundancyOptimizer`` (plain parameters)
- ``sharded.py``       ZeRO-1 as Megatron's distributed optimizer (``ShardedAdamW``, bf16 compute)
- ``expert_split.py``  ZeRO-1 with expert parallel: dense and expert state sharded apart
- ``muon/``           Muon (orthogonalised momentum) for hidden matrices, AdamW for the
                       rest; owner-computes on every layout (docs/optimizers.md)
- ``offload.py``       Adam state and fp32 masters in host memory
- ``zero_state.py``    ZeRO-1 state as checkpoint boxes (any layout reads them)
- ``state.py``         the checkpoint protocol every optimizer implements
- ``lr_schedule.py``   warmup + cosine learning rate
- ``clip.py``          the gradient norm over the mesh, and clipping by it

A new optimizer (Muon ...) is a module whose optimizer implements ``CheckpointState`` and
a builder, plus one line in ``OPTIMIZERS``.
"""
