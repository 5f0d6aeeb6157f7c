"""benchmarks/replays.py: a run's capacity replays, from its summary and console lines, as a row."""

import json

import pytest

from benchmarks.replays import main
from launch.run.run_summary import RunSummary

LINES = ["step  1/20  loss 6.8  tokens/s 300  eta 9s",
         "step 3: a symm dispatch needed more expert rows than its capacity; capacity grown (1,024 -> 1,408 rows), "
         "step run again (a2a/replays = 1)",
         "step 9: a symm dispatch needed more expert rows than its capacity; capacity grown (1,408 -> 1,600 rows), "
         "step run again (a2a/replays = 2)"]


@pytest.mark.parametrize("with_console", [True, False])
def test_an_exported_run_becomes_a_row(tmp_path, with_console):
    export = tmp_path / "export"
    export.mkdir()
    summary = RunSummary(run_name="x", experiment="e", a2a="mxfp8", a2a_legs={}, model="parity_dsv3",
                         model_flavor="deepseek_v3/parity", parallelism="ep2_shared_gpu", world_size=2, ep=2,
                         launcher="local", device="cuda", run_dir="/r", steps=20, target_steps=20, seed=1,
                         val_logged_steps=[10, 20], val_losses=[5.0, 4.5], final_val_loss=4.5,
                         capacity_replays=2, capacity_replay_steps=[3, 9], capacity_rows=1600)
    (export / "mxfp8_seed1.summary.json").write_text(json.dumps(summary.__dict__))
    if with_console:
        (export / "mxfp8_seed1.console.log").write_text("\n".join(LINES) + "\n")
    main([str(export), "--out", str(tmp_path / "rows")])
    (path,) = (tmp_path / "rows").glob("*_capacity_replays.jsonl")
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["bench"] == "capacity_replays" and row["run"] == "mxfp8_seed1" and row["seed"] == 1
    assert row["capacity_replays"] == 2 and row["capacity_replay_steps"] == [3, 9] and row["last_replay_step"] == 9
    assert row["capacity_rows"] == 1600 and (row["start_capacity_rows"] == 1024 or not with_console)
    assert "cut_off" not in row
    assert (row["val_step"], row["val_loss"], row["steps"]) == (20, 4.5, 20)


def test_a_run_cut_off_before_its_summary_becomes_a_row_from_its_console(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    lines = LINES + ["step 10/20  val loss 5.2500", "step 10/20  loss 5.9  tokens/s 300  eta 4s",
                     "step 12/20  loss 5.8  tokens/s 300  eta 3s"]
    (export / "mxfp8_all_seed1.console.log").write_text("\n".join(lines) + "\n")
    main([str(export), "--out", str(tmp_path / "rows"), "--set", "ep=2", "--set", 'model="parity_dsv3"',
          "--set", "gpu_shared=true"])
    (path,) = (tmp_path / "rows").glob("*_capacity_replays.jsonl")
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert (row["a2a"], row["seed"], row["ep"], row["model"], row["gpu_shared"]) == ("mxfp8_all", 1, 2,
                                                                                      "parity_dsv3", True)
    assert row["cut_off"] is True and row["steps"] == 12
    assert row["capacity_replay_steps"] == [3, 9] and row["capacity_rows"] == 1600
    assert row["start_capacity_rows"] == 1024 and (row["val_step"], row["val_loss"]) == (10, 5.25)


def test_runs_with_the_same_losses_have_the_same_digest_and_their_memory(tmp_path):
    def run(name, losses, gib):
        d = tmp_path / name
        d.mkdir()
        summary = RunSummary(run_name=name, experiment="e", a2a="mxfp8", a2a_legs={}, model="parity_dsv3",
                             model_flavor="deepseek_v3/parity", parallelism="ep4_shared_gpu", world_size=4, ep=4,
                             launcher="local", device="cuda", run_dir=str(d), steps=len(losses),
                             target_steps=len(losses), losses=losses, max_memory_gib=gib)
        (d / "summary.json").write_text(json.dumps(summary.__dict__))
        return d

    dirs = [run("full_elastic", [6.5, 6.25, 6.0], 12.5), run("full_worst", [6.5, 6.25, 6.0], 14.0),
            run("other", [6.5, 6.25, 6.000001], 12.5)]
    main([*map(str, dirs), "--out", str(tmp_path / "rows")])
    (path,) = (tmp_path / "rows").glob("*_capacity_replays.jsonl")
    rows = {r["run"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert rows["full_elastic"]["losses_sha256"] == rows["full_worst"]["losses_sha256"] is not None
    assert rows["other"]["losses_sha256"] != rows["full_worst"]["losses_sha256"]
    assert (rows["full_elastic"]["max_memory_gib"], rows["full_worst"]["max_memory_gib"]) == (12.5, 14.0)
