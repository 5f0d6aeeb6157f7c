"""scripts/parity_study.py without starting a run: the arms and the runs their commands compose,
what each call does with a run dir (new / resume / done), the dry run and the refusal of an
unknown study, and a finished study (fake finished run dirs) turned into its comparison, its
rows (each value traced back to its run's summary, the verdict to the bf16 runs') and its
export."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from launch.run.run_dir import CONSOLE_LOG, RUN_CONFIG, SUMMARY, run_name
from launch.run.run_summary import RunSummary, numerics_metric
from launch.tools.compare_runs import PARITY_SHARE
from mxfp8_ep.config import A2AConfig
from tests.hydra_compose import REPO, compose_cfg

spec = importlib.util.spec_from_file_location("parity_study", REPO / "scripts" / "parity_study.py")
parity_study = importlib.util.module_from_spec(spec)
sys.modules["parity_study"] = parity_study  # dataclasses look their module up there
spec.loader.exec_module(parity_study)


def _summary(arm, out: Path, **fields) -> RunSummary:
    """What the trainer leaves in ``arm``'s run dir (``fields`` on top), written there."""
    cmd = parity_study.command(arm, out, "new", [])
    quantized = A2AConfig.preset(arm.a2a).any_quantized
    symm = arm.study == "dsv3_symm"
    s = RunSummary(run_name=run_name(cmd[2:], arm.a2a), experiment=arm.recipe, a2a=arm.a2a,
                   a2a_legs={"dispatch_fwd": "mxfp8" if quantized else "bf16", "transport": "symm" if symm else "auto",
                             "capacity_factor": 1.25},
                   model=arm.recipe, model_flavor=f"f/{arm.recipe}", parallelism="ep2_shared_gpu" if symm else "single",
                   world_size=2 if symm else 1, ep=2 if symm else 1, gpu_shared=symm, launcher="local", device="cuda",
                   run_dir=str(arm.run_dir(out)), steps=3000, target_steps=3000, seed=arm.seed)
    for name, value in fields.items():
        setattr(s, name, value)
    arm.run_dir(out).mkdir(parents=True, exist_ok=True)
    s.write(arm.run_dir(out))
    return s


def test_arms_are_the_study():
    arms = {(a.study, a.a2a, a.seed) for a in parity_study.ARMS}
    assert arms == {("dsv3", "bf16", 0), ("dsv3", "bf16", 1), ("dsv3", "mxfp8", 0),
                    ("dsv3", "mxfp8_all", 0), ("llama4", "bf16", 0), ("llama4", "mxfp8_all", 0),
                    ("dsv3_symm", "bf16", 0), ("dsv3_symm", "bf16", 1), ("dsv3_symm", "bf16", 2),
                    ("dsv3_symm", "mxfp8_all", 0), ("dsv3_symm", "mxfp8_all", 1), ("dsv3_symm", "mxfp8", 0),
                    ("dsv3_symm", "mxfp8", 1), ("dsv3_symm", "mxfp8", 2)}
    assert list(parity_study.STUDIES) == ["dsv3", "llama4", "dsv3_symm"]
    assert len({a.run_dir(Path("out")) for a in parity_study.ARMS}) == len(parity_study.ARMS)


