"""What a pipeline rank holds at each moment of its order: activations per chunk
(``held_counts``) and the state of each chunk's weight gradients (``grad_moments``). The
one definition the dry-run's measurement and the planner's prediction share.

Pure: an order is a list of actions with ``kind`` (F, B, W), ``chunk`` and ``mb``."""

from __future__ import annotations

from operator import ge


def held_counts(order) -> tuple[tuple[int, ...], ...]:
    """Per chunk, how many micro-batches' activations a rank running ``order`` holds (each
    from its F until its last backward action: W where the backward is split, else B), at
    each moment the count rises, leaving out moments another matches or exceeds in every
    chunk. The most the rank holds, given each chunk's bytes per micro-batch b, is
    ``max(sum(n_c * b_c))`` over these (``held_peak``)."""
    chunks = max((a.chunk for a in order), default=0) + 1
    split = {(a.chunk, a.mb) for a in order if a.kind == "W"}
    held, moments = [0] * chunks, set()
    for a in order:
        if a.kind == "F":
            held[a.chunk] += 1
            moments.add(tuple(held))
        elif a.kind == "W" or (a.kind == "B" and (a.chunk, a.mb) not in split):
            held[a.chunk] -= 1
    return undominated(moments)


def undominated(moments) -> tuple[tuple[int, ...], ...]:
    """The moments no other matches or exceeds in every chunk, fullest first."""
    kept: list[tuple[int, ...]] = []  # (a moment's dominators have larger sums: they come first)
    for x in sorted(moments, key=lambda x: (sum(x), x), reverse=True):
        if not any(all(map(ge, y, x)) for y in kept):
            kept.append(x)
    return tuple(kept)


def held_peak(counts: tuple[tuple[int, ...], ...], chunk_bytes) -> float:
    """The most bytes held at once: ``counts`` from ``held_counts``, ``chunk_bytes`` each
    chunk's bytes per micro-batch."""
    return max((sum(n * b for n, b in zip(c, chunk_bytes)) for c in counts), default=0.0)


def schedule_inflight(orders) -> float:
    """Most chunk-micro-batches any rank holds activations for (``held_counts``' moments:
    from its F until its last backward action), over the chunks per rank."""
    chunks = max(a.chunk for o in orders for a in o) + 1
    return max(sum(moment) for order in orders for moment in held_counts(order)) / chunks


def grad_moments(schedule, pp: int, rank: int, order) -> tuple[tuple[int, ...], ...]:
    """Per chunk of pp rank ``rank`` running ``order`` under ``schedule``, the state of its
    weight gradients just before each chunk's last backward action (its last W where the
    order has W actions, else its last B: where a layout that shards gradients reduces that
    chunk's): 0 none yet, 1 accumulating unsharded over the micro-batches, 2 reduced
    (sharded). Weight gradients start at a chunk's first W where its backward is split
    (every stage but the first), else at its first B. The dry-run measures held gradients at
    these moments; the planner prices the fullest of them."""
    has_w = {a.chunk for a in order if a.kind == "W"}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, a in enumerate(order):
        split = a.chunk in has_w and schedule.stage_of(pp, rank, a.chunk) > 0
        if a.kind == ("W" if split else "B"):
            first.setdefault(a.chunk, i)
        if a.kind == ("W" if a.chunk in has_w else "B"):
            last[a.chunk] = i
    chunks = max((a.chunk for a in order), default=0) + 1
    return moments_table(first, last, chunks)


def moments_table(first: dict[int, int], last: dict[int, int], chunks: int) -> tuple[tuple[int, ...], ...]:
    """From each chunk's first and last gradient action (positions), the per-chunk state
    just before each chunk's last one (``grad_moments``)."""
    return tuple(tuple(2 if x in last and last[x] < i else 1 if first.get(x, i) < i else 0 for x in range(chunks))
                 for i in sorted(last.values()))
