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

from meshfold.schedules.simulate import bubble_fractions

# What the executor appends each logged step (``Pipeline.log_events``, executor.py), one JSON line a step.
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