@pytest.mark.parametrize("arm", parity_study.ARMS, ids=lambda a: f"{a.study}/{a.name}")
def test_each_arm_command_composes_its_run(arm, tmp_path):
    """The command's overrides, composed as train.py composes them: the study's recipe, the arm's
    preset and seed, its run dir. EP 1 studies: one process, the MXFP8 arms with every row through
    MXFP8 and the telemetry on (without them they would train like bf16 at EP 1). The symm study:
    EP 2 with both ranks on the one GPU, the symm transport, 4 sequences per rank (the EP 1
    study's global batch, so the same schedule and validation tokens), the rows that stay
    unquantized, the telemetry on the MXFP8 arms."""
    plain = compose_cfg(f"+recipe={arm.recipe}")
    cmd = parity_study.command(arm, tmp_path, "new", ["training.steps=9"])
    assert cmd[:2] == [sys.executable, str(REPO / "launch" / "train.py")]
    cfg = compose_cfg(*cmd[2:], hydra_node=True)
    assert cfg.a2a.name == arm.a2a and cfg.training.seed == arm.seed and cfg.training.steps == 9
    assert cfg.hydra.run.dir == str(arm.run_dir(tmp_path))
    quantized = A2AConfig.preset(arm.a2a).any_quantized
    assert quantized == (arm.a2a != "bf16")
    assert cfg.logging.numerics_every == (50 if quantized else plain.logging.numerics_every)
    assert (cfg.training.dataset, cfg.training.seq_len, cfg.training.lr, cfg.training.warmup_steps,
            cfg.training.val_every, cfg.training.val_batches) == (
        plain.training.dataset, plain.training.seq_len, plain.training.lr, plain.training.warmup_steps,
        plain.training.val_every, plain.training.val_batches)
    p = cfg.parallelism
    if arm.study == "dsv3_symm":
        assert cfg.experiment == "parity_dsv3_symm" and cfg.model.name == "parity_dsv3"
        assert (p.ep, p.procs_per_node, p.share_gpu, cfg.a2a.transport) == (2, 2, True, "symm")
        assert p.procs_per_node * cfg.training.local_batch_size == plain.training.local_batch_size
        assert cfg.a2a.quantize_local_rows is False
        assert cfg.a2a.capacity_factor == A2AConfig().capacity_factor  # the default elastic capacity
    else:
        assert cfg.experiment == arm.recipe == f"parity_{arm.study}"
        assert (p.ep, p.procs_per_node, p.share_gpu) == (1, 1, False)
        assert cfg.a2a.quantize_local_rows is quantized
        assert cfg.training.local_batch_size == plain.training.local_batch_size

    resumed = compose_cfg(*parity_study.command(arm, tmp_path, "resume", [])[2:])
    assert resumed.training.resume == str(arm.run_dir(tmp_path))


def test_each_call_starts_new_resumes_or_skips(tmp_path):
    arm = parity_study.ARMS[0]
    run_dir = arm.run_dir(tmp_path)
    assert parity_study.state(arm, tmp_path)[0] == "new"
    (run_dir / "checkpoint" / "step-250").mkdir(parents=True)
    (run_dir / "checkpoint" / "step-250" / ".metadata").write_text("")
    _summary(arm, tmp_path, steps=250, stopped_by="SIGTERM")
    assert parity_study.state(arm, tmp_path)[0] == "resume"
    _summary(arm, tmp_path)
    assert parity_study.state(arm, tmp_path)[0] == "done"


