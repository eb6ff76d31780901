"""What context parallel's ring sends per layer when windowed or chunked layers leave key
tiles unseen (``parallel/cp/ring.py``'s ``RingLayout.need_tiles``, recomputed here in plain
Python for the default positions: the planner needs no torch; tests/test_cp_chunked.py
checks they agree).

Ring member m holds the positions of its share (contiguous, or the balanced chunks m and
2R-1-m), cut into tiles of seq / (2 max(cp, 4)) tokens. Member q needs key tile j of member
k iff some query tile of q and that tile are not out of reach by position: keys in the
future, a window or more behind, or (chunked) in other chunks. Windowed and chunked layers
then run the direct ring: member 0 (the rank the dry-run records) sends each member the key
tiles of its block that member sees, forward and backward, and the gradient of the tiles it
used of each other block back. Other layers relay every block around the ring: R - 1 hops
each way and R gradient hops."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshfold.models import registry
from meshfold.models.config import ModelConfig


@dataclass(frozen=True)
class RingSends:
    """Per layer (the mean over the model's layers), in blocks (a member's whole key/value
    share, or its gradient): what member 0 sends in the forward (the backward sends as much
    again), the gradients it sends back, and the ring steps with an exchange on the busiest
    member (the hops the attention must hide); ``kv_calls`` / ``grad_calls``: the sends
    that carry them."""

    kv: float
    grad: float
    steps: float
    kv_calls: float
    grad_calls: float


def _member_tiles(seq: int, cp: int, ulysses: int, balance: bool) -> list[list[tuple[int, int]]]:
    """(first, last) position of every tile of every ring member's share (its positions rise)."""
    R = cp // ulysses
    share = seq // R
    tile = max(1, seq // (2 * max(cp, 4)))
    out = []
    for m in range(R):
        if balance and R > 1:
            c = seq // (2 * R)
            pos = list(range(m * c, (m + 1) * c)) + list(range((2 * R - 1 - m) * c, (2 * R - m) * c))
        else:
            pos = list(range(m * share, (m + 1) * share))
        out.append([(pos[a], pos[min(a + tile, share) - 1]) for a in range(0, share, tile)])
    return out


def _out_of_reach(q: tuple[int, int], k: tuple[int, int], window: int, chunk: int) -> bool:
    (qmin, qmax), (kmin, kmax) = q, k
    if qmax < kmin or (window and qmin - kmax >= window):
        return True
    return bool(chunk) and (qmax // chunk < kmin // chunk or kmax // chunk < qmin // chunk)


@lru_cache(maxsize=256)
def ring_tiles(seq: int, cp: int, ulysses: int, balance: bool, window: int, chunk: int) -> tuple:
    """tiles[q][k]: member k's key tiles some query of member q sees (``RingLayout.need_tiles``)."""
    tiles = _member_tiles(seq, cp, ulysses, balance)
    return tuple(tuple(tuple(j for j, kt in enumerate(tk) if any(not _out_of_reach(qt, kt, window, chunk) for qt in tq))
                       for tk in tiles) for tq in tiles)


def _layer_sends(seq: int, cp: int, ulysses: int, balance: bool, window: int, chunk: int) -> tuple:
    R = cp // ulysses
    if not (window or chunk):
        return R - 1, R, R - 1, R - 1, R
    seen = ring_tiles(seq, cp, ulysses, balance, window, chunk)
    share, tile = seq // R, max(1, seq // (2 * max(cp, 4)))

    def blocks(tiles) -> float:  # a block's share the tiles hold (the last tile may be short)
        return sum(min(tile, share - j * tile) for j in tiles) / share

    kv = sum(blocks(seen[q][0]) for q in range(1, R))
    grad = sum(blocks(seen[0][k]) for k in range(1, R))
    steps = max(sum(bool(seen[(r + t) % R][r] or seen[r][(r - t) % R]) for t in range(1, R)) for r in range(R))
    return kv, grad, steps, sum(bool(seen[q][0]) for q in range(1, R)), sum(bool(seen[0][k]) for k in range(1, R))


def ring_sends(m: ModelConfig, seq: int, cp: int, ulysses: int, balance: bool = True) -> RingSends:
    """The ring's sends per layer, averaged over ``m``'s layers (``RingSends``)."""
    specs = (registry.layer_attention(m, i) for i in range(m.n_layers))
    return _mean_sends(tuple((spec.window, spec.chunk) for spec in specs), seq, cp, ulysses, balance)


@lru_cache(maxsize=64)
def _mean_sends(layers: tuple, seq: int, cp: int, ulysses: int, balance: bool) -> RingSends:
    per_layer = [_layer_sends(seq, cp, ulysses, balance, window, chunk) for window, chunk in layers]
    return RingSends(*(sum(x[i] for x in per_layer) / len(per_layer) for i in range(5)))
