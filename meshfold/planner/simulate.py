"""``meshfold simulate``: one layout in detail, including the pipeline schedule as a
per-stage, per-micro-batch event timeline (drawn with ``parallel/timeline.py``).

The simulator executes each stage's operation list in the schedule's order; an
operation starts when its stage is free and its input is ready (the forward of the
previous virtual stage, the backward of the next one). Operation times come from the
cost model (``CostModel``: a stage's per-micro-batch forward/backward time, split evenly
over its virtual chunks), so the makespan of GPipe/1F1B/interleaved equals the closed
forms the search uses; the tests check that.
"""

from __future__ import annotations

from meshfold.planner.cluster import Cluster
from meshfold.planner.cost import CostModel, Estimate, Layout, Workload


def stage_orders(schedule: str, pp: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per stage, the ordered (kind, chunk, micro-batch) operations of one step."""
    orders = []
    for s in range(pp):
        ops: list[tuple[str, int, int]] = []
        if schedule == "gpipe":
            ops = [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
        elif schedule in ("1f1b", "zbv"):
            warm = min(pp - s - 1, m)
            ops = [("F", 0, i) for i in range(warm)]
            f, b = warm, 0
            while b < m:
                if f < m:
                    ops.append(("F", 0, f))
                    f += 1
                ops.append(("B", 0, b))
                if schedule == "zbv":
                    ops.append(("W", 0, b))
                b += 1
        elif schedule == "interleaved":
            # Megatron-LM's interleaved 1F1B: groups of pp micro-batches visit every chunk.
            total = m * v

            def fwd(k):
                return ("F", (k // pp) % v, (k // (pp * v)) * pp + k % pp)

            def bwd(k):
                return ("B", v - 1 - (k // pp) % v, (k // (pp * v)) * pp + k % pp)

            warm = min(total, (pp - s - 1) * 2 + (v - 1) * pp)
            ops = [fwd(k) for k in range(warm)]
            f, b = warm, 0
            while b < total:
                if f < total:
                    ops.append(fwd(f))
                    f += 1
                ops.append(bwd(b))
                b += 1
        else:
            raise ValueError(f"unknown schedule {schedule}")
        orders.append(ops)
    return orders


def simulate_schedule(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float,
                      w_frac: float = 0.0) -> list[dict]:
    """Events of one step. ``t_f``/``t_b`` are one stage's per-micro-batch times (all its
    chunks); ``w_frac`` of the backward is a separate weight-gradient pass (zbv), which
    zero-bubble schedules defer into otherwise idle time."""
    vv = v if schedule == "interleaved" else 1
    f_time, b_time = t_f / vv, t_b / vv
    if schedule == "zbv":
        w_frac = w_frac or 0.5
    orders = stage_orders(schedule, pp, m, vv)
    n_virtual = pp * vv
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    events: list[dict] = []
    # deferred weight-gradient passes per stage (zbv): run when the next op must wait
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, chunk, mb = orders[s][pos[s]]
                vs = chunk * pp + s  # virtual stage index
                if kind == "F":
                    dep = ("F", vs - 1, mb) if vs > 0 else None
                elif kind == "B":
                    dep = ("B", vs + 1, mb) if vs < n_virtual - 1 else ("F", vs, mb)
                else:  # W: after its own B
                    dep = ("B", vs, mb)
                if dep is not None and dep not in done:
                    break
                ready = done[dep] if dep is not None else 0.0
                if kind == "W":
                    pending_w[s].append((chunk, mb))
                    done[("W", vs, mb)] = -1.0
                    pos[s] += 1
                    remaining -= 1
                    progressed = True
                    continue
                # fill idle time before this op with deferred weight-gradient passes
                while pending_w[s] and free[s] + b_time * w_frac <= ready:
                    c, i = pending_w[s].pop(0)
                    events.append(dict(stage=s, chunk=c, mb=i, kind="W", start=free[s], end=free[s] + b_time * w_frac))
                    free[s] += b_time * w_frac
                start = max(free[s], ready)
                dur = f_time if kind == "F" else b_time * (1 - w_frac)
                events.append(dict(stage=s, chunk=chunk, mb=mb, kind=kind, start=start, end=start + dur))
                done[(kind, vs, mb)] = start + dur
                free[s] = start + dur
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks with pp={pp}, m={m}, v={vv}")
    for s in range(pp):  # weight gradients still pending at the end
        for c, i in pending_w[s]:
            events.append(dict(stage=s, chunk=c, mb=i, kind="W", start=free[s], end=free[s] + b_time * w_frac))
            free[s] += b_time * w_frac
    return events


def makespan(events: list[dict]) -> float:
    return max(e["end"] for e in events) - min(e["start"] for e in events) if events else 0.0


def simulate(w: Workload, cluster: Cluster, layout: Layout) -> tuple[Estimate, list[dict]]:
    """The cost model's estimate for ``layout`` and its simulated pipeline timeline."""
    cm = CostModel(w, cluster)
    est = cm.estimate(layout)
    n_micro = layout.microbatches(w.global_batch)
    t_f, t_b = est.time["stage_fwd_s"], est.time["stage_bwd_s"]
    events = simulate_schedule(layout.pp_schedule, layout.pp, n_micro, layout.pp_virtual_stages, t_f, t_b)
    return est, events


def result_json(est: Estimate, events: list[dict], simulated_pipeline_s: float) -> dict:
    return {"layout": est.layout.short(), "step_time_s": est.step_time_s, "mfu": est.mfu,
            "tflops_per_device": est.tflops_per_device, "peak_mem_bytes": est.peak_mem_bytes,
            "fits": est.fits, "breakdown": {"time_s": est.time, "memory_bytes": est.memory},
            "comm_bytes": est.comm_bytes, "footprint": est.footprint(), "simulated_pipeline_s": simulated_pipeline_s,
            "events": len(events)}