def test_dry_run_prints_the_commands_and_unknown_studies_or_arms_are_refused(tmp_path, capsys):
    assert parity_study.main(["--dry-run", "--study", "llama4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("+recipe=parity_llama4") == 2 and "llama4/mxfp8_all: new" in out
    assert parity_study.main(["--dry-run", "--study", "dsv3_symm", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("parallelism=ep2_shared_gpu") == 8 and "dsv3_symm/mxfp8_seed2: new" in out
    assert parity_study.main(["--dry-run", "--study", "dsv3_symm", "--arms", "mxfp8_seed1,mxfp8_seed2",
                              "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("parallelism=ep2_shared_gpu") == 2 and "training.seed=1" in out and "training.seed=2" in out
    assert parity_study.main(["--study", "gpt", "--out", str(tmp_path)]) == 2
    assert parity_study.main(["--study", "llama4", "--arms", "mxfp8", "--out", str(tmp_path)]) == 2
    assert parity_study.main(["--parallel", "-1", "--out", str(tmp_path)]) == 2


# A finished dsv3 study: final validation loss per arm, against bf16 seed 0 (4.40) with bf16
# seed 1 as the seed spread (0.01 < PARITY_SHARE * 4.40 = 0.022): mxfp8 within, mxfp8_all outside.
FINAL_VAL = {"bf16_seed0": 4.40, "bf16_seed1": 4.41, "mxfp8": 4.415, "mxfp8_all": 4.45}
# rel_l2_err per MoE layer of the MXFP8 arms' dispatch_fwd (mean over the samples).
REL_L2 = {1: 0.026, 2: 0.029}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small corpus folder whose manifest names its sha256 and package versions."""
    import json

    from tests.corpus_files import sample_texts, write_corpus

    root = write_corpus(tmp_path_factory.mktemp("corpus") / "c", sample_texts(4), sample_texts(2, offset=9))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.update(sha256="5" * 64, packages=[{"package": "manpages", "version": "6.03-2"},
                                               {"package": "git-doc", "version": "1:2.39.5-0+deb12u3"}])
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


CORPUS_ROW = {"corpus_sha256": "5" * 64, "corpus_packages": {"manpages": "6.03-2", "git-doc": "1:2.39.5-0+deb12u3"}}


def _finish(arm, out: Path, i: int, corpus: Path, final_val: float | None = None) -> RunSummary:
    """A finished run of ``arm``: its summary (numbers particular to the arm), console, config
    (training on ``corpus``), a checkpoint, worker logs, a wandb file and the study's launch log."""
    numerics = {}
    if A2AConfig.preset(arm.a2a).any_quantized:
        for layer, err in REL_L2.items():
            numerics[numerics_metric("dispatch_fwd", "rel_l2_err", layer)] = {
                "n": 3, "mean": err + i / 1000, "min": err - 0.001, "max": err + 0.005, "last": err}
            numerics[numerics_metric("dispatch_fwd", "scale_exp_min", layer)] = {
                "n": 3, "mean": -8.0, "min": -9.0 - layer - i, "max": -8.0, "last": -8.0}
    val = FINAL_VAL[arm.name] if final_val is None else final_val
    replays = [120, 130] if arm.study == "dsv3_symm" and arm.seed == 0 else []
    s = _summary(arm, out, logged_steps=[10, 3000], losses=[9.0 + i, 4.5 + i / 100],
                 val_logged_steps=[100, 3000], val_losses=[7.0 + i, val], final_loss=4.5 + i / 100,
                 final_val_loss=val, tokens_per_s=1e4 + i, tokens_per_s_global=1e4 + i,
                 step_time_s=0.1 + i / 100, a2a_bytes_per_step=0.0, numerics=numerics,
                 capacity_replays=len(replays), capacity_replay_steps=replays)
    run_dir = arm.run_dir(out)
    for path in (CONSOLE_LOG, "checkpoint/step-3000/.metadata", "worker_logs/0/stdout.log", "wandb/debug.log"):
        (run_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / path).write_text(f"{arm.name} {path}\n")
    (run_dir / RUN_CONFIG).write_text(f"training:\n  dataset: debian_docs\n  dataset_path: {corpus}\n")
    (run_dir.parent / f"{arm.name}.launch.log").write_text("$ train.py\n")
    return s


def test_a_finished_study_becomes_its_comparison_rows_and_export(tmp_path, monkeypatch, capsys, corpus):
    """One row per arm from its run's summary, the verdict against bf16 seed 0 with bf16 seed 1's
    distance as the seed spread, the worst layer of each numerics statistic; the export holds the
    rows and the small files, not the checkpoints or worker logs."""
    from benchmarks.rows import COMMIT_ENV, read_rows

    monkeypatch.setenv(COMMIT_ENV, "a" * 40)
    monkeypatch.setattr(parity_study, "_start", lambda *a: pytest.fail(f"started {a}"))
    out, export = tmp_path / "out", tmp_path / "export"
    arms = [a for a in parity_study.ARMS if a.study == "dsv3"]
    summaries = {a.name: _finish(a, out, i, corpus) for i, a in enumerate(arms)}

    assert parity_study.main(["--study", "dsv3", "--out", str(out), "--export", str(export)]) == 0
    printed = capsys.readouterr().out
    assert "  dsv3/mxfp8_all    done: step 3000/3000, loss 4.5300, val loss 4.4500, 0.130 s/step" in printed

    rows = read_rows(export)
    assert len(rows) == len(arms) and {r["commit"] for r in rows} == {"a" * 40}
    by_name = {r["run_name"]: r for r in rows}
    assert set(by_name) == {s.run_name for s in summaries.values()}
    base = summaries["bf16_seed0"]
    spread = abs(FINAL_VAL["bf16_seed1"] - FINAL_VAL["bf16_seed0"])
    tolerance = max(spread, PARITY_SHARE * base.final_val_loss)
    for name, s in summaries.items():
        row = by_name[s.run_name]
        where = f"{name}: {row}"
        assert row["bench"] == "parity" and row["study"] == "dsv3", where
        assert (row["model"], row["arm"], row["seed"], row["ep"], row["world_size"], row["device"],
                row["steps"]) == (s.model, s.a2a, s.seed, s.ep, s.world_size, s.device, s.steps), where
        assert (row["final_loss"], row["final_val_loss"], row["val_steps"], row["val_losses"]) == (
            s.final_loss, s.final_val_loss, s.val_logged_steps, s.val_losses), where
        assert (row["tokens_per_s"], row["step_time_s"], row["a2a_bytes_per_step"]) == (
            s.tokens_per_s, s.step_time_s, s.a2a_bytes_per_step), where
        assert row["baseline"] == base.run_name, where
        assert {k: row[k] for k in CORPUS_ROW} == CORPUS_ROW, where
        assert (row["gpu_shared"], row["transport"], row["capacity_factor"], row["capacity_replays"]) == (
            False, "auto", 1.25, 0), where
        if name == "bf16_seed0":
            assert row["val_loss_delta"] is None and row["within_tolerance"] is None, where
            assert row["verdict"] is None, where
            continue
        assert row["val_loss_delta"] == pytest.approx(s.final_val_loss - base.final_val_loss), where
        assert row["bf16_seed_spread"] == pytest.approx(spread), where
        assert row["tolerance"] == pytest.approx(tolerance), where
        assert (row["reference"], row["bf16_seeds"]) == ("bf16 seed 0", 2), where
        # the seed replica's line is the spread itself: no verdict of its own
        within = {"bf16_seed1": None, "mxfp8": True, "mxfp8_all": False}[name]
        assert row["within_tolerance"] is within, where
        if within is not None:
            assert ("-> within " if within else "-> outside ") in row["verdict"], where

    # the worst layer: the largest mean rel_l2_err, the smallest scale exponent seen
    for i, arm in enumerate(arms):
        worst = by_name[summaries[arm.name].run_name]["numerics_worst"]
        if arm.a2a == "bf16":
            assert worst == {}, arm
        else:
            assert worst == {"dispatch_fwd": {"rel_l2_err": pytest.approx(max(REL_L2.values()) + i / 1000),
                                              "scale_exp_min": -9.0 - max(REL_L2) - i}}, arm

    exported = {str(p.relative_to(export)) for p in export.rglob("*") if p.is_file()}
    small = {f"dsv3/{a.name}/{f}" for a in arms for f in (SUMMARY, CONSOLE_LOG, RUN_CONFIG, "wandb/debug.log")}
    small |= {f"dsv3/{a.name}.launch.log" for a in arms}
    small |= {f"dsv3/{f}" for f in ("comparison.json", "comparison_loss.png", "comparison_throughput.png",
                                    "comparison.txt")}
    assert exported == small | {p.name for p in export.glob("*.jsonl")}


# The symm study's final validation losses: bf16 mean 4.41, sample std 0.01; the bound is
# max(2 × 0.01, 0.5% × 4.41) = 0.02205. mxfp8_all seed 1 lies outside it.
SYMM_VAL = {"bf16_seed0": 4.40, "bf16_seed1": 4.41, "bf16_seed2": 4.42, "mxfp8_all_seed0": 4.415,
            "mxfp8_all_seed1": 4.385, "mxfp8": 4.43, "mxfp8_seed1": 4.42, "mxfp8_seed2": 4.44}


class _FakeArm:
    """Stands in for an arm's launch/train.py process: running for ``polls`` polls, then its run
    finished (``_finish``)."""

    running: set = set()
    most = 0

    def __init__(self, arm, out, corpus, polls):
        self.arm, self.out, self.corpus, self.left, self.pid = arm, out, corpus, polls, 1000 + len(self.running)
        self.returncode = None
        _FakeArm.running.add(arm)
        _FakeArm.most = max(_FakeArm.most, len(_FakeArm.running))

    def poll(self):
        if self.returncode is None:
            self.left -= 1
            if self.left <= 0:
                _finish(self.arm, self.out, 0, self.corpus, SYMM_VAL[self.arm.name])
                _FakeArm.running.discard(self.arm)
                self.returncode = 0
        return self.returncode

    def wait(self):
        return self.returncode


def test_symm_arms_run_n_at_a_time_and_write_rows_as_each_finishes(tmp_path, monkeypatch, corpus):
    """--parallel 2: never more than two arms at once, the next starting as one ends; after each
    arm the study's rows hold every finished arm (written again, not appended), and in the end
    the seed-based verdict: each MXFP8 run against the mean of the three bf16 seeds."""
    import statistics

    from benchmarks.rows import COMMIT_ENV, read_rows

    monkeypatch.setenv(COMMIT_ENV, "b" * 40)
    monkeypatch.setattr(parity_study, "POLL_S", 0)
    _FakeArm.running, _FakeArm.most = set(), 0
    out, export = tmp_path / "out", tmp_path / "export"
    polls = iter([2, 5, 1, 3, 2, 4, 1, 2])
    monkeypatch.setattr(parity_study, "_start",
                        lambda arm, o, extra: ("new", _FakeArm(arm, o, corpus, next(polls))))
    counts = []
    study_rows = parity_study.study_rows

    def counted(*a, **k):
        path = study_rows(*a, **k)
        counts.append(len(read_rows(path)))
        return path

    monkeypatch.setattr(parity_study, "study_rows", counted)
    assert parity_study.main(["--study", "dsv3_symm", "--parallel", "2", "--out", str(out),
                              "--export", str(export)]) == 0
    assert _FakeArm.most == 2
    assert counts == [1, 2, 3, 4, 5, 6, 7, 8, 8]  # one more row after each arm, then the final write
    rows = {f"{r['arm']}/{r['seed']}": r for r in read_rows(export)}
    assert len(rows) == 8
    mean, std = statistics.fmean([4.40, 4.41, 4.42]), statistics.stdev([4.40, 4.41, 4.42])
    bound = max(2 * std, 0.005 * mean)
    for key, row in rows.items():
        assert (row["study"], row["ep"], row["world_size"], row["gpu_shared"], row["transport"]) == (
            "dsv3_symm", 2, 2, True, "symm"), key
        assert (row["reference"], row["bf16_seeds"]) == ("bf16 mean of 3 seeds", 3), key
        assert (row["bf16_mean_val_loss"], row["bf16_std_val_loss"], row["tolerance"]) == pytest.approx(
            (mean, std, bound)), key
        assert row["val_loss_delta"] == pytest.approx(row["final_val_loss"] - mean), key
        assert {k: row[k] for k in CORPUS_ROW} == CORPUS_ROW, key
    assert rows["mxfp8_all/0"]["within_tolerance"] is True
    assert rows["mxfp8_all/1"]["within_tolerance"] is False  # -0.025 from the mean
    assert rows["mxfp8/0"]["within_tolerance"] is True
    assert rows["mxfp8/2"]["within_tolerance"] is False  # +0.03 from the mean
    assert rows["bf16/2"]["within_tolerance"] is None
    assert (rows["mxfp8/0"]["capacity_replays"], rows["mxfp8/0"]["capacity_replay_steps"]) == (2, [120, 130])
    assert "vs bf16 mean of 3 seeds" in rows["mxfp8_all/1"]["verdict"]


def test_the_deadline_starts_no_more_arms_and_stops_the_running_ones(tmp_path, monkeypatch, corpus):
    """Arms that never end on their own: at the deadline the running ones get SIGTERM and the
    waiting ones are not started."""
    monkeypatch.setattr(parity_study, "POLL_S", 0)
    _FakeArm.running, _FakeArm.most = set(), 0
    started, signalled = [], []

    def start(arm, out, extra):
        started.append(arm.name)
        return "new", _FakeArm(arm, out, corpus, 10**9)

    def signal_all(procs, sig):
        signalled.append((sorted(a.name for a in procs), sig))
        for p in procs.values():
            p.returncode = 143

    clock = iter([0.0, 0.0] + [100.0] * 10)  # the start, the first round, then past the deadline
    monkeypatch.setattr(parity_study.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(parity_study, "_start", start)
    monkeypatch.setattr(parity_study, "_signal_all", signal_all)
    arms = [a for a in parity_study.ARMS if a.study == "dsv3_symm"]
    codes = parity_study.run(arms, tmp_path, deadline_s=50.0, grace_s=60.0, extra=[], parallel=2)
    assert started == ["bf16_seed0", "bf16_seed1"]
    assert signalled == [(["bf16_seed0", "bf16_seed1"], parity_study.signal.SIGTERM)]
    assert sorted(a.name for a in codes) == ["bf16_seed0", "bf16_seed1"] and set(codes.values()) == {143}
