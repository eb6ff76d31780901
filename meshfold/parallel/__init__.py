"""Apply every parallel dimension to a parallelism-free model, in one fixed order.

Order matters and is the same as torchtitan's: tensor (and sequence) parallel rewrites
layers first, context parallel swaps the core attention, expert parallel shards the
experts, then activation recomputation and compilation wrap blocks, and data parallel
(DDP / FSDP2) wraps last so it shards whatever the earlier steps produced. Pipeline
parallel splits the model into stages before any of this (see ``pipeline.py``).

A model built on the ``meta`` device is materialised here (``materialize.py``): after
FSDP2 has sharded it, or before DDP / the gradient reducer, which need real tensors.

Laid out by what things are:

* one folder per dimension, each with its collectives, layers and plan (``plan.py``, the
  entry point): ``dp/`` (DDP, ZeRO, FSDP2), ``tp/`` (tensor and sequence parallel),
  ``cp/`` (ring, Ulysses, hybrid; per-sequence), ``ep/`` (expert dispatch and placement);
  the pipeline's executor beside them;
* cross-cutting pieces: ``parallelize.py`` (the fixed order), ``recompute.py`` (activation
  recomputation, per-block compile), ``materialize.py`` (only this rank's shards of a meta
  model), ``compute_weights.py`` (the step's bf16 copies of fp32 parameters);
* torch-free: ``config.py`` (the layout checked against the model) and ``facts/`` (what
  the planner shares with the runtime: heads per rank, the Ulysses degree, sizes, and the
  attention variants' and extra heads' layout rules).

An attention variant or extra head that needs its own handling has a module of its own in
each folder it touches (``tp/mla.py``, ``cp/mla.py``, ``facts/mla.py``; ``tp/mtp.py``,
``facts/mtp.py``) and one registration line there (``ATTENTION_PLANS``,
``ATTENTION_ADAPTERS``, ``ATTENTION_LAYOUTS`` by ``ModelConfig.attention``;
``EXTRA_HEAD_PLANS``, ``EXTRA_HEAD_CHECKS``); blocks are enumerated by
``Transformer.blocks()``.

This package init imports nothing, so the pure parts (``config.py``, ``facts/``) load
without torch.
"""
