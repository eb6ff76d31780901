"""``meshfold plan | simulate | calibrate`` (registered in ``meshfold/cli.py``)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import tomli_w

from meshfold.config import Config, load_config, model_keys, parse_override, validate
from meshfold.errors import ConfigError
from meshfold.parallel.pp.timeline_plot import draw_timeline
from meshfold.planner.cluster import GiB, Cluster, load_cluster, presets_help
from meshfold.planner.cost import CostModel, Estimate, Layout, Workload
from meshfold.planner import from_config
from meshfold.planner.from_config import layout_from_config
from meshfold.planner.search import explain, search
from meshfold.planner.goodput import FailureModel, failures_line, goodput
from meshfold.planner.simulate import result_json, simulate
from meshfold.schedules.simulate import makespan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def workload_from_config(cfg: Config, cluster: Cluster) -> Workload:
    """The model and batch of a config, with the numerics the run would use there."""
    return from_config.workload_from_config(cfg, on_gpu=not cluster.device.name.startswith("cpu"))


def _gib(x: float) -> str:
    return f"{x / GiB:,.2f}"


def _table(ranked: list[Estimate]) -> str:
    head = f"{'#':>3}  {'layout':52s} {'step s':>10} {'MFU':>6} {'TF/dev':>8} {'mem GiB':>9} fits"
    rows = [head, "-" * len(head)]
    for i, e in enumerate(ranked, 1):
        rows.append(f"{i:>3}  {e.layout.short():52s} {e.step_time_s:>10.4g} {100 * e.mfu:>5.1f}% "
                    f"{e.tflops_per_device:>8.3g} {_gib(e.peak_mem_bytes):>9} {'yes' if e.fits else 'NO'}")
    return "\n".join(rows)


def _entry(e: Estimate, global_batch: int) -> dict:
    return {**e.row(), "breakdown": {"time_s": e.time, "memory_bytes": e.memory}, "comm_bytes": e.comm_bytes,
            "footprint": e.footprint(),
            "parallel_toml": e.layout.to_toml(global_batch), **({"optimizer": e.optimizer} if e.optimizer else {}),
            **({"choices": e.choices} if e.choices else {})}


# --------------------------------------------------------------------------- plan


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="search parallel layouts for a model and batch on a cluster")
    p.add_argument("config", help="TOML config ([model], [train].global_batch); ignored with --check")
    p.add_argument("--cluster", required=True, help=f"the cluster to plan for: {presets_help()}")
    p.add_argument("--devices", type=int, default=None, help="use this many devices of the cluster")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--top", type=int, default=10, help="layouts to list, fastest first (default 10)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (the ranked layouts with their breakdowns) instead of the table")
    p.add_argument("--out", default=None, help="write a complete config that runs the winner (meshfold train FILE)")
    p.add_argument("--max-tp", type=int, default=0, help="limit tensor parallel degree (0 = any)")
    p.add_argument("--check", default=None, metavar="RUN_DIR",
                   help="compare a finished run's measurements with the prediction for its layout")


def run_plan(args) -> int:

    if args.check:  # the run directory holds its own resolved config
        return check_run(args.check, args.cluster, args.json)
    cfg = load_config(args.config, args.set)
    cluster = load_cluster(args.cluster, devices=args.devices)
    w = workload_from_config(cfg, cluster)
    validate(cfg)
    res = search(w, cluster, top=max(2, args.top), max_tp=args.max_tp)
    if not res.ranked:
        raise ConfigError(f"no layout tiles {cluster.world_size} devices and train.global_batch = "
                          f"{w.global_batch}; change train.global_batch or the device count")
    ranked = res.ranked[: args.top]
    why = explain(ranked[0], ranked[1] if len(ranked) > 1 else None)
    if args.out:
        write_plan(args.out, args.config, args.set, cfg, ranked[0], cluster, args.cluster)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "devices": cluster.world_size, "any_fits": res.any_fits,
                          "search": {"structures": res.structures, "visited": res.visited,
                                     "evaluated": res.evaluated, "seconds": res.seconds},
                          "ranked": [_entry(e, w.global_batch) for e in ranked], "why": why,
                          "notes": res.notes}, indent=1))
        return 0
    print(f"{cluster.name}: {cluster.world_size} devices ({cluster.nodes} x {cluster.devices_per_node}); "
          f"{res.structures} structures, {res.visited} expanded, {res.evaluated} layouts evaluated "
          f"in {res.seconds:.2f} s")
    for note in res.notes:
        print(f"note: {note}")
    print(_table(ranked))
    print()
    print("\n".join(why))
    print()
    print("winner as config:" if not args.out else f"winner written to {args.out}:")
    print(ranked[0].layout.to_toml(w.global_batch))
    chosen = {k.split(".", 1)[1]: v for k, v in ranked[0].choices.items()}  # the "auto" keys the search chose
    if chosen:
        print("[train]\n" + "\n".join(f'{k} = "{v}"' for k, v in chosen.items()))
    return 0


def write_plan(out: str, config: str, overrides: list[str], cfg: Config, best: Estimate, cluster: Cluster,
               cluster_spec: str) -> None:
    """A complete config that ``meshfold train`` runs as planned: the input config (with its
    ``--set`` overrides) and [model] as resolved, the plan's [parallel] and [train] keys."""
    data = tomllib.loads(Path(config).read_text()) if config else {}
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
    if cfg.model.preset:  # the shape planned, as the preset and its overrides (load_config's rule)
        data["model"] = model_keys(cfg.model)
    for section, values in best.layout.config_values(cfg.train.global_batch).items():
        data.setdefault(section, {}).update(values)
    for key, value in best.choices.items():  # the "auto" keys the search chose (planner/choices.py)
        section, name = key.split(".", 1)
        data.setdefault(section, {})[name] = value
    world = cluster.world_size
    head = (f"# meshfold plan {config}{''.join(f' --set {s}' for s in overrides)} --cluster {cluster_spec}\n"
            f"# {best.layout.short()}: predicted {best.step_time_s:.4g} s/step, peak {_gib(best.peak_mem_bytes)} GiB "
            f"per device on {world} devices; run it on {world} processes, e.g. meshfold train {out} --nproc {world}\n")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(head + tomli_w.dumps(data))


