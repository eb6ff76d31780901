"""Compatibility: the timeline's file and drawing moved to ``parallel/pp/timeline_plot.py``;
kept until the planner's command line imports it from there."""

from __future__ import annotations

from meshfold.parallel.pp.timeline_plot import COLORS, TIMELINE_FILE, draw_timeline

__all__ = ["COLORS", "TIMELINE_FILE", "draw_timeline"]
