"""A picture of a wandb workspace (``launch.tools.wandb_dashboard``) drawn from its spec, without a
server: one row of boxes per section, each box a panel with its title, kind, metrics and
grouping, and a line on the runs (filter, baseline, runs table columns) on top."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

COLUMNS = 5  # panels per row
_BOX_W, _BOX_H, _GAP, _HEAD = 3.2, 1.55, 0.15, 0.45  # inches


def panel_lines(panel: Any) -> tuple[str, list[str]]:
    """(title, detail lines) of one panel as the picture shows it."""
    if isinstance(panel, wr.MarkdownPanel):
        return "Note", textwrap.wrap(panel.markdown, 52)[:6]
    kind = "line plot" if isinstance(panel, wr.LinePlot) else "bar chart of the run summaries"
    metrics = [str(m) for m in (panel.y if isinstance(panel, wr.LinePlot) else panel.metrics)]
    regex = getattr(panel, "metric_regex", None)
    lines = [kind] + (metrics if len(metrics) <= 2 else [f"{metrics[0]} … ({len(metrics)} metrics)"])
    if regex:
        lines += ["every metric matching", f"  {regex}"]
    lines.append(f"grouped by {panel.groupby.name}: {panel.groupby_aggfunc}, {panel.groupby_rangefunc} band"
                 if panel.groupby is not None else "one line per run")
    return panel.title or "", lines


def runs_line(workspace: ws.Workspace) -> str:
    rs = workspace.runset_settings
    columns = ", ".join(c.split(":", 1)[1].replace(".value", "") for c in rs.pinned_columns)
    return (f"{workspace.entity}/{workspace.project}: runs where {rs.filters or 'all runs'}; "
            f"baseline run: {rs.baseline_run or 'the bf16 run with the lowest seed (looked up when saved)'}\n"
            f"runs table: {columns}")


def draw(workspace: ws.Workspace, path: Path) -> Path:
    """Write the picture of ``workspace`` to ``path`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    rows = [math.ceil(len(s.panels) / COLUMNS) for s in workspace.sections]
    width = COLUMNS * (_BOX_W + _GAP) + _GAP
    height = 0.9 + sum(_HEAD + r * (_BOX_H + _GAP) for r in rows)
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set(xlim=(0, width), ylim=(0, height))
    ax.axis("off")
    ax.text(_GAP, height - 0.1, workspace.name, fontsize=14, weight="bold", va="top")
    ax.text(_GAP, height - 0.42, runs_line(workspace), fontsize=8, va="top", color="0.3")
    y = height - 0.9
    for section, n_rows in zip(workspace.sections, rows):
        ax.text(_GAP, y - 0.12, section.name, fontsize=11, weight="bold", va="top", color="tab:blue")
        y -= _HEAD
        for i, panel in enumerate(section.panels):
            x0 = _GAP + (i % COLUMNS) * (_BOX_W + _GAP)
            y0 = y - (i // COLUMNS + 1) * (_BOX_H + _GAP) + _GAP
            ax.add_patch(FancyBboxPatch((x0, y0), _BOX_W, _BOX_H, boxstyle="round,pad=0,rounding_size=0.06",
                                        facecolor="0.97", edgecolor="0.6", linewidth=0.8))
            title, lines = panel_lines(panel)
            title_lines = textwrap.wrap(title, 46, break_on_hyphens=False)[:2]
            ax.text(x0 + 0.08, y0 + _BOX_H - 0.08, "\n".join(title_lines), fontsize=8, weight="bold", va="top")
            ax.text(x0 + 0.08, y0 + _BOX_H - 0.45, "\n".join(lines), fontsize=6.5, va="top",
                    family="monospace", color="0.25")
        y -= n_rows * (_BOX_H + _GAP)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
