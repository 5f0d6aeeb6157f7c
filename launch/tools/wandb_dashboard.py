"""A saved wandb workspace that compares the runs of a project (or of one experiment) by a2a
mode, built with ``wandb_workspaces``:

    python launch/compare_runs.py --wandb-dashboard <entity>/<project> [--group <experiment>]

Sections: the training and validation loss by a2a mode (mean over seeds, min–max band); each run
against the bf16 baseline (the workspace's baseline run: the runs table shows every run's final
loss and validation loss as a delta to it, the line plots draw it apart); tokens/s and
all-to-all bytes per step per arm (and per leg); the MXFP8 numerics telemetry, one section per
leg. Every metric is named from ``launch.run.run_summary``, the names the runner logs.

:func:`dashboard` builds the workspace offline (a pure function of its arguments);
:func:`save_dashboard` asks the server for the baseline run and saves it (needs ``wandb login``);
:func:`command` is the command line's part (``--preview`` draws the workspace, no server).
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Optional

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from launch.run.run_summary import (A2A_BYTES, BASELINE, LOSS, NUMERICS_PREFIX, RECIPE_CONFIG, TOKENS_PER_S_GLOBAL,
                                    VAL_LOSS, a2a_leg_metric, numerics_metric)
from mxfp8_ep.config import LEGS, NUMERICS_STATS

# wandb config keys (the recipe config as the runner logs it) the panels group by and the runs
# table shows.
A2A_MODE = f"{RECIPE_CONFIG}.a2a.name"
SEED = f"{RECIPE_CONFIG}.training.seed"
MODEL = f"{RECIPE_CONFIG}.model.name"

# Per seed group: the mean line and the min–max band.
_BY_A2A = {"groupby": wr.Config(A2A_MODE), "groupby_aggfunc": "mean", "groupby_rangefunc": "minmax"}
# Statistics drawn together in one panel (the exponent range's two ends).
_PAIRED = {"scale_exp_min": "scale_exp_max"}


def per_layer_regex(leg: str, stat: str) -> str:
    """The metric regex of one statistic of one leg in every MoE layer
    (``numerics/layer<i>/<leg>/<stat>``, ``launch.run.run_summary.numerics_metric``)."""
    return rf"{re.escape(NUMERICS_PREFIX)}layer\d+/{re.escape(leg)}/{re.escape(stat)}"


def _config_column(key: str) -> str:
    """The runs table's column of a nested config key (wandb keeps each top-level config
    entry under ``value``)."""
    top, rest = key.split(".", 1)
    return f"config:{top}.value.{rest}"


def workspace_name(group: Optional[str], project: str) -> str:
    """The workspace's name, without the symbols wandb refuses in one (Unicode categories S*,
    e.g. the ``=`` of an experiment named after an override)."""
    name = f"mxfp8-ep: {group or project} by a2a mode"
    return "".join(c for c in name if not unicodedata.category(c).startswith("S"))


def _loss_section() -> ws.Section:
    return ws.Section(name="Loss by a2a mode", is_open=True, panels=[
        wr.LinePlot(title="Training loss by a2a mode (mean over seeds, min-max band)", y=[LOSS], **_BY_A2A),
        wr.LinePlot(title="Validation loss by a2a mode (mean over seeds, min-max band)", y=[VAL_LOSS], **_BY_A2A),
    ])


def _baseline_section() -> ws.Section:
    return ws.Section(name="Δ loss vs bf16", is_open=True, panels=[
        wr.MarkdownPanel(markdown=(
            f"The workspace's baseline run is the {BASELINE} run with the lowest seed: the runs table "
            f"shows each run's final loss and validation loss as a delta to it, and these plots draw it "
            f"apart. The per-step difference with the parity bound: `python launch/compare_runs.py "
            f"<sweep dir>`.")),
        wr.LinePlot(title="Training loss of each run vs the bf16 baseline", y=[LOSS]),
        wr.LinePlot(title="Validation loss of each run vs the bf16 baseline", y=[VAL_LOSS]),
        wr.BarPlot(title="Final validation loss by a2a mode", metrics=[VAL_LOSS], **_BY_A2A),
    ])


def _throughput_section() -> ws.Section:
    return ws.Section(name="Throughput and all-to-all bytes per arm", is_open=True, panels=[
        wr.BarPlot(title="Tokens/s, all ranks (mean after the first window)", metrics=[TOKENS_PER_S_GLOBAL],
                   **_BY_A2A),
        wr.BarPlot(title="All-to-all bytes per step", metrics=[A2A_BYTES], **_BY_A2A),
        wr.BarPlot(title="All-to-all bytes per step, per leg", metrics=[a2a_leg_metric(leg) for leg in LEGS],
                   **_BY_A2A),
        wr.LinePlot(title="Tokens/s, all ranks, by a2a mode", y=[TOKENS_PER_S_GLOBAL], **_BY_A2A),
    ])


def _numerics_section(leg: str) -> ws.Section:
    panels: list[Any] = []
    for stat in NUMERICS_STATS:
        if stat in _PAIRED.values():
            continue
        stats = [stat] + ([_PAIRED[stat]] if stat in _PAIRED else [])
        title = " and ".join(stats)
        panels.append(wr.LinePlot(title=f"{leg}: {title} (model-wide)",
                                  y=[numerics_metric(leg, s) for s in stats], **_BY_A2A))
    panels.append(wr.LinePlot(title=f"{leg}: rel_l2_err per MoE layer",
                              metric_regex=per_layer_regex(leg, "rel_l2_err")))
    return ws.Section(name=f"MXFP8 numerics: {leg}", panels=panels)


def _group_filter(group: str) -> ws.And:
    """The runs filter ``Group == group``. wandb-workspaces writes a filter through its own
    expression syntax and reads it back, which changes some values (``a=b`` becomes ``a==b``);
    such a group is refused rather than filtered wrongly."""
    where = ws.And(ws.Metric("Group") == group)
    try:
        probe = ws.Workspace(entity="e", project="p", runset_settings=ws.RunsetSettings(filters=where))
        (written,) = probe._to_model().spec.section.run_sets[0].filters["filters"]
    except (SyntaxError, ValueError):
        written = {}
    if written.get("value") != group:
        raise ValueError(f"--group {group!r}: wandb-workspaces cannot filter on this name (it writes "
                         f"{written.get('value')!r}); choose the runs in the workspace instead")
    return where


def dashboard(entity: str, project: str, group: Optional[str] = None,
              baseline_run: Optional[str] = None) -> ws.Workspace:
    """The workspace, offline: the runs of ``group`` (a wandb group is an experiment; all runs
    of the project without one), ``baseline_run`` (a run id) as the baseline of the runs
    table's deltas and the plots. ValueError: a group name wandb-workspaces cannot filter on."""
    summary_columns = [f"summary:{m}" for m in (LOSS, VAL_LOSS, TOKENS_PER_S_GLOBAL, A2A_BYTES)]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=workspace_name(group, project),
        sections=[_loss_section(), _baseline_section(), _throughput_section()]
        + [_numerics_section(leg) for leg in LEGS],
        runset_settings=ws.RunsetSettings(
            filters=_group_filter(group) if group else "",
            pinned_columns=[_config_column(MODEL), _config_column(A2A_MODE), _config_column(SEED)]
            + summary_columns,
            baseline_run=baseline_run,
        ),
    )


