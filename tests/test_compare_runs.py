"""launch/run/wandb_offline.py (reading .wandb files, merging a resumed run's launches) and
launch/compare_runs.py (pairing, the table, the plots), on runs written here – no training."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.run.run_summary import RunSummary
from launch.run.wandb_offline import find_runs, iter_records, read_run, read_runs
from launch.tools.compare_runs import collect, compare, format_table, throughput_verdicts, verdicts
from launch.tools.compare_runs import main as compare_main
from tests.figures import axes_titled, lines_of, saved_figures, spans_of

WRITE_RUN = """
import sys, wandb
d, name, a2a, n, loss0, nbytes = sys.argv[1:7]
first = int(sys.argv[7]) if len(sys.argv) > 7 else 1
run_id = sys.argv[8] if len(sys.argv) > 8 else None
run = wandb.init(project="mxfp8-ep", dir=d, name=name, group="g", tags=["t1"], id=run_id,
                 resume="allow" if run_id else None,
                 config={"recipe": {"a2a": {"name": a2a}, "model": {"name": "tiny_llama4"},
                                    "parallelism": {"nodes": 1, "procs_per_node": 2, "ep": 2}},
                         "blob": "x" * 40000})
for step in range(first, int(n) + 1):
    wandb.log({"loss_metrics/global_avg_loss": float(loss0) / step, "throughput(tps)": 100.0,
               "throughput/global_tps": 200.0, "time_metrics/end_to_end(s)": 0.5,
               "a2a/bytes_per_step": float(nbytes), "note": "y" * (step % 500)}, step=step)
    if step % 500 == 0:
        wandb.log({"val/loss": float(loss0) / step + 0.5,
                   "numerics/layer1/dispatch_fwd/rel_l2_err": 0.01 * step / 500}, step=step)
wandb.finish()
"""


def write_wandb_run(d: Path, name: str, a2a: str, steps: int, loss0: float, nbytes: float,
                    first: int = 1, run_id: str = "") -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")},
           "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    d.mkdir(parents=True, exist_ok=True)
    args = [str(first), run_id] if run_id else []
    subprocess.run([sys.executable, "-c", WRITE_RUN, str(d), name, a2a, str(steps), str(loss0),
                    str(nbytes), *args], check=True, env=env, timeout=120)


DELTA_TITLE = "Training loss minus the bf16 baseline's"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    write_wandb_run(root / "0_a2a=bf16", "a2a=bf16,x=1", "bf16", 1500, 6.0, 1000.0)
    write_wandb_run(root / "1_a2a=mxfp8", "a2a=mxfp8,x=1", "mxfp8", 1500, 6.3, 760.0)
    return root


def test_reader_reassembles_records_across_blocks(sweep):
    (run_dir,) = find_runs(str(sweep / "0_a2a=bf16"))  # the "latest-run" link is not a 2nd run
    path = next(Path(run_dir).glob("*.wandb"))
    assert path.stat().st_size > 4 * 32768  # many blocks, records split over block ends
    run = read_run(run_dir)
    assert run.name == "a2a=bf16,x=1" and run.group == "g" and run.tags == ["t1"]
    assert run.project == "mxfp8-ep"
    assert run.config["recipe"]["a2a"]["name"] == "bf16" and len(run.config["blob"]) == 40000
    assert [r["_step"] for r in run.history] == list(range(1, 1501))
    assert run.series("loss_metrics/global_avg_loss")[:2] == [6.0, 3.0]
    assert run.history[-1]["note"] == "y" * (1500 % 500)
    assert run.last("a2a/bytes_per_step") == 1000.0
    assert run.exit_code == 0
    assert sum(1 for _ in iter_records(str(path))) > 1500


def test_truncated_file_reads_what_is_there(sweep, tmp_path):
    (run_dir,) = find_runs(str(sweep / "0_a2a=bf16"))
    data = next(Path(run_dir).glob("*.wandb")).read_bytes()
    cut = tmp_path / "cut" / "run-x.wandb"
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) // 2 + 123])  # a run killed mid-write
    run = read_run(str(cut.parent))
    assert 100 < len(run.history) < 1500 and run.exit_code is None


def test_not_a_wandb_file(tmp_path):
    (tmp_path / "run-x.wandb").write_bytes(b"hello world, not wandb")
    with pytest.raises(ValueError, match="not a wandb run file"):
        read_run(str(tmp_path))


def test_resumed_run_launches_merge_into_one_run(tmp_path):
    """Two launches with one run id (a resumed run): one run, history appended in start
    order, the second launch's rows win for the steps both logged."""
    write_wandb_run(tmp_path, "r", "bf16", 5, 10.0, 100.0, first=1, run_id="abc12345")
    write_wandb_run(tmp_path, "r", "bf16", 8, 20.0, 100.0, first=4, run_id="abc12345")
    (run,) = read_runs(str(tmp_path))
    assert run.run_id == "abc12345" and len(run.paths) == 2
    assert [row["_step"] for row in run.history] == list(range(1, 9))
    losses = run.series("loss_metrics/global_avg_loss")
    assert losses[:3] == pytest.approx([10.0, 5.0, 10.0 / 3])
    assert losses[3:] == pytest.approx([20.0 / s for s in range(4, 9)])


def test_launches_named_one_by_one_are_one_run(tmp_path, capsys):
    """A resumed run's offline-run folders given one by one (``<run>/wandb/offline-run-*``):
    one run, its launches merged by step, the comparison written into the run's folder."""
    run = tmp_path / "run"
    write_wandb_run(run, "a2a=bf16", "bf16", 5, 10.0, 100.0, first=1, run_id="res12345")
    write_wandb_run(run, "a2a=bf16", "bf16", 8, 20.0, 100.0, first=4, run_id="res12345")
    launches = sorted(str(p) for p in (run / "wandb").glob("offline-run-*"))
    assert len(launches) == 2
    (c,) = collect(launches)
    assert c.run.wandb_run_id == "res12345" and sorted(c.run.wandb_dirs) == launches
    assert c.run.logged_steps == list(range(1, 9))
    assert c.run.losses == pytest.approx([10.0, 5.0, 10.0 / 3] + [20.0 / s for s in range(4, 9)])
    assert compare_main(list(reversed(launches))) == 0
    assert json.loads((run / "comparison.json").read_text())["runs"][0]["logged_steps"] == list(range(1, 9))
    assert f"wrote {run / 'comparison.json'}" in capsys.readouterr().out