def _run_measurements(run_dir: Path, stat: str = "median") -> dict:
    """A run's steady-state numbers; ``stat`` = median, or min (the least-disturbed step,
    for shared hosts)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise ConfigError(f"--check {run_dir}: no metrics.jsonl there")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ConfigError(f"--check {run_dir}: metrics.jsonl is empty")
    steady = records[2:] if len(records) > 4 else records[1:] or records  # skip warm-up steps
    dims = sorted({k for r in steady for k in (r.get("comm_bytes") or {})})
    pick = min if stat == "min" else statistics.median
    return {"step_time_s": pick(r["step_time_s"] for r in steady),
            "peak_mem_bytes": max(r.get("peak_mem_bytes", 0) for r in records),
            "process_base_bytes": records[0].get("process_base_bytes"),  # None: a run from before it was logged
            "comm_bytes": {d: statistics.median((r.get("comm_bytes") or {}).get(d, 0) for r in steady) for d in dims},
            "steps": len(records)}


def predict_run(run_dir: str | Path, cluster_spec: str, stat: str = "median") -> tuple[Estimate, dict, Layout]:
    """Prediction for a finished run's layout next to what it measured."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.toml")
    p = cfg.parallel
    world = p.world_size() * cfg.lowcomm.n_workers
    cluster = load_cluster(cluster_spec, devices=world)
    layout = layout_from_config(cfg, world)
    est = CostModel(workload_from_config(cfg, cluster), cluster).estimate(layout)
    return est, _run_measurements(run_dir, stat), layout


def check_run(run_dir: str, cluster_spec: str, as_json: bool) -> int:
    est, meas, layout = predict_run(run_dir, cluster_spec)
    out = {"layout": layout.short(),
           "step_time_s": {"predicted": est.step_time_s, "measured": meas["step_time_s"]},
           "peak_mem_bytes": {"predicted": est.peak_mem_bytes, "measured": meas["peak_mem_bytes"]},
           "peak_mem_split": _memory_split(est, meas),
           "comm_bytes": {d: {"predicted": est.comm_bytes.get(d, 0.0), "measured": meas["comm_bytes"].get(d, 0)}
                          for d in sorted(set(est.comm_bytes) | set(meas["comm_bytes"]))},
           "breakdown": {"time_s": est.time, "memory_bytes": est.memory}}
    if as_json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{run_dir}: {layout.short()} ({meas['steps']} steps logged)")
    print(f"{'':18s} {'predicted':>14} {'measured':>14} {'ratio':>7}")

    def line(name, a, b):
        print(f"{name:18s} {a:>14.4g} {b:>14.4g} {a / b if b else float('nan'):>7.3f}")

    line("step_time_s", est.step_time_s, meas["step_time_s"])
    line("peak_mem_bytes", est.peak_mem_bytes, meas["peak_mem_bytes"])
    split = out["peak_mem_split"]
    if split["model"]["measured"] is not None:
        line("  of it model", split["model"]["predicted"], split["model"]["measured"])
        line("  of it process", split["process"]["predicted"], split["process"]["measured"])
    mib = lambda x: "?" if x is None else f"{x / 2**20:,.0f} MiB"  # noqa: E731
    print(f"peak memory: model {mib(split['model']['predicted'])} predicted / {mib(split['model']['measured'])} "
          f"measured; process overhead {mib(split['process']['measured'])} (the planner reserves "
          f"{mib(split['process']['predicted'])}: device.reserved_gib)")
    for d, v in out["comm_bytes"].items():
        line(f"comm_bytes.{d}", v["predicted"], v["measured"])
    return 0


