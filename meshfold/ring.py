"""The ring algorithm's cost per collective, pure (no torch): one table that the
communication layer's byte ledger (``comm.py``) and the planner's alpha-beta model
(``planner/cost.py``, ``planner/traffic.py``) both use, so predicted and counted traffic
follow one convention.

``FACTORS[op](n)``: bytes a rank sends, per byte of ``size``, in the bandwidth-optimal
ring algorithm over a group of n ranks holding ``size`` bytes in total (all-reduce,
all-gather output, reduce-scatter input):

    all-reduce      2 (n-1)/n * size
    all-gather        (n-1)/n * size
    reduce-scatter    (n-1)/n * size
    all-to-all        (n-1)/n * size   (uniform splits; variable splits: the bytes leaving)
    broadcast         (n-1)/n * size
    send              size

``HOPS[op](n)``: sequential message hops (the alpha terms). An all-to-all posts every
pairwise exchange at once, so its latency grows slowly with the group: ceil(log2 n)
(gloo on this host, 64 KB: 2 ranks 1.2 ms, 4 ranks 1.5, 8 ranks 2.5, at ~1 ms a hop).
"""

from __future__ import annotations

import math

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
           "send": lambda n: 1.0, "broadcast": lambda n: (n - 1) / n}

HOPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
        "all_to_all": lambda n: math.ceil(math.log2(n)), "send": lambda n: 1, "broadcast": lambda n: n - 1}
