"""The chunk size of the chunked cross-entropy (pure: no torch, so the planner prices the
same scratch the runtime makes; ``parallel/loss.py`` is the computation)."""

CHUNK_ELEMENTS = 1 << 25  # logits per chunk on an accelerator: the loss's one fp32 scratch is 128 MiB
# On a host a chunk that stays in cache wins: loss and gradient of 2,048 x 8,192 fp32 logits
# took 58-61 ms at 2^20 against 80-91 ms at 2^25 on this machine's CPU (2^16: 68-84 ms).
HOST_CHUNK_ELEMENTS = 1 << 20


def chunk_elements(device_type: str) -> int:
    return HOST_CHUNK_ELEMENTS if device_type == "cpu" else CHUNK_ELEMENTS
