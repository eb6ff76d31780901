"""Draw a pipeline schedule as a PNG timeline: one row per stage (rank), time across.

Used for measured runs (``meshfold timeline RUN_DIR`` reads the events the pipeline
executor logs) and for predicted schedules (the planner's simulator and
``meshfold timeline --schedule ...`` pass simulated events).

An event is a dict ``{"stage": int, "chunk": int, "mb": int, "kind": "F"|"B"|"W",
"start": float, "end": float}`` with times in seconds. ``stage`` is the row (the pipeline
rank), ``chunk`` the model chunk on that rank (virtual stage; 0 without interleaving).
F is a forward, B a backward (input gradient, or the whole backward when not split),
W a weight-gradient pass (zero-bubble schedules).
"""

from __future__ import annotations

from pathlib import Path

from meshfold.schedule import bubble_fractions, microbatch_problem, schedule_actions, simulate

# What the executor appends each logged step (``Pipeline._log_events``), one JSON line a step.
TIMELINE_FILE = "pipeline_timeline.jsonl"

# Forward blue, backward green, weight-gradient orange; later chunks drawn darker.
COLORS = {"F": ("#9ecae1", "#3182bd"), "B": ("#a1d99b", "#31a354"), "W": ("#fdd0a2", "#e6550d")}


def _color(kind: str, chunk: int, chunks: int) -> str:
    light, dark = COLORS.get(kind, ("#dddddd", "#888888"))
    return dark if chunks > 1 and chunk % 2 == 1 else light


def draw_timeline(events: list[dict], path: str | Path, title: str = "") -> Path:
    """Write a PNG of ``events`` to ``path`` and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not events:
        raise ValueError("draw_timeline: no events to draw")
    t0 = min(e["start"] for e in events)
    stages = sorted({e["stage"] for e in events})
    chunks = max(e.get("chunk", 0) for e in events) + 1
    span = max(e["end"] for e in events) - t0
    unit, scale = ("ms", 1e3) if span < 10 else ("s", 1.0)
    n_blocks = max(1, len(events) // max(1, len(stages)))
    fig, ax = plt.subplots(figsize=(min(24, 4 + 0.35 * n_blocks), 0.6 * len(stages) + 1.4))
    for e in events:
        row = stages.index(e["stage"])
        start, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        ax.barh(row, width, left=start, height=0.8, color=_color(e["kind"], e.get("chunk", 0), chunks),
                edgecolor="black", linewidth=0.4)
        label = str(e["mb"]) if chunks == 1 else f"{e['mb']}.{e.get('chunk', 0)}"
        ax.text(start + width / 2, row, label, ha="center", va="center", fontsize=6, clip_on=True)
    bubbles = bubble_fractions(events)
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s}\nbubble {bubbles.get(s, 0):.0%}" for s in stages], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    kinds = sorted({e["kind"] for e in events}, key="FBW".index)
    names = {"F": "forward", "B": "backward (input grad)" if "W" in kinds else "backward", "W": "weight grad"}
    ax.legend(handles=[Patch(color=COLORS[k][0], label=names[k]) for k in kinds], loc="upper right",
              fontsize=7, ncol=len(kinds))
    mean = sum(bubbles.values()) / max(1, len(bubbles))
    ax.set_title(f"{title}  (mean bubble {mean:.1%})" if title else f"mean bubble {mean:.1%}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    p = sub.add_parser("timeline", help="draw a pipeline schedule as a PNG (a run's measured step, or a schedule)")
    p.add_argument("run_dir", nargs="?", help="run directory of a pipeline-parallel training run")
    p.add_argument("--step", type=int, default=0, help="which logged step (default: the last)")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/plots/timeline-step-N.png)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zbv"),
                   help="draw a schedule's unit-cost simulation instead of a run")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--virtual", type=int, default=2, help="chunks per rank for interleaved")


def run(args) -> int:
    import json

    from meshfold.config import ConfigError

    if args.schedule:
        problem = microbatch_problem(args.schedule, args.pp, args.microbatches)
        if problem:
            raise ConfigError(f"meshfold timeline --microbatches: {problem}")
        virtual = args.virtual if args.schedule == "interleaved" else 1
        events = simulate(args.schedule, schedule_actions(args.schedule, args.pp, virtual, args.microbatches))
        out = args.out or f"timeline-{args.schedule}-pp{args.pp}-m{args.microbatches}.png"
        title = f"{args.schedule}, pp {args.pp}, {args.microbatches} micro-batches (simulated, unit costs)"
        print(draw_timeline(events, out, title))
        return 0
    if not args.run_dir:
        raise ConfigError("meshfold timeline: give RUN_DIR or --schedule")
    path = Path(args.run_dir) / TIMELINE_FILE
    if not path.exists():
        raise ConfigError(f"{path} does not exist; train with parallel.pp > 1 to log pipeline timings")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    chosen = [r for r in records if r["step"] == args.step] if args.step else records[-1:]
    if not chosen:
        raise ConfigError(f"step {args.step} is not in {path}; logged steps: {records[0]['step']}..{records[-1]['step']}")
    rec = chosen[-1]
    out = args.out or Path(args.run_dir) / "plots" / f"timeline-step-{rec['step']}.png"
    title = (f"{rec['schedule']}, pp {rec['pp']}, {rec['microbatches']} micro-batches, "
             f"step {rec['step']} (measured)")
    print(draw_timeline(rec["events"], out, title))
    return 0
