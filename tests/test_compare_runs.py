"""launch/wandb_offline.py (reading .wandb files, merging a resumed run's launches) and
launch/compare_runs.py (pairing, the table, the plots), on runs written here – no training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.compare_runs import collect, compare, format_table
from launch.compare_runs import main as compare_main
from launch.run_summary import RunSummary
from launch.wandb_offline import find_runs, iter_records, read_run, read_runs

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
    assert bf16.world_size == 2 and bf16.model == "tiny_llama4"
    table = format_table(found)
    assert "a2a MiB/step" in table and "0.760" in table

    out = tmp_path / "cmp.json"
    assert compare_main([str(sweep), "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs[0]["a2a"] == "bf16" and len(runs[0]["losses"]) == 1500
    # the plots, next to the JSON
    for png in ("comparison_loss.png", "comparison_throughput.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out


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
    assert compare_main([str(tmp_path)]) == 0
    assert (tmp_path / "comparison_loss.png").is_file()


def test_cli_errors(tmp_path):
    assert compare_main([str(tmp_path / "missing")]) == 2
    assert compare_main([str(tmp_path)]) == 1  # exists, but no runs in it