def test_compare_from_wandb_runs(sweep, tmp_path, capsys):
    found = compare(collect([str(sweep)]))
    by = {c.run.a2a: c for c in found}
    assert set(by) == {"bf16", "mxfp8"} and all(c.source == "wandb" for c in found)
    v = by["mxfp8"].vs_baseline
    assert v["baseline"] == "a2a=bf16,x=1"
    assert v["bytes_ratio"] == pytest.approx(0.76)
    assert v["loss_delta"] == pytest.approx(6.3 / 1500 - 6.0 / 1500)
    assert v["tokens_per_s_ratio"] == pytest.approx(1.0)
    bf16 = by["bf16"].run
    assert bf16.tokens_per_s_global == 200.0 and bf16.logged_steps == list(range(1, 1501))
    # validation loss and numerics telemetry, read back from wandb
    assert bf16.val_logged_steps == [500, 1000, 1500] and bf16.final_val_loss == pytest.approx(6.0 / 1500 + 0.5)
    assert bf16.numerics["numerics/layer1/dispatch_fwd/rel_l2_err"] == pytest.approx(
        {"n": 3, "mean": 0.02, "min": 0.01, "max": 0.03, "last": 0.03})
    assert v["val_loss_delta"] == pytest.approx(0.3 / 1500)
    assert bf16.world_size == 2 and bf16.model == "tiny_llama4"
    table = format_table(found)
    assert "a2a MiB/step" in table and "0.760" in table

    out = tmp_path / "cmp.json"
    with saved_figures() as figs:
        assert compare_main([str(sweep), "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs[0]["a2a"] == "bf16" and len(runs[0]["losses"]) == 1500
    # the plots, next to the JSON: each run's loss curve, and the bytes each sent
    assert set(figs) == {"comparison_loss.png", "comparison_throughput.png"}
    loss = lines_of(axes_titled(figs["comparison_loss.png"], "Training loss"))
    assert set(loss) == {"bf16", "mxfp8"}
    assert list(loss["bf16"].get_xdata()) == list(range(1, 1501))
    assert loss["mxfp8"].get_ydata()[-1] == pytest.approx(6.3 * sum(1 / s for s in range(1451, 1501)) / 50)
    wire = axes_titled(figs["comparison_throughput.png"], "All-to-all bytes")
    assert [bar.get_width() for bar in wire.patches] == pytest.approx([1000 / 2**20, 760 / 2**20])
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(f"wrote {out}, {tmp_path / 'comparison_loss.png'}, "
                                     f"{tmp_path / 'comparison_throughput.png'}")


def test_pairs_by_sweep_point(tmp_path):
    """Each mxfp8 run is compared with the bf16 run that differs only in a2a."""
    def summary(d: str, name: str, a2a: str, loss: float, nbytes: float) -> None:
        (tmp_path / d).mkdir()
        RunSummary(
            run_name=name, experiment="e", a2a=a2a, a2a_legs={}, model="m", model_flavor="f/f",
            parallelism="ep2", world_size=2, ep=2, launcher="local", device="cpu",
            run_dir=str(tmp_path / d), steps=3, target_steps=3, logged_steps=[1, 2, 3],
            losses=[6.0, 5.0, loss], final_loss=loss, tokens_per_s_global=10.0, step_time_s=1.0,
            a2a_bytes_per_step=nbytes,
        ).write(tmp_path / d)

    summary("a", "a2a=bf16,lr=1", "bf16", 5.0, 100.0)
    summary("b", "a2a=bf16,lr=2", "bf16", 4.0, 200.0)
    summary("c", "a2a=mxfp8,lr=2", "mxfp8", 4.5, 150.0)
    (rec,) = [c for c in compare(collect([str(tmp_path)])) if c.run.a2a == "mxfp8"]
    assert rec.source == "summary"
    assert rec.vs_baseline["baseline"] == "a2a=bf16,lr=2"
    assert rec.vs_baseline["loss_delta"] == pytest.approx(0.5)
    assert rec.vs_baseline["bytes_ratio"] == pytest.approx(0.75)
    with saved_figures() as figs:
        assert compare_main([str(tmp_path)]) == 0
    # the Δ panel: the mxfp8 run against the bf16 run of its point (lr=2), not lr=1's
    (line,) = lines_of(axes_titled(figs["comparison_loss.png"], DELTA_TITLE)).values()
    assert line.get_label() == "mxfp8 [lr=2]"
    assert list(line.get_ydata()) == pytest.approx([0.0, 0.0, 0.5])


def test_each_transport_is_a_point_with_its_own_baseline(tmp_path):
    """A sweep of a2a presets x a2a.transport (dsv3_16b_2nodes_sweep): each mxfp8 run against
    the bf16 run on the same transport."""
    for d, (a2a, transport, loss) in enumerate((("bf16", "two_hop", 5.0), ("bf16", "nccl", 4.0),
                                                ("mxfp8", "two_hop", 5.5), ("mxfp8", "nccl", 4.25))):
        name = f"a2a={a2a},a2a.transport={transport}"
        (tmp_path / str(d)).mkdir()
        RunSummary(run_name=name, experiment="e", a2a=a2a, a2a_legs={}, model="m", model_flavor="f/f",
                   parallelism="2nodes_8gpus", world_size=16, ep=16, launcher="slurm", device="cuda",
                   run_dir=str(tmp_path / str(d)), steps=3, target_steps=3, logged_steps=[1, 2, 3],
                   losses=[6.0, 5.0, loss], final_loss=loss, transport=transport).write(tmp_path / str(d))
    arms = {c.point: c for c in compare(collect([str(tmp_path)])) if c.run.a2a == "mxfp8"}
    assert sorted(arms) == ["a2a.transport=nccl", "a2a.transport=two_hop"]
    assert arms["a2a.transport=two_hop"].vs_baseline["baseline"] == "a2a=bf16,a2a.transport=two_hop"
    assert arms["a2a.transport=two_hop"].vs_baseline["loss_delta"] == pytest.approx(0.5)
    assert arms["a2a.transport=nccl"].vs_baseline["loss_delta"] == pytest.approx(0.25)


def test_runs_of_different_stacks_are_named_in_a_warning(tmp_path):
    """The table and comparison.json warn when the runs trained on different torchtitan / torch /
    triton versions (RunSummary.stack), naming each stack's runs; runs of one stack get none."""
    stacks = {"0.2.2": {"torchtitan": "0.2.2", "torch": "2.11.0+cu130", "triton": "3.6.0"},
              "0.3.0": {"torchtitan": "0.3.0", "torch": "2.15.0", "triton": "3.9.0"}}

    def summary(d: str, a2a: str, stack: dict) -> None:
        (tmp_path / d).mkdir(exist_ok=True)
        RunSummary(run_name=f"a2a={a2a}", experiment="e", a2a=a2a, a2a_legs={}, model="m", model_flavor="f/f",
                   parallelism="ep2", world_size=2, ep=2, launcher="local", device="cpu", run_dir=str(tmp_path / d),
                   steps=2, target_steps=2, logged_steps=[1, 2], losses=[6.0, 5.0], final_loss=5.0,
                   stack=stack).write(tmp_path / d)

    summary("a", "bf16", stacks["0.2.2"])
    summary("b", "mxfp8", stacks["0.2.2"])
    assert "stacks" not in format_table(compare(collect([str(tmp_path)])))
    summary("b", "mxfp8", stacks["0.3.0"])
    table = format_table(compare(collect([str(tmp_path)])))
    assert table.splitlines()[-1] == (
        "! the runs trained on different stacks: torchtitan 0.2.2, torch 2.11.0+cu130, triton 3.6.0 (a2a=bf16); "
        "torchtitan 0.3.0, torch 2.15.0, triton 3.9.0 (a2a=mxfp8); their differences are not the all-to-all's alone")
    with saved_figures():
        assert compare_main([str(tmp_path), "--out", str(tmp_path / "cmp")]) == 0
    written = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert written["stack_warning"] == table.splitlines()[-1][2:]
    assert [r["stack"]["torchtitan"] for r in written["runs"]] == ["0.2.2", "0.3.0"]


def test_numerics_only_in_wandb_are_read_from_there(tmp_path):
    """A run whose summary.json has no numerics statistics (telemetry logged to wandb only)."""
    write_wandb_run(tmp_path / "r", "a2a=mxfp8", "mxfp8", 1000, 6.0, 760.0, run_id="num12345")
    RunSummary(run_name="a2a=mxfp8", experiment="e", a2a="mxfp8", a2a_legs={"dispatch_fwd": "mxfp8"},
               model="m", model_flavor="f/f", parallelism="ep2", world_size=2, ep=2, launcher="local",
               device="cpu", run_dir="/elsewhere/r", steps=1000, target_steps=1000,
               wandb_run_id="num12345", wandb_dirs=find_runs(str(tmp_path / "r"))).write(tmp_path / "r")
    (c,) = collect([str(tmp_path)])
    assert c.source == "summary"
    assert c.run.numerics["numerics/layer1/dispatch_fwd/rel_l2_err"]["max"] == pytest.approx(0.02)


def test_cli_errors(tmp_path):
    assert compare_main([str(tmp_path / "missing")]) == 2
    assert compare_main([str(tmp_path)]) == 1  # exists, but no runs in it
    assert compare_main([]) == 2


def two_runs(root: Path) -> list[Path]:
    """A bf16 and an mxfp8 run in folders of their own under ``root``."""
    for a2a in ("bf16", "mxfp8"):
        write_summary(root / a2a, "run", a2a, steps=[1, 2, 3, 4])
    return [root / "bf16" / "run", root / "mxfp8" / "run"]


def test_out_in_a_new_folder_is_created(tmp_path, capsys):
    two_runs(tmp_path / "runs")
    out = tmp_path / "new" / "deeper" / "x.json"
    assert compare_main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    assert [r["a2a"] for r in json.loads(out.read_text())["runs"]] == ["bf16", "mxfp8"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["comparison_loss.png", "comparison_throughput.png",
                                                            "x.json"]
    # a folder: comparison.json and the plots go in it
    assert compare_main([str(tmp_path / "runs"), "--out", str(tmp_path / "cmp")]) == 0
    assert sorted(p.name for p in (tmp_path / "cmp").iterdir()) == ["comparison.json", "comparison_loss.png",
                                                                   "comparison_throughput.png"]
    assert f"wrote {tmp_path / 'cmp' / 'comparison.json'}" in capsys.readouterr().out


def test_out_that_cannot_be_written_is_refused_before_the_table(tmp_path, capsys):
    runs = two_runs(tmp_path / "runs")
    (tmp_path / "file").write_text("")
    assert compare_main([str(r) for r in runs] + ["--out", str(tmp_path / "file" / "x.json")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"compare_runs: --out {tmp_path / 'file' / 'x.json'}: {tmp_path / 'file'} is a file, not a folder\n"
    assert not list(tmp_path.glob("**/comparison*"))


def test_runs_in_two_folders_are_compared_beside_them(tmp_path, monkeypatch, capsys):
    """Not into the current directory: into the folder that holds both runs."""
    runs = two_runs(tmp_path / "runs")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert compare_main([str(r) for r in runs]) == 0
    assert list(cwd.iterdir()) == []
    assert json.loads((tmp_path / "runs" / "comparison.json").read_text())["runs"]
    assert f"wrote {tmp_path / 'runs' / 'comparison.json'}" in capsys.readouterr().out


# ------------------------------------------------------------------------------ long runs
def write_summary(root: Path, d: str, a2a: str, *, seed: int = 0, offset: float = 0.0,
                  steps: list[int], val_every: int = 0, device: str = "cuda",
                  numerics: dict | None = None, model: str = "m") -> None:
    """A run whose loss is a smooth curve plus ``offset`` (and a wiggle that averages out);
    a ``model`` other than the default one is named in the run name, as a sweep over it does."""
    losses = [3.0 + 5.0 / s ** 0.5 + offset + 0.01 * (-1) ** s for s in steps]
    val_steps = [s for s in steps if val_every and s % val_every == 0]
    val = [3.2 + 5.0 / s ** 0.5 + offset for s in val_steps]
    name = f"a2a={a2a},training.seed={seed}" + (f",model={model}" if model != "m" else "")
    RunSummary(
        run_name=name, experiment="e", a2a=a2a, a2a_legs={}, model=model, model_flavor="f/f",
        parallelism="single", world_size=1, ep=1, launcher="local", device=device,
        run_dir=str(root / d), steps=steps[-1], target_steps=steps[-1], seed=seed,
        logged_steps=steps, losses=losses, val_logged_steps=val_steps, val_losses=val,
        final_loss=losses[-1], final_val_loss=val[-1] if val else None, tokens_per_s_global=1234.5,
        step_time_s=0.1, a2a_bytes_per_step=1000.0 if a2a == "bf16" else 760.0, numerics=numerics or {},
    ).write((root / d).mkdir(parents=True) or root / d)


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, dict]:
    """The GPU parity study's shape: bf16 at two seeds, mxfp8, mxfp8_all; 3,000 steps logged
    every 10, validation every 100."""
    root = tmp_path_factory.mktemp("study")
    steps = list(range(10, 3001, 10))
    write_summary(root, "bf16_seed0", "bf16", steps=steps, val_every=100)
    write_summary(root, "bf16_seed1", "bf16", seed=1, offset=0.004, steps=steps, val_every=100)
    write_summary(root, "mxfp8", "mxfp8", offset=0.002, steps=steps, val_every=100, numerics={
        "numerics/layer1/dispatch_fwd/rel_l2_err": {"n": 3, "mean": 0.02, "min": 0.01, "max": 0.04, "last": 0.02},
        "numerics/layer2/dispatch_fwd/rel_l2_err": {"n": 3, "mean": 0.03, "min": 0.02, "max": 0.03, "last": 0.03},
        "numerics/layer2/dispatch_fwd/scale_exp_min": {"n": 3, "mean": -9, "min": -12, "max": -8, "last": -9},
        "numerics/dispatch_fwd/rel_l2_err": {"n": 3, "mean": 0.025, "min": 0.02, "max": 0.03, "last": 0.025},
        "numerics/combine_fwd/flushed_frac": {"n": 3, "mean": 0.0, "min": 0.0, "max": 0.002, "last": 0.0},
        "numerics/layer1/combine_bwd/saturated_block_frac": {"n": 3, "mean": 0.0, "min": 0.0, "max": 0.001,
                                                             "last": 0.0},
    })
    write_summary(root, "mxfp8_all", "mxfp8_all", offset=0.03, steps=steps, val_every=100)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), saved_figures() as figs:
        assert compare_main([str(root)]) == 0
    cmp = json.loads((root / "comparison.json").read_text())
    return root, {**cmp, "printed": printed.getvalue(), "figures": figs}


def test_verdict_per_arm_against_the_seed_spread(study):
    root, cmp = study
    by_run = {v["run"].split(",")[0]: v for v in cmp["verdicts"]}
    assert set(by_run) == {"a2a=bf16", "a2a=mxfp8", "a2a=mxfp8_all"}
    base_val = 3.2 + 5.0 / 3000 ** 0.5
    mx = by_run["a2a=mxfp8"]
    assert mx["baseline"] == "a2a=bf16,training.seed=0" and mx["measure"] == "final val loss"
    assert mx["delta"] == pytest.approx(0.002) and mx["seed_spread"] == pytest.approx(0.004)
    assert mx["tolerance"] == pytest.approx(max(0.004, 0.005 * base_val)) and mx["within"] is True
    assert by_run["a2a=mxfp8_all"]["within"] is False
    assert by_run["a2a=bf16"]["within"] is None  # the second seed: the spread itself
    assert mx["text"] == (f"mxfp8: final val loss +0.0020 ({100 * 0.002 / base_val:+.2f}%) vs "
                          f"bf16 seed 0; bf16 seed spread 0.0040 -> within max(seed spread, 0.5% of loss) = "
                          f"{max(0.004, 0.005 * base_val):.4f}")
    assert by_run["a2a=mxfp8_all"]["text"].startswith("mxfp8_all: final val loss +0.0300")
    assert by_run["a2a=bf16"]["text"].startswith("bf16 seed 1: final val loss +0.0040")
    # printed under the table, and written on the loss figure
    assert mx["text"] in cmp["printed"].split("\n\n")[1]
    assert cmp["plots"]["loss"]["texts"] == [v["text"] for v in cmp["verdicts"]]


def test_delta_panels_and_seed_band(study):
    root, cmp = study
    panels = cmp["plots"]["loss"]["panels"]
    assert set(panels) == {"train", "train_delta", "val", "val_delta"}
    delta = {s["run"].split(",")[0]: s for s in panels["train_delta"]["series"]}
    assert set(delta) == {"a2a=bf16", "a2a=mxfp8", "a2a=mxfp8_all"}  # every arm but the baseline
    mx = delta["a2a=mxfp8"]
    assert mx["steps"] == list(range(10, 3001, 10)) and mx["window"] == 10  # 300 points / 30
    assert mx["values"] == pytest.approx([0.002] * 300, abs=1e-9)  # the wiggle cancels, smoothed
    band = panels["train_delta"]["band"]
    assert band["high"] == pytest.approx([0.004] * 300) and band["low"] == pytest.approx([-0.004] * 300)
    val = {s["run"].split(",")[0]: s for s in panels["val_delta"]["series"]}
    assert val["a2a=mxfp8_all"]["values"] == pytest.approx([0.03] * 30)
    assert panels["val_delta"]["band"]["high"] == pytest.approx([0.004] * 30)
    for name, panel in panels.items():
        assert panel["xticks"] and all(t == int(t) for t in panel["xticks"]), (name, panel["xticks"])
    # what the saved figure shows: the arms' Δ lines, the seed spread band and the verdicts'
    # parity bound (max(0.004, 0.5% of the baseline's final val loss)) as a band
    ax = axes_titled(cmp["figures"]["comparison_loss.png"], DELTA_TITLE)
    assert set(lines_of(ax)) == {"bf16 seed 1", "mxfp8", "mxfp8_all"}
    assert list(lines_of(ax)["mxfp8"].get_ydata()) == pytest.approx([0.002] * 300, abs=1e-9)
    (spread,) = [c for c in ax.collections if c.get_label() == "bf16 seed-to-seed spread"]
    assert spread.get_paths()[0].get_extents().y1 == pytest.approx(0.004)
    tol = cmp["verdicts"][0]["tolerance"]
    assert tol == pytest.approx(0.005 * (3.2 + 5.0 / 3000 ** 0.5))
    assert spans_of(ax, "parity bound") == [pytest.approx((-tol, tol))]


def test_lines_tell_apart(study):
    _, cmp = study
    styles = {k.split(",")[0] + k.split(",")[1][-2:]: v for k, v in cmp["plots"]["loss"]["styles"].items()}
    base, replica = styles["a2a=bf16=0"], styles["a2a=bf16=1"]
    arms = [styles["a2a=mxfp8=0"], styles["a2a=mxfp8_all=0"]]
    assert base["linestyle"] == "-" and base["zorder"] > max(a["zorder"] for a in arms + [replica])
    assert base["alpha"] < 1  # on top, and what lies under it still shows
    assert arms[0]["color"] != arms[1]["color"] and arms[0]["linestyle"] != arms[1]["linestyle"]
    assert replica["color"] not in (base["color"], arms[0]["color"], arms[1]["color"])


def test_numerics_summed_up_per_leg(study):
    root, cmp = study
    (mx,) = [r for r in cmp["runs"] if r["a2a"] == "mxfp8"]
    worst = mx["numerics_worst"]
    assert worst["dispatch_fwd"]["rel_l2_err"] == {"value": 0.03, "layer": 2, "layers": 2}
    assert worst["dispatch_fwd"]["scale_exp_min"] == {"value": -12, "layer": 2, "layers": 1}
    # a leg with model-wide series only
    assert worst["combine_fwd"]["flushed_frac"] == {"value": 0.002, "layer": None, "layers": 0}
    assert worst["combine_bwd"]["saturated_block_frac"] == {"value": 0.001, "layer": 1, "layers": 1}
    assert all(not r["numerics_worst"] for r in cmp["runs"] if r["a2a"] != "mxfp8")
    assert "dispatch_fwd: rel_l2_err 0.03 (layer 2), scale_exp_min -12 (layer 2)" in cmp["printed"]
    assert "combine_fwd: flushed_frac 0.002 (all layers)" in cmp["printed"]


def test_short_cpu_run_integer_ticks_and_cpu_note(tmp_path, capsys):
    from PIL import Image

    for a2a in ("bf16", "mxfp8"):
        write_summary(tmp_path, a2a, a2a, steps=[1, 2, 3, 4], device="cpu")
    assert compare_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0]
    assert "CPU run: throughput is not a speed claim" in table
    cmp = json.loads((tmp_path / "comparison.json").read_text())
    assert cmp["notes"] == ["CPU run: throughput is not a speed claim"]
    ticks = cmp["plots"]["loss"]["panels"]["train"]["xticks"]
    assert ticks == [1.0, 2.0, 3.0, 4.0], ticks  # not 1.5, 2.5, ...
    tp = cmp["plots"]["throughput"]
    assert any("CPU run: throughput is not a speed claim" in t for t in tp["texts"])
    assert "CPU" in tp["titles"][0]
    assert tp["value_labels"]["tokens_per_s"] == ["1,234", "1,234"]  # 1234.5: format rounds half to even
    assert tp["value_labels"]["a2a_mib_per_step"] == ["0.00", "0.00"]
    png = Image.open(tmp_path / "comparison_throughput.png")
    assert "CPU run: throughput is not a speed claim" in png.text["Comment"]
    # a GPU comparison carries no such note
    gpu = tmp_path / "gpu"
    for a2a in ("bf16", "mxfp8"):
        write_summary(gpu, a2a, a2a, steps=list(range(1, 11)))
    assert compare_main([str(gpu)]) == 0
    assert "CPU run" not in capsys.readouterr().out
    assert json.loads((gpu / "comparison.json").read_text())["plots"]["throughput"]["texts"] == []


# ------------------------------------------------------------------------------ throughput
def write_speed(root: Path, a2a: str, seed: int, tokens_per_s: float, steady_steps: int = 9,
                device: str = "cuda", gpu_shared: bool = False) -> None:
    """A run of 512 tokens per step whose steady windows ran at ``tokens_per_s``."""
    d = root / f"{a2a}_{seed}"
    d.mkdir(parents=True)
    RunSummary(
        run_name=f"a2a={a2a},training.seed={seed}", experiment="e", a2a=a2a, a2a_legs={}, model="m",
        model_flavor="f/f", parallelism="ep2", world_size=2, ep=2, launcher="local", device=device,
        run_dir=str(d), steps=10, target_steps=10, seed=seed, logged_steps=list(range(1, 11)),
        losses=[5.0] * 10, final_loss=5.0, tokens_per_s_global=tokens_per_s, tokens_per_s=tokens_per_s / 2,
        step_time_s=512 / tokens_per_s, steady_steps=steady_steps, a2a_bytes_per_step=1.0, gpu_shared=gpu_shared,
    ).write(d)


def test_throughput_ratio_with_its_spread_and_no_speed_up_inside_it(tmp_path):
    write_speed(tmp_path, "bf16", 0, 1000.0)
    write_speed(tmp_path, "bf16", 1, 1100.0, steady_steps=19)
    write_speed(tmp_path, "mxfp8", 0, 1050.0)  # faster than bf16 seed 0, slower than seed 1
    write_speed(tmp_path, "mxfp8", 1, 1080.0)
    write_speed(tmp_path, "mxfp8_all", 0, 1200.0)  # faster than both bf16 runs
    write_speed(tmp_path, "mxfp8_all", 1, 1250.0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert compare_main([str(tmp_path)]) == 0
    cmp = json.loads((tmp_path / "comparison.json").read_text())
    by_arm = {v["arm"]: v for v in cmp["throughput_verdicts"]}
    assert set(by_arm) == {"mxfp8", "mxfp8_all"}  # one per arm, not per run
    # all runs of an arm together: their tokens over their time (bf16 seed 1 ran 19 steady steps)
    base = (1000 * 9 * 512 / 1000 + 1100 * 19 * 512 / 1100) / (9 * 512 / 1000 + 19 * 512 / 1100)
    mx = by_arm["mxfp8"]
    assert mx["ratio"] == pytest.approx(2 * 9 * 512 / (9 * 512 / 1050 + 9 * 512 / 1080) / base)
    assert mx["pair_ratios"] == pytest.approx([1050 / 1100, 1080 / 1000])
    assert mx["verdict"] == "within spread" and "speed-up" not in mx["text"]
    assert mx["text"] == (f"mxfp8: tokens/s ×{mx['ratio']:.3f} vs bf16, 2 vs 2 runs (pairs ×0.955-×1.080) -> "
                          "inside the run-to-run spread: no speed difference shown")
    assert by_arm["mxfp8_all"]["verdict"] == "faster" and by_arm["mxfp8_all"]["text"].endswith(": a speed-up")
    assert mx["text"] in printed.getvalue() and cmp["throughput_rule"]


def test_one_run_each_is_not_called_faster(tmp_path):
    write_speed(tmp_path, "bf16", 0, 1000.0)
    write_speed(tmp_path, "mxfp8", 0, 1500.0)
    assert compare_main([str(tmp_path)]) == 0
    (v,) = json.loads((tmp_path / "comparison.json").read_text())["throughput_verdicts"]
    assert v["ratio"] == pytest.approx(1.5) and v["verdict"] == "not judged"
    assert "speed-up" not in v["text"] and "no run-to-run spread" in v["text"]
    cpu = tmp_path / "cpu"
    write_speed(cpu, "bf16", 0, 1000.0, device="cpu")
    write_speed(cpu, "bf16", 1, 1010.0, device="cpu")
    write_speed(cpu, "mxfp8", 0, 1500.0, device="cpu")
    (v,) = throughput_verdicts(compare(collect([str(cpu)])))
    assert v["verdict"] == "faster" and "speed-up" not in v["text"] and "not a speed claim" in v["text"]


def test_ranks_sharing_a_gpu_get_no_speed_verdict(tmp_path):
    """Runs whose ranks shared one GPU: however clear the ratio, no speed-up is called; the
    table, the JSON and the throughput figure say why."""
    from launch.run.shared_gpu import SHARED_GPU_NOTE

    for seed, tps in ((0, 1000.0), (1, 1010.0)):
        write_speed(tmp_path, "bf16", seed, tps, gpu_shared=True)
    write_speed(tmp_path, "mxfp8", 0, 1500.0, gpu_shared=True)
    write_speed(tmp_path, "mxfp8", 1, 1600.0, gpu_shared=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert compare_main([str(tmp_path)]) == 0
    cmp = json.loads((tmp_path / "comparison.json").read_text())
    (v,) = cmp["throughput_verdicts"]
    assert v["verdict"] == "not judged" and "speed-up" not in v["text"] and SHARED_GPU_NOTE in v["text"]
    table = printed.getvalue().split("\n\n")[0]
    assert "cuda (shared)" in table and SHARED_GPU_NOTE in table
    assert cmp["notes"] == [SHARED_GPU_NOTE]
    assert "GPU shared" in cmp["plots"]["throughput"]["titles"][0]
    assert any(SHARED_GPU_NOTE in t for t in cmp["plots"]["throughput"]["texts"])


# ------------------------------------------------------------------------------ seeds
# Final validation losses of the symm study's shape: bf16 at three seeds, mxfp8_all at two,
# mxfp8 at one. bf16: mean 4.41, sample std 0.01, so the bound is max(2 × 0.01, 0.5% × 4.41).
SEED_STUDY = {("bf16", 0): 4.40, ("bf16", 1): 4.41, ("bf16", 2): 4.42,
              ("mxfp8_all", 0): 4.425, ("mxfp8_all", 1): 4.385, ("mxfp8", 0): 4.435}


def _final_val(root: Path, losses: dict, steps: int = 300) -> None:
    for (a2a, seed), final in losses.items():
        d = root / f"{a2a}_seed{seed}"
        RunSummary(
            run_name=f"a2a={a2a},training.seed={seed}", experiment="e", a2a=a2a, a2a_legs={}, model="m",
            model_flavor="f/f", parallelism="ep2_shared_gpu", world_size=2, ep=2, launcher="local", device="cuda",
            run_dir=str(d), steps=steps, target_steps=steps, seed=seed, logged_steps=[10, steps],
            losses=[6.0, final + 0.4], val_logged_steps=[100, steps], val_losses=[6.5, final], final_loss=final + 0.4,
            final_val_loss=final, gpu_shared=True,
        ).write(d.mkdir(parents=True) or d)


def test_three_bf16_seeds_judge_each_arm_by_their_mean_and_std(tmp_path):
    """With >= 3 bf16 seeds, each MXFP8 run's distance from their mean against max(2 × their
    sample std, 0.5% of the mean); every bf16 seed's line gives its own distance, no verdict."""
    import statistics

    from launch.tools.compare_runs import PARITY_SHARE, SPREAD_STDS

    _final_val(tmp_path, SEED_STUDY)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert compare_main([str(tmp_path)]) == 0
    cmp = json.loads((tmp_path / "comparison.json").read_text())
    bf16 = [SEED_STUDY["bf16", s] for s in range(3)]
    mean, std = statistics.fmean(bf16), statistics.stdev(bf16)
    bound = max(SPREAD_STDS * std, PARITY_SHARE * mean)
    assert bound == pytest.approx(0.022050)  # the 0.5% floor here: 2 × 0.01 < 0.02205
    by_run = {v["run"]: v for v in cmp["verdicts"]}
    assert set(by_run) == {f"a2a={a},training.seed={s}" for a, s in SEED_STUDY}
    for (a2a, seed), final in SEED_STUDY.items():
        v = by_run[f"a2a={a2a},training.seed={seed}"]
        assert v["reference"] == "bf16 mean of 3 seeds" and v["bf16_seeds"] == 3
        assert (v["bf16_mean"], v["bf16_std"], v["tolerance"]) == pytest.approx((mean, std, bound))
        assert v["delta"] == pytest.approx(final - mean), v
        assert v["within"] == (None if a2a == "bf16" else abs(final - mean) <= bound), v
        assert v["text"] in printed.getvalue()
    assert by_run["a2a=mxfp8,training.seed=0"]["within"] is False  # +0.025 > 0.02205
    assert by_run["a2a=mxfp8_all,training.seed=1"]["within"] is False  # -0.025
    assert by_run["a2a=mxfp8_all,training.seed=0"]["within"] is True  # +0.015
    assert by_run["a2a=mxfp8_all,training.seed=0"]["text"] == (
        f"mxfp8_all seed 0: final val loss +0.0150 ({100 * 0.015 / mean:+.2f}%) vs bf16 mean of 3 seeds; "
        f"bf16 std 0.0100 over 3 seeds -> within max(2 × bf16 std, 0.5% of loss) = {bound:.4f}")
    # the bound band on the validation Δ panel sits around the mean (Δ to bf16 seed 0: +0.01)
    (band,) = cmp["plots"]["loss"]["panels"]["val_delta"]["bounds"]
    assert band["center"] == pytest.approx(mean - bf16[0]) and band["tolerance"] == pytest.approx(bound)


def test_a_wide_bf16_spread_widens_the_bound_to_two_stds(tmp_path):
    """bf16 seeds 0.03 apart: 2 × std (0.06) is the bound, over the 0.5% floor; an arm 0.05 from
    the mean is within it (it would be outside the two-seed rule's max(spread, 0.5%) from seed
    0's spread)."""
    losses = {("bf16", 0): 4.40, ("bf16", 1): 4.43, ("bf16", 2): 4.46, ("mxfp8_all", 0): 4.48}
    _final_val(tmp_path, losses)
    (v,) = [v for v in verdicts(compare(collect([str(tmp_path)]))) if v["within"] is not None]
    assert v["tolerance"] == pytest.approx(2 * 0.03) and v["delta"] == pytest.approx(0.05)
    assert v["within"] is True


def test_two_bf16_seeds_keep_the_distance_rule(tmp_path):
    """Two bf16 seeds: one degree of freedom, no usable std; the arm is judged from the lowest
    seed, against max(their distance, 0.5% of its loss), and the other seed's line is the spread."""
    _final_val(tmp_path, {k: v for k, v in SEED_STUDY.items() if k != ("bf16", 2)})
    found = {v["run"]: v for v in verdicts(compare(collect([str(tmp_path)])))}
    assert "a2a=bf16,training.seed=0" not in found  # the reference itself
    v = found["a2a=mxfp8,training.seed=0"]
    assert v["reference"] == "bf16 seed 0" and v["delta"] == pytest.approx(0.035)
    assert v["tolerance"] == pytest.approx(max(0.01, 0.005 * 4.40)) and v["within"] is False
    assert found["a2a=bf16,training.seed=1"]["within"] is None


def test_a_sweep_and_a_run_elsewhere_are_compared_in_the_sweep(tmp_path, monkeypatch, capsys):
    """The parity recipe's form: a sweep folder and a second bf16 seed run from outputs/, both
    named relative to the current directory (the repository root), which gets nothing."""
    monkeypatch.chdir(tmp_path)
    steps = [1, 2, 3, 4]
    write_summary(tmp_path / "multirun" / "T", "0_bf16", "bf16", steps=steps)
    write_summary(tmp_path / "multirun" / "T", "1_mxfp8", "mxfp8", steps=steps)
    write_summary(tmp_path / "outputs", "T_bf16_seed1", "bf16", seed=1, steps=steps)
    assert compare_main(["multirun/T", "outputs/T_bf16_seed1"]) == 0
    cmp = json.loads((tmp_path / "multirun" / "T" / "comparison.json").read_text())
    assert len(cmp["runs"]) == 3 and not list(tmp_path.glob("comparison*"))
    assert f"wrote {tmp_path / 'multirun' / 'T' / 'comparison.json'}" in capsys.readouterr().out
    # two runs from unrelated folders: what holds both is the current directory -> --out
    assert compare_main(["multirun/T/0_bf16", "outputs/T_bf16_seed1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--out" in err and err.count("\n") == 1
    assert not list(tmp_path.glob("comparison*"))


def test_delta_panel_shows_the_verdicts_bound_with_one_bf16_seed(tmp_path):
    """One bf16 seed, so no spread band: the verdict's bound (0.5% of the loss) is drawn as a
    band, and the Δ axis spans it instead of zooming onto a 0.0016 difference."""
    steps = list(range(10, 1001, 10))
    write_summary(tmp_path, "bf16", "bf16", steps=steps)
    write_summary(tmp_path, "mxfp8", "mxfp8", offset=0.0016, steps=steps)
    with saved_figures() as figs:
        assert compare_main([str(tmp_path)]) == 0
    (verdict,) = verdicts(compare(collect([str(tmp_path)])))
    tol = verdict["tolerance"]
    base_end = sum(3.01 + 5.0 / s ** 0.5 for s in (980, 990, 1000)) / 3  # mean of the last 1/30 of the steps
    assert verdict["seed_spread"] is None and tol == pytest.approx(0.005 * base_end)
    ax = axes_titled(figs["comparison_loss.png"], DELTA_TITLE)
    assert not ax.collections  # no seed spread band
    assert spans_of(ax, f"parity bound ±{tol:.4f}") == [pytest.approx((-tol, tol))]
    low, high = ax.get_ylim()
    assert low <= -tol and high >= tol


def test_each_models_baseline_has_its_own_style(tmp_path):
    """A sweep over two models: two bf16 baselines, told apart by colour, both drawn as
    baselines (thick, on top)."""
    steps = list(range(1, 21))
    for model in ("a", "b"):
        write_summary(tmp_path, f"{model}_bf16", "bf16", steps=steps, model=model)
        write_summary(tmp_path, f"{model}_mxfp8", "mxfp8", offset=0.01, steps=steps, model=model)
    with saved_figures() as figs:
        assert compare_main([str(tmp_path)]) == 0
    lines = lines_of(axes_titled(figs["comparison_loss.png"], "Training loss"))
    assert set(lines) == {"bf16 [model=a]", "bf16 [model=b]", "mxfp8 [model=a]", "mxfp8 [model=b]"}
    base_a, base_b = lines["bf16 [model=a]"], lines["bf16 [model=b]"]
    assert base_a.get_color() != base_b.get_color()
    arms = (lines["mxfp8 [model=a]"], lines["mxfp8 [model=b]"])
    assert {base_a.get_color(), base_b.get_color()}.isdisjoint(arm.get_color() for arm in arms)
    for base in (base_a, base_b):
        assert base.get_zorder() > max(arm.get_zorder() for arm in arms)
        assert base.get_linewidth() > max(arm.get_linewidth() for arm in arms)
    # each baseline's parity bound on the Δ panel, named after it
    delta = axes_titled(figs["comparison_loss.png"], DELTA_TITLE)
    assert [p.get_label().split(" vs ")[1] for p in delta.patches] == ["bf16 [model=a]", "bf16 [model=b]"]


def test_one_bf16_seed_is_judged_by_the_share_alone_and_a_run_without_bf16_says_so(tmp_path, capsys):
    """With one bf16 seed there is no seed spread: the verdict does not speak of one. A run with
    no bf16 run to compare with gets a line saying so, not silence."""
    steps = list(range(10, 301, 10))
    write_summary(tmp_path / "one", "bf16", "bf16", steps=steps)
    write_summary(tmp_path / "one", "mxfp8", "mxfp8", offset=0.002, steps=steps)
    (v,) = verdicts(compare(collect([str(tmp_path / "one")])))
    bound = 0.005 * (3.0 + 5.0 / 300 ** 0.5 + 0.01)
    assert v["rule"] == "0.5% of loss" and v["tolerance"] == pytest.approx(bound) and v["seed_spread"] is None
    assert v["text"].endswith(f"vs bf16; one bf16 seed, no seed spread (sweep training.seed for one) "
                              f"-> within 0.5% of loss = {bound:.4f}")
    write_summary(tmp_path / "none", "mxfp8", "mxfp8", steps=steps)
    assert compare_main([str(tmp_path / "none")]) == 0
    line = ("mxfp8: no verdict: no bf16 run of the same settings to compare it with (add a2a=bf16 to the sweep, "
            "or name a bf16 run's folder)")
    assert line in capsys.readouterr().out.splitlines()
    assert json.loads((tmp_path / "none" / "comparison.json").read_text())["unjudged"] == [line]


def test_a_launch_killed_before_its_summary_is_read_back_from_wandb(tmp_path):
    """earlier_record: a resumed run's earlier steps come from summary.json, unless a launch was
    killed before it wrote one (SIGKILL, a node lost): then from the offline wandb run, which
    holds its steps."""
    from launch.run.run_summary import earlier_record

    run = tmp_path / "run"
    write_wandb_run(run / "wandb", "a2a=bf16", "bf16", 8, 6.0, 1000.0, run_id="r1")
    RunSummary(run_name="a2a=bf16", experiment="e", a2a="bf16", a2a_legs={}, model="m", model_flavor="f/f",
               parallelism="ep2", world_size=2, ep=2, launcher="slurm", device="cpu", run_dir=str(run), steps=5,
               target_steps=20, logged_steps=[1, 2, 3, 4, 5], losses=[6.0 / s for s in range(1, 6)]).write(run)
    assert earlier_record(run, 5).logged_steps == [1, 2, 3, 4, 5]  # the summary reaches the checkpoint
    record = earlier_record(run, 8)  # the launch after it was killed at step 8
    assert record.logged_steps == list(range(1, 9)) and record.losses == pytest.approx([6.0 / s for s in range(1, 9)])
    (run / "summary.json").unlink()
    assert earlier_record(run, 8).logged_steps == list(range(1, 9))


def test_failed_and_empty_runs_are_marked_rows_not_compared(tmp_path, capsys):
    """A sweep whose mxfp8 run logged no step (its wandb run started, then the run failed) and
    whose third run failed before any record (only its config and console.log): the table
    marks both, no verdict or plot takes them, and nothing crashes."""
    write_wandb_run(tmp_path / "0_a2a=bf16", "a2a=bf16,x=1", "bf16", 20, 6.0, 1000.0)
    write_wandb_run(tmp_path / "1_a2a=mxfp8", "a2a=mxfp8,x=1", "mxfp8", 0, 6.3, 760.0)
    failed = tmp_path / "2_a2a=mxfp8_dense"
    failed.mkdir()
    (failed / "train_config.yaml").write_text(
        "a2a: {name: mxfp8_dense}\nmodel: {name: tiny_llama4}\n"
        "parallelism: {name: ep2, nodes: 1, procs_per_node: 2, ep: 2}\ntraining: {steps: 5}\n"
        "logging: {run_name: 'a2a=mxfp8_dense,x=1'}\n")
    (failed / "console.log").write_text("==== ended 2026-12-06 03:00:00: failed: rank 0 failed: "
                                        "IndexError: Index 1 out of range ====\n")
    assert compare_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("a2a=")}
    assert "[no step]" in rows["a2a=mxfp8,x=1"] and "[failed]" in rows["a2a=mxfp8_dense,x=1"]
    assert "[failed]" not in rows["a2a=bf16,x=1"] and "[no step]" not in rows["a2a=bf16,x=1"]
    assert "not compared" in out and "no verdict" not in out.split("* [")[0]
    result = json.loads((tmp_path / "comparison.json").read_text())
    assert {r["run_name"]: r["mark"] for r in result["runs"]} == {
        "a2a=bf16,x=1": None, "a2a=mxfp8,x=1": "no step", "a2a=mxfp8_dense,x=1": "failed"}
    assert [s["run"] for s in result["plots"]["loss"]["panels"]["train"]["series"]] == ["a2a=bf16,x=1"]
    assert result["verdicts"] == [] and result["unjudged"] == []


def _fake_squeue(tmp_path: Path, monkeypatch, states: dict[str, str]) -> None:
    """``squeue -h -j <id> -o %T`` on PATH answering from ``states`` (job id -> state)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cases = "".join(f'  {jid}) echo {state};;\n' for jid, state in states.items())
    (bin_dir / "squeue").write_text(f'#!/bin/sh\ncase "$3" in\n{cases}  *) echo "Invalid job id specified" >&2; '
                                    f'exit 1;;\nesac\n')
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _queued_point(folder: Path, a2a: str, job_id: str) -> None:
    """A sweep point whose SLURM job was submitted: its config and the job's hold, nothing else."""
    folder.mkdir(parents=True)
    (folder / "train_config.yaml").write_text(
        f"a2a: {{name: {a2a}}}\nmodel: {{name: tiny_llama4}}\n"
        f"parallelism: {{name: ep2, nodes: 1, procs_per_node: 2, ep: 2}}\ntraining: {{steps: 5}}\n"
        f"logging: {{run_name: 'a2a={a2a},x=1'}}\n")
    (folder / ".training").write_text(json.dumps({"host": "n1", "pid": None, "job_id": job_id}))


def test_a_sweep_still_queued_and_running_is_not_compared(tmp_path, monkeypatch, capsys):
    """Every point's job queued or running: no comparison, no plot; what stands where is said."""
    sweep = tmp_path / "sweep"
    _queued_point(sweep / "0_a2a=bf16", "bf16", "33")
    _queued_point(sweep / "1_a2a=mxfp8", "mxfp8", "34")
    _fake_squeue(tmp_path, monkeypatch, {"33": "RUNNING", "34": "PENDING"})
    assert compare_main([str(sweep)]) == 1
    err = capsys.readouterr().err
    assert "2 runs: 1 queued, 1 running, 0 done, 0 stopped, 0 failed" in err
    assert f"left out: a2a=bf16,x=1: running (SLURM job 33), still training ({sweep / '0_a2a=bf16'})" in err
    assert f"left out: a2a=mxfp8,x=1: queued (SLURM job 34), not started yet ({sweep / '1_a2a=mxfp8'})" in err
    assert "no finished run to compare yet: nothing was written" in err
    assert sorted(p.name for p in sweep.iterdir()) == ["0_a2a=bf16", "1_a2a=mxfp8"]  # no comparison.*


def test_a_sweep_partly_finished_compares_the_finished_runs_with_their_provenance(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    for name, a2a in (("0_a2a=bf16", "bf16"), ("1_a2a=mxfp8", "mxfp8")):
        s = RunSummary(run_name=f"a2a={a2a},x=1", experiment="e", a2a=a2a, a2a_legs={}, model="tiny_llama4",
                       model_flavor="llama4/tiny", parallelism="ep2", world_size=2, ep=2, launcher="slurm",
                       device="cpu", run_dir=str(sweep / name), steps=5, target_steps=5,
                       logged_steps=[1, 2, 3, 4, 5], losses=[6.0, 5.0, 4.0, 3.5, 3.0], final_loss=3.0,
                       commit="a" * 40, dirty=False, started_at="2026-12-07T04:00:00Z",
                       ended_at="2026-12-07T04:01:00Z", hosts=["n1", "n2"], gpu="cpu", gpu_count=2,
                       stack={"torchtitan": "0.2.2", "torch": "2.13"})
        (sweep / name).mkdir(parents=True)
        s.write(sweep / name)
    _queued_point(sweep / "2_a2a=mxfp8_dense", "mxfp8_dense", "35")
    _fake_squeue(tmp_path, monkeypatch, {"35": "PENDING"})
    assert compare_main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "3 runs: 1 queued, 0 running, 2 done, 0 stopped, 0 failed" in out
    assert "left out: a2a=mxfp8_dense,x=1: queued (SLURM job 35), not started yet" in out
    result = json.loads((sweep / "comparison.json").read_text())
    assert result["left_out"] == [{"run_name": "a2a=mxfp8_dense,x=1", "path": str(sweep / "2_a2a=mxfp8_dense"),
                                   "status": "queued", "holder": "SLURM job 35"}]
    assert [s["run"] for s in result["plots"]["loss"]["panels"]["train"]["series"]] == ["a2a=bf16,x=1",
                                                                                         "a2a=mxfp8,x=1"]
    done = [r for r in result["runs"] if r["status"] == "done"]
    assert [(r["commit"], r["dirty"], r["started_at"], r["ended_at"], r["hosts"], r["gpu"], r["gpu_count"],
             r["stack"]["torchtitan"]) for r in done] == [
        ("a" * 40, False, "2026-12-07T04:00:00Z", "2026-12-07T04:01:00Z", ["n1", "n2"], "cpu", 2, "0.2.2")] * 2


def test_a_last_step_delta_of_the_other_sign_than_the_verdict_is_explained(tmp_path, study):
    """Δloss is one step's, the verdict the final validation loss: where the two disagree in sign
    the table says which runs and why; where they agree (the study) it says nothing."""
    steps = list(range(10, 201, 10))
    write_summary(tmp_path, "bf16", "bf16", steps=steps, val_every=100)
    write_summary(tmp_path, "mxfp8", "mxfp8", offset=0.002, steps=steps, val_every=100)
    mx = RunSummary.read(tmp_path / "mxfp8")
    mx.losses[-1] = mx.final_loss = RunSummary.read(tmp_path / "bf16").final_loss - 0.05  # a lucky last step
    mx.write(tmp_path / "mxfp8")
    table = format_table(compare(collect([str(tmp_path)])))
    (note,) = [line for line in table.splitlines() if "differ in sign" in line]
    assert note.startswith("* Δloss is the last logged step's training loss minus its bf16 run's; the verdicts "
                           "below compare the final val loss with the bf16 reference, and for mxfp8 the two differ")
    assert "differ in sign" not in study[1]["printed"]


def test_long_verdicts_are_wrapped_inside_the_loss_figure(study, tmp_path):
    """A verdict line longer than the figure is wide is wrapped, its words all drawn, none past
    the figure's right edge."""
    from launch.tools.compare_runs import plot_loss

    root, _ = study
    long = ["mxfp8: " + " ".join(f"word{i}" for i in range(60))]
    with saved_figures() as figs:
        shown = plot_loss(compare(collect([str(root)])), tmp_path / "loss.png", long)
    assert shown["texts"] == long and len(shown["drawn"]) > 1
    assert " ".join(piece.strip() for piece in shown["drawn"]).split() == long[0].split()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figs["loss.png"]
    renderer = FigureCanvasAgg(fig).get_renderer()
    (text,) = [t for t in fig.texts if "word0" in t.get_text()]
    assert text.get_window_extent(renderer).x1 <= fig.bbox.x1
