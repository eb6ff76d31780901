"""Apply every parallel dimension to a parallelism-free model, in one fixed order.

Order matters and is the same as torchtitan's: tensor (and sequence) parallel rewrites
layers first, context parallel swaps the core attention, expert parallel shards the
experts, then activation recomputation and compilation wrap blocks, and data parallel
(DDP / FSDP2) wraps last so it shards whatever the earlier steps produced. Pipeline
parallel splits the model into stages before any of this (see ``pipeline.py``).

A model built on the ``meta`` device is materialised here (``materialize.py``): after
FSDP2 has sharded it, or before DDP / the gradient reducer, which need real tensors.

``parallelize`` lives in ``parallelize.py``; this package init imports nothing, so the pure
parts (``config.py``, ``stage_balance.py``) load without torch.
"""
