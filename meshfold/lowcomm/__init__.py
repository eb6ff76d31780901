"""Training over slow links: outer optimizers across workers (``outer.py``), gradient
codecs for the per-step data-parallel path (``codecs/``, ``compress.py``,
``onebit_adam.py``) and a network lab of throttled namespaces (``netlab.py``).

The trainer builds the feature before the model (``feature.build_lowcomm``, registered in
``train/registry.py``): it owns the DDP compression hook (``compress.build_compression``),
whose ``install`` goes to ``parallelize`` as the run's ``comm_hook``; once the model exists
``attach`` builds the outer optimizer. The trainer calls its hooks (``train/feature.py``):
``wrap_sampler``, ``wrap_optimizer``, ``after_step(step)`` after every optimizer step, and its state with
the checkpoints; everything else lives here.

Batch convention with workers (the DiLoCo convention): ``train.global_batch`` is the batch
of ONE worker per inner step, so W workers together process W x global_batch sequences per
step. Worker w takes rows [w B, (w+1) B) of a global batch of W B sequences drawn by the
seeded sampler, so workers see disjoint data, deterministically, and a DDP run with
global_batch = W B sees exactly the same sequences step by step.

The feature itself is ``feature.py``; this package init imports nothing, so ``config.py``
(``[lowcomm]`` and its checks) loads without torch.
"""
