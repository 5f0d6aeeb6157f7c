"""launch/tools/wandb_dashboard.py (the wandb workspace, built offline) and its command
(``compare_runs.py --wandb-dashboard``): its panels plot metrics the runner logs, group by the
config the runner logs, filter by the experiment; saving goes through a stand-in server."""

from __future__ import annotations

import base64
import re
import time
from types import SimpleNamespace

import pytest
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws
from omegaconf import OmegaConf

from launch.run import numerics_log
from launch.run.run_summary import RECIPE_CONFIG, imbalance_metric, parse_numerics_metric
from launch.titan.metrics import RecipeMetricsProcessor, RunHistory
from launch.tools import wandb_dashboard as board
from launch.tools.compare_runs import main as compare_main
from mxfp8_ep.telemetry import wire_stats
from mxfp8_ep.config import LEGS, NUMERICS_STATS
from tests.figures import saved_figures
from tests.hydra_compose import compose_cfg


@pytest.fixture(scope="module")
def logged() -> set[str]:
    """Every metric name the runner logs to wandb, from the runner's own code: one log window
    of ``RecipeMetricsProcessor.log`` as on a GPU (TFLOPS known) with bytes on every leg and the
    routing telemetry at EP 2, 4 and 8, a validation, and the numerics telemetry of two MoE
    layers on every leg."""
    from torchtitan.tools.utils import NoColor

    names: set[str] = set()
    mem = SimpleNamespace(max_active_gib=1.0, max_active_pct=1.0, max_reserved_gib=1.0, max_reserved_pct=1.0,
                          num_alloc_retries=0, num_ooms=0)
    proc = object.__new__(RecipeMetricsProcessor)
    proc.__dict__.update(
        logger=SimpleNamespace(log=lambda metrics, step: names.update(metrics)),
        parallel_dims=SimpleNamespace(world_size=2, non_data_parallel_size=1),
        device_memory_monitor=SimpleNamespace(get_peak_stats=lambda: mem, reset_peak_stats=lambda: None),
        color=NoColor(), num_flops_per_token=10, gpu_peak_flops=1e12, _flops_known=True,
        ntokens_since_last_log=100, data_loading_times=[0.01], time_last_log=time.perf_counter() - 1.0,
        _last_logged_step=0, _first_window_done=False, _train_time=0.0, _train_steps=0, total_steps=10,
        history=RunHistory(), model_parts=[], console=None, a2a_name="mxfp8_all",
        routing=SimpleNamespace(collect=lambda: {imbalance_metric(ep): 1.5 for ep in (2, 4, 8)}))
    wire_stats.reset()
    for leg in LEGS:
        wire_stats.record(leg, 1000)
    proc.log(1, global_avg_loss=6.0, global_max_loss=6.5, grad_norm=1.0)
    proc.log_validation(6.1, step=1)
    names.update(numerics_log.metrics_of({(layer, leg): dict.fromkeys(NUMERICS_STATS, 0.5)
                                          for layer in (1, 3) for leg in LEGS}))
    return names


def never_logged(workspace: ws.Workspace, logged: set[str]) -> list[str]:
    """The metrics (and metric regexes) ``workspace`` plots that no logged metric answers, and
    its runs table's summary columns that are no logged metric."""
    missing = []
    for _, title, metrics, regex in board.plotted(workspace):
        missing += [f"{title}: {m}" for m in metrics if m not in logged]
        if regex and not any(re.fullmatch(regex, name) for name in logged):
            missing.append(f"{title}: /{regex}/")
    columns = [c.split(":", 1)[1] for c in workspace.runset_settings.pinned_columns if c.startswith("summary:")]
    return missing + [f"runs table: {c}" for c in columns if c not in logged]


def test_every_plotted_metric_is_logged_by_the_runner(logged):
    workspace = board.dashboard("team", "proj", "parity")
    assert never_logged(workspace, logged) == []
    # every statistic of every leg has a panel, and every per-layer regex matches the
    # per-layer series of its leg and statistic only
    plotted = {m for _, _, metrics, _ in board.plotted(workspace) for m in metrics}
    wide = {n for n in logged if (p := parse_numerics_metric(n)) and p[0] is None}
    assert wide <= plotted and len(wide) == len(LEGS) * len(NUMERICS_STATS)
    for _, title, _, regex in board.plotted(workspace):
        if regex:
            matched = {parse_numerics_metric(n) for n in logged if re.fullmatch(regex, n)}
            leg = title.split(":")[0]
            assert matched == {(1, leg, "rel_l2_err"), (3, leg, "rel_l2_err")}, title


