"""``meshfold simulate``: one layout in detail, including the pipeline schedule as a
per-stage, per-micro-batch event timeline (drawn with ``parallel/pp/timeline_plot.py``).

The schedule is the object the executor runs (``meshfold/schedules/``): its ``actions``
are each rank's action list, replayed by ``schedules/simulate.py``; an action starts when
its rank is free and its input is ready. Action times come from the cost model (``CostModel``: a rank's
per-micro-batch forward/backward time, split evenly over its chunks, zbv's backward
split into B and W: ``chunk_costs``), so the makespan equals the ``pipeline_time`` the
search uses; the tests check that.
"""

from __future__ import annotations

from meshfold.planner.cluster import Cluster
from meshfold.planner.cost import CostModel, Estimate, Layout, Workload
from meshfold.schedules import get_schedule
from meshfold.schedules.simulate import simulate as simulate_orders


def schedule_events(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float) -> list[dict]:
    """Events of one step of ``schedule`` with per-micro-batch rank times ``t_f``, ``t_b``."""
    sched = get_schedule(schedule)
    v = sched.virtual_of(v)
    return simulate_orders(sched, sched.actions(pp, v, m), sched.chunk_costs(v, t_f, t_b))


def simulate(w: Workload, cluster: Cluster, layout: Layout) -> tuple[Estimate, list[dict]]:
    """The cost model's estimate for ``layout`` and its simulated pipeline timeline."""
    cm = CostModel(w, cluster)
    est = cm.estimate(layout)
    n_micro = layout.microbatches(w.global_batch)
    t_f, t_b = est.time["stage_fwd_s"], est.time["stage_bwd_s"]
    events = schedule_events(layout.pp_schedule, layout.pp, n_micro, layout.pp_virtual_stages, t_f, t_b)
    return est, events


def result_json(est: Estimate, events: list[dict], simulated_pipeline_s: float) -> dict:
    return {"layout": est.layout.short(), "step_time_s": est.step_time_s, "mfu": est.mfu,
            "tflops_per_device": est.tflops_per_device, "peak_mem_bytes": est.peak_mem_bytes,
            "fits": est.fits, "breakdown": {"time_s": est.time, "memory_bytes": est.memory},
            "comm_bytes": est.comm_bytes, "footprint": est.footprint(), "simulated_pipeline_s": simulated_pipeline_s,
            "events": len(events)}