def _memory_split(est: Estimate, meas: dict) -> dict:
    """Peak memory as what the planner models (parameters, gradients, optimizer state,
    activations: its peak less ``reserved``) and what the process holds beyond it (the
    planner's ``reserved``; measured: the process before its model was built)."""
    reserved = est.memory.get("reserved", 0.0)
    base = meas.get("process_base_bytes")
    return {"model": {"predicted": est.peak_mem_bytes - reserved,
                      "measured": None if base is None else meas["peak_mem_bytes"] - base},
            "process": {"predicted": reserved, "measured": base}}


# --------------------------------------------------------------------------- simulate


def add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="predict one layout (the config's [parallel]) in detail")
    p.add_argument("config", help="TOML config whose [model], [train] and [parallel] are predicted")
    p.add_argument("--cluster", required=True, help=f"the cluster to predict on: {presets_help()}")
    p.add_argument("--devices", type=int, default=None, help="use this many devices of the cluster")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object (times, memory, collectives, events)")
    p.add_argument("--png", default=None, help="write the pipeline timeline as a PNG here")
    f = p.add_argument_group("failures (docs/resilience.md): expected goodput with and without train.live_recovery")
    f.add_argument("--mtbf-node-h", type=float, default=None, help="mean time between failures of one node, hours")
    f.add_argument("--restart-s", type=float, default=600.0, help="a whole-job restart incl. checkpoint reload")
    f.add_argument("--replace-s", type=float, default=300.0, help="one replica group restarted or swapped")
    f.add_argument("--save-s", type=float, default=30.0, help="one checkpoint save (blocking part)")
    f.add_argument("--replicas", type=int, default=None,
                   help="failure domains under live recovery (default: the layout's dp_replicate)")


def failure_report(args, est, layout, cluster) -> dict | None:
    """``goodput`` of the layout at ``--mtbf-node-h``, with and without live recovery; the
    state transfer a rejoin costs is this rank's parameters and optimizer state over its
    inter-node link."""
    if args.mtbf_node_h is None:
        return None
    transfer_s = (est.param_bytes + est.optimizer_bytes) / (cluster.inter_node_GBps * 1e9)
    fm = FailureModel(args.mtbf_node_h, restart_s=args.restart_s, save_s=args.save_s, replace_s=args.replace_s,
                      transfer_s=transfer_s)
    return goodput(cluster.nodes, args.replicas or layout.dp_replicate, est.step_time_s, fm)


def run_simulate(args) -> int:

    cfg = load_config(args.config, args.set)
    cluster = load_cluster(args.cluster, devices=args.devices)
    w = workload_from_config(cfg, cluster)
    layout = layout_from_config(cfg, cluster.world_size)
    est, events = simulate(w, cluster, layout)
    if args.png:

        draw_timeline(events, args.png, title=f"{layout.short()} on {cluster.name} (simulated)")
    out = result_json(est, events, makespan(events))
    failures = failure_report(args, est, layout, cluster)
    if failures is not None:
        out["goodput"] = failures
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{layout.short()} on {cluster.name} ({cluster.world_size} devices)")
    print(f"step {est.step_time_s:.4g} s   MFU {100 * est.mfu:.1f}%   {est.tflops_per_device:.3g} TFLOP/s/device   "
          f"peak memory {_gib(est.peak_mem_bytes)} GiB ({'fits' if est.fits else 'does NOT fit'})")
    print("time (s):   " + "  ".join(f"{k} {v:.4g}" for k, v in est.time.items()))
    print("memory GiB: " + "  ".join(f"{k} {_gib(v)}" for k, v in est.memory.items()))
    print("per rank: " + "  ".join(f"{k} {_gib(getattr(est, k))} GiB" for k in
                                   ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")))
    print("collectives per step (rank 0): " + "  ".join(f"{k} {v['count']} calls {v['bytes']:.4g} B"
                                                          for k, v in est.collectives.items()))
    if failures is not None:
        print(failures_line(failures, args.mtbf_node_h))
    if args.png:
        print(f"timeline: {args.png}")
    return 0


add_parser = {"plan": add_plan_parser, "simulate": add_simulate_parser}
run = {"plan": run_plan, "simulate": run_simulate}
