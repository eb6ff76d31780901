"""The chunk size of the chunked cross-entropy (pure: no torch, so the planner prices the
same working copies the runtime makes; ``parallel/loss.py`` is the computation)."""

CHUNK_ELEMENTS = 1 << 25  # logits per chunk: a chunk's fp32 working copies are 128 MiB each
