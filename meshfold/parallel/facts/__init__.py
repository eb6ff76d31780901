"""Torch-free facts about the runtime's layouts, in one place: ``parallel/config.py``'s checks
and the planner import them, so a layout is priced and checked by the rule that builds it.

``attention.py``: heads per tp rank, the Ulysses degree, and the registry of attention
variants' layout rules (``gqa``, ``mla.py``), keyed by ``ModelConfig.attention``;
``mtp.py``: what multi-token prediction asks of a layout; ``sizes.py``: the loss's chunk
and FSDP2's dimension for stacked expert weights. Nothing here imports torch.
"""