def test_a_metric_nobody_logs_is_caught(logged):
    workspace = board.dashboard("team", "proj")
    workspace.sections[0].panels.append(wr.LinePlot(title="typo", y=["val/los"]))
    workspace.sections[-1].panels.append(wr.LinePlot(title="regex", metric_regex=r"numerics/layer\d+/x/y"))
    assert never_logged(workspace, logged) == ["typo: val/los", "regex: /numerics/layer\\d+/x/y/"]


def test_sections_and_grouping_by_the_logged_a2a_preset():
    workspace = board.dashboard("team", "proj", "parity")
    assert [s.name for s in workspace.sections] == (
        ["Loss by a2a mode", "Δ loss vs bf16", "Throughput and all-to-all bytes per arm"]
        + [f"MXFP8 numerics: {leg}" for leg in LEGS])
    charts = [p for s in workspace.sections for p in s.panels if isinstance(p, (wr.LinePlot, wr.BarPlot))]
    grouped = {p.title: p.groupby.name for p in charts if p.groupby is not None}
    assert set(grouped.values()) == {board.A2A_MODE}
    assert "Training loss by a2a mode (mean over seeds, min-max band)" in grouped
    assert "Training loss of each run vs the bf16 baseline" not in grouped  # one line per run
    # the config keys name fields of the recipe config the runner logs under RECIPE_CONFIG
    cfg = compose_cfg("a2a=mxfp8_all", "training.seed=3")
    for key, value in ((board.A2A_MODE, "mxfp8_all"), (board.SEED, 3), (board.MODEL, cfg.model.name)):
        top, field = key.split(".", 1)
        assert top == RECIPE_CONFIG and OmegaConf.select(cfg, field) == value


def test_filter_by_group_and_baseline_run():
    spec = board.dashboard("team", "proj", "parity", baseline_run="abc123")._to_model()
    (runset,) = spec.spec.section.run_sets
    (only,) = runset.filters["filters"]  # filterV2: a flat list of conditions
    assert (only["key"], only["op"], only["value"]) == ({"section": "run", "name": "group"}, "=", "parity")
    assert base64.b64decode(runset.baseline_run_id).decode() == "Run:v1:abc123:proj:team"
    assert "config:recipe.value.a2a.name" in runset.run_feed.column_order
    (runset,) = board.dashboard("team", "proj")._to_model().spec.section.run_sets
    assert runset.filters["filters"] == [] and runset.baseline_run_id is None


def test_experiment_names_with_symbols(capsys):
    """wandb refuses symbols in a workspace's name (they are dropped there); a group name its
    filter would change is refused (exit 2), not filtered wrongly."""
    workspace = board.dashboard("team", "proj", "moe+ep 2")
    assert workspace.name == "mxfp8-ep: moeep 2 by a2a mode"
    (runset,) = workspace._to_model().spec.section.run_sets
    assert runset.filters["filters"][0]["value"] == "moe+ep 2"
    for group in ("lr=1e-3", "it's"):
        with pytest.raises(ValueError, match="cannot filter on this name"):
            board.dashboard("team", "proj", group)
    assert compare_main(["--wandb-dashboard", "team/proj", "--group", "lr=1e-3"]) == 2
    assert capsys.readouterr().err == ("compare_runs: --group 'lr=1e-3': wandb-workspaces cannot filter on this "
                                       "name (it writes 'lr==1e-3'); choose the runs in the workspace instead\n")


def run(run_id: str, a2a: str, seed, name: str = "") -> SimpleNamespace:
    return SimpleNamespace(id=run_id, name=name or run_id,
                           config={RECIPE_CONFIG: {"a2a": {"name": a2a}, "training": {"seed": seed}}})


