"""The chunk size of the chunked cross-entropy (pure: no torch, so the planner prices the
same scratch the runtime makes; ``parallel/loss.py`` is the computation)."""

CHUNK_ELEMENTS = 1 << 25  # logits per chunk: the loss's one fp32 scratch is 128 MiB