def plotted(workspace: ws.Workspace) -> list[tuple[str, str, list[str], Optional[str]]]:
    """(section, panel title, metrics, metric regex) of every chart panel of ``workspace``."""
    out = []
    for section in workspace.sections:
        for panel in section.panels:
            if isinstance(panel, wr.LinePlot):
                out.append((section.name, panel.title, [str(m) for m in panel.y], panel.metric_regex))
            elif isinstance(panel, wr.BarPlot):
                out.append((section.name, panel.title, [str(m) for m in panel.metrics], None))
    return out


# ------------------------------------------------------------------------------ server
def _config_value(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def baseline_run_id(runs: Iterable[Any]) -> Optional[str]:
    """The id of the bf16 run with the lowest seed among ``runs`` (``wandb.Api`` runs: ``id``,
    ``name`` and ``config``), None without one."""
    bf16 = [r for r in runs if _config_value(r.config, A2A_MODE) == BASELINE]
    if not bf16:
        return None

    def order(r: Any) -> tuple:
        seed = _config_value(r.config, SEED)
        return (seed is None, seed if seed is not None else 0, r.name or "")

    return min(bf16, key=order).id


def save_dashboard(entity: str, project: str, group: Optional[str]) -> tuple[ws.Workspace, Optional[str]]:
    """Look up the baseline run on the server, save the workspace there; returns it and the
    baseline's id (None: no bf16 run, the workspace has no baseline)."""
    import wandb

    filters = {"group": group} if group else None
    baseline = baseline_run_id(wandb.Api().runs(f"{entity}/{project}", filters=filters))
    workspace = dashboard(entity, project, group, baseline)
    workspace.save()
    return workspace, baseline


# ------------------------------------------------------------------------------ command
def _say(message: str) -> None:
    print(f"compare_runs: {message}", file=sys.stderr)


def command(target: str, group: Optional[str], preview: Optional[str]) -> int:
    """``compare_runs.py --wandb-dashboard TARGET [--group] [--preview PNG]``: save the
    workspace, or draw it into ``preview``. Exit code: 0, 1 (the server did not take it), 2 (a
    mistake in the arguments, reported before anything is asked of the server, or no wandb login)."""
    import wandb

    from launch.tools import dashboard_preview

    entity, _, project = target.partition("/")
    if not entity or not project or "/" in project:
        _say(f"--wandb-dashboard {target}: give ENTITY/PROJECT, e.g. my-team/mxfp8-ep")
        return 2
    try:
        spec = dashboard(entity, project, group)  # saving builds it again, with the baseline run
    except ValueError as e:
        _say(str(e))
        return 2
    if preview is not None:
        try:
            Path(preview).parent.mkdir(parents=True, exist_ok=True)
            print(f"wrote {dashboard_preview.draw(spec, Path(preview))}")
        except OSError as e:
            _say(f"--preview {preview}: {e.strerror}")
            return 2
        return 0
    try:
        workspace, baseline = save_dashboard(entity, project, group)
    except wandb.errors.UsageError as e:
        if "API key" not in str(e):
            raise
        _say(f"--wandb-dashboard {target} saves the workspace on a wandb server, which needs `wandb login` (or "
             f"WANDB_API_KEY) on this machine ({e}); without a login, --preview <png> draws the workspace and "
             f"`python launch/compare_runs.py <sweep dir>` compares the offline runs")
        return 2
    except (wandb.errors.Error, OSError, ValueError) as e:
        _say(f"could not save the workspace to {target}: {e}")
        return 1
    if baseline is None:
        _say(f"no {BASELINE} run in {target}" + (f" group {group}" if group else "")
             + ": the workspace has no baseline run")
    print(f"saved the workspace: {workspace.url}")
    return 0