def test_baseline_is_the_bf16_run_with_the_lowest_seed():
    runs = [run("m0", "mxfp8", 0), run("b1", "bf16", 1), run("b0", "bf16", 0), run("bn", "bf16", None)]
    assert board.baseline_run_id(runs) == "b0"
    assert board.baseline_run_id([run("m0", "mxfp8", 0), SimpleNamespace(id="x", name="x", config={})]) is None


@pytest.fixture
def server(monkeypatch):
    """A stand-in wandb server: the runs ``wandb.Api().runs`` lists, and the workspaces saved."""
    import wandb

    state = SimpleNamespace(runs=[], queries=[], saved=[])

    class Api:
        client = SimpleNamespace(app_url="https://wandb.example")

        def runs(self, path, filters=None):
            state.queries.append((path, filters))
            return state.runs

    def save(self):
        state.saved.append(self)
        self._internal_name = "nw-view"
        return self

    monkeypatch.setattr(wandb, "Api", Api)
    monkeypatch.setattr(ws.Workspace, "save", save)
    return state


def test_command_saves_the_workspace_with_its_baseline(server, capsys):
    server.runs = [run("m0", "mxfp8_all", 0), run("b0", "bf16", 0)]
    assert compare_main(["--wandb-dashboard", "team/proj", "--group", "parity"]) == 0
    assert server.queries == [("team/proj", {"group": "parity"})]
    (saved,) = server.saved
    assert (saved.entity, saved.project, saved.runset_settings.baseline_run) == ("team", "proj", "b0")
    out, err = capsys.readouterr()
    assert out.startswith("saved the workspace: https://wandb.example/team/proj?nw=") and err == ""


def test_command_without_a_bf16_run_says_so(server, capsys):
    server.runs = [run("m0", "mxfp8_all", 0)]
    assert compare_main(["--wandb-dashboard", "team/proj"]) == 0
    assert server.saved[0].runset_settings.baseline_run is None
    assert capsys.readouterr().err == "compare_runs: no bf16 run in team/proj: the workspace has no baseline run\n"


def test_command_when_the_server_refuses(monkeypatch, capsys):
    import wandb

    def refuse(*args):
        raise wandb.errors.CommError("server said no")

    monkeypatch.setattr(board, "save_dashboard", refuse)
    assert compare_main(["--wandb-dashboard", "team/proj"]) == 1
    assert capsys.readouterr().err == "compare_runs: could not save the workspace to team/proj: server said no\n"


def test_command_without_a_wandb_login_points_at_what_works_offline(monkeypatch, capsys):
    import wandb

    def no_key(*args):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(board, "save_dashboard", no_key)
    assert compare_main(["--wandb-dashboard", "team/proj"]) == 2
    assert capsys.readouterr().err == (
        "compare_runs: --wandb-dashboard team/proj saves the workspace on a wandb server, which needs `wandb login` "
        "(or WANDB_API_KEY) on this machine (No API key configured. Use `wandb login` to log in.); without a login, "
        "--preview <png> draws the workspace and `python launch/compare_runs.py <sweep dir>` compares the offline "
        "runs\n")


@pytest.mark.parametrize("argv", [
    ["--wandb-dashboard", "proj"],
    ["--wandb-dashboard", "team/proj/x"],
    ["--wandb-dashboard", "team/proj", "some/run"],
    ["some/run", "--group", "parity"],
])
def test_command_mistakes_are_refused(argv, capsys):
    assert compare_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("compare_runs: ") and err.count("\n") == 1


def test_preview_draws_every_panel(tmp_path, capsys):
    png = tmp_path / "d" / "dashboard.png"
    with saved_figures() as figs:
        assert compare_main(["--wandb-dashboard", "team/proj", "--group", "parity", "--preview", str(png)]) == 0
    assert capsys.readouterr().out == f"wrote {png}\n"
    ax = figs["dashboard.png"].axes[0]
    words = " ".join(" ".join(t.get_text() for t in ax.texts).split())  # wrapped lines joined
    workspace = board.dashboard("team", "proj", "parity")
    assert len(ax.patches) == sum(len(s.panels) for s in workspace.sections)  # a box per panel
    for section in workspace.sections:
        assert section.name in words
    for _, title, metrics, regex in board.plotted(workspace):
        assert title in words and all(m in words for m in metrics[:1]) and (regex or "") in words
