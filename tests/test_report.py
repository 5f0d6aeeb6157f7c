"""benchmarks/report.py: the committed docs/results.md and README block are what the generator makes
of the committed rows (CI's check), staleness follows git history, claims pick exactly one row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report
from tests.needs_git import full_history, git_checkout, git_command

REPO = Path(__file__).resolve().parents[1]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


@full_history
def test_committed_report_is_current():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr


def test_check_fails_with_a_diff_when_the_report_is_edited(tmp_path, monkeypatch, capsys):
    readme, results = tmp_path / "README.md", tmp_path / "results.md"
    readme.write_text("# x\n\n<!-- results:begin -->\nold\n<!-- results:end -->\n\nrest\n"
                      "<!-- numerics:begin -->\nold\n<!-- numerics:end -->\n"
                      "<!-- capacity:begin -->\nold\n<!-- capacity:end -->\n")
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "REPORT", results)
    monkeypatch.setattr(report, "REPO", tmp_path)
    assert report.main(["--check"]) == 1  # neither file is what the generator makes
    assert "results.md (generated)" in capsys.readouterr().out
    assert report.main([]) == 0
    text = readme.read_text()
    problem = report.History().problem  # said first where this tree has no git history (the test image)
    note = f"Note: {problem}.\n\n" if problem else ""
    assert text.startswith(f"# x\n\n<!-- results:begin -->\n{note}Each figure against its target") and \
        "\n| result |" in text and "<!-- results:end -->\n\nrest\n<!-- numerics:begin -->\nFinal validation" in text
    assert "<!-- numerics:end -->\n<!-- capacity:begin -->\n- Measured, one DeepSeek-V3-like" in text
    assert text.endswith("<!-- capacity:end -->\n") and "\n| setup | bf16 |" in text
    assert report.main(["--check"]) == 0
    readme.write_text(text.replace("4.4019 (−0.36%)", "4.3000 (−2.66%)"))  # a hand-edited parity figure
    assert report.main(["--check"]) == 1
    assert "-| DeepSeek-V3-like 117M" in capsys.readouterr().out
    readme.write_text(text)
    results.write_text(results.read_text().replace("1.349×", "1.50×"))  # a hand-edited figure
    assert report.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "-| DeepSeek-V3-like MoE layer, fwd+bwd, mxfp8/symm vs torchtitan | 1.50×" in out
    readme.write_text("# no markers\n")
    assert report.main([]) == 2


def test_output_has_no_clock_and_every_run_appears(monkeypatch):
    one, readme_one = report.build()
    two, readme_two = report.build()
    assert (one, readme_one) == (two, readme_two)
    runs = sorted(p.name for p in report.RESULTS.glob("*.jsonl"))
    assert runs and all(f"### `{name}`" in one for name in runs)
    assert one.count("- command, as run at `") == len(runs)
    assert one.count("- to run it now (from the repository root): `") == len(runs)


def _repo_with_history(tmp_path: Path) -> tuple[Path, dict]:
    repo = tmp_path / "repo"
    (repo / "mxfp8_ep").mkdir(parents=True)
    _git(repo, "init", "-q")
    commits = {}
    for name, path in (("a", "mxfp8_ep/x.py"), ("b", "mxfp8_ep/x.py"), ("c", "docs/y.py"),
                       ("d", "mxfp8_ep/README.md")):
        (repo / path).parent.mkdir(exist_ok=True)
        (repo / path).write_text(name)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", name)
        commits[name] = _git(repo, "rev-parse", "HEAD")
    return repo, commits


@git_command
def test_stale_when_a_later_commit_touched_the_measured_paths(tmp_path):
    repo, c = _repo_with_history(tmp_path)
    h = report.History(repo)
    assert h.problem is None
    assert h.status(c["a"], ("mxfp8_ep/",)) == "STALE"  # b changed mxfp8_ep/ after a
    assert h.status(c["b"], ("mxfp8_ep/",)) == "current"  # c touched docs/, d only prose
    assert h.status(c["b"], ("mxfp8_ep/", "docs/")) == "STALE"
    assert h.status(c["d"], ("mxfp8_ep/",)) == "current"  # the clone's one commit
    assert h.status("0" * 40, ("mxfp8_ep/",)) == "unknown"  # not in this history


@git_command
def test_prose_under_the_measured_paths_does_not_make_a_run_stale(tmp_path):
    repo, c = _repo_with_history(tmp_path)
    h = report.History(repo)
    assert h.status(c["c"], ("mxfp8_ep/",)) == "current"  # d edited mxfp8_ep/README.md only
    (repo / "mxfp8_ep" / "x.py").write_text("e")
    _git(repo, "commit", "-qam", "e")
    assert report.History(repo).status(c["c"], ("mxfp8_ep/",)) == "STALE"


def test_without_history_status_is_unknown_and_said(tmp_path):
    plain = tmp_path / "copy"
    plain.mkdir()
    h = report.History(plain)
    assert h.problem and "no git history" in h.problem
    assert h.status("a" * 40, ("mxfp8_ep/",)) == "unknown"


@git_command
def test_shallow_clone_is_named(tmp_path):
    repo, c = _repo_with_history(tmp_path)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(clone)], check=True,
                   capture_output=True)
    h = report.History(clone)
    assert h.problem and "shallow" in h.problem
    assert h.status(c["a"], ("mxfp8_ep/",)) == "unknown"  # the clone lacks that commit
    assert h.status(c["d"], ("mxfp8_ep/",)) == "current"  # the clone's one commit


def _run(tmp_path: Path, rows: list[dict]) -> dict:
    path = tmp_path / "2026-01-01_abcdef0_h200x2_layer.jsonl"
    prov = {"bench": "layer", "commit": "abcdef0" * 5 + "ab", "dirty": False, "date": "2026-01-01T00:00:00Z",
            "machine": {"gpu": "NVIDIA H200", "count": 2, "link": "nvlink", "host_cpus": 16},
            "versions": {"torch": "2.11"}, "command": "x"}
    path.write_text("".join(json.dumps({**prov, **r}) + "\n" for r in rows))
    return report.load_runs(tmp_path)


def test_claims_compute_ratios_and_differences(tmp_path):
    runs = _run(tmp_path, [
        {"shape": "dsv3", "pass": "fwd+bwd", "arm": "torchtitan", "ms": 60.0, "peak_gib": 50.0, "tok": 100.0},
        {"shape": "dsv3", "pass": "fwd+bwd", "arm": "mxfp8/symm", "ms": 40.0, "peak_gib": 51.5, "tok": 150.0},
        {"shape": "dsv3", "pass": "fwd", "arm": "mxfp8/symm", "ms": 10.0},
    ])
    base = {"id": "x", "claim": "c", "run": "2026-01-01_abcdef0_h200x2_layer.jsonl",
            "where": {"shape": "dsv3", "pass": "fwd+bwd"}, "row": {"arm": "mxfp8/symm"},
            "baseline": {"arm": "torchtitan"}}
    lower = report.evaluate({**base, "key": "ms", "better": "lower", "target": 1.42}, runs)
    assert lower.value == pytest.approx(1.5) and lower.met() == "yes" and lower.figure() == "1.500×"
    higher = report.evaluate({**base, "key": "tok", "better": "higher", "target": 1.6}, runs)
    assert higher.value == pytest.approx(1.5) and higher.met() == "no"
    diff = report.evaluate({**base, "key": "peak_gib", "compare": "difference"}, runs)
    assert diff.figure() == "+1.50 GiB"
    assert "2 rows match" in report.evaluate({**base, "where": {}}, runs).error  # fwd and fwd+bwd
    assert "0 rows match" in report.evaluate({**base, "row": {"arm": "bf16/symm"}}, runs).error
    assert "no run file" in report.evaluate({**base, "run": "absent.jsonl"}, runs).error
    assert report.Run("r", runs[base["run"]].rows).hardware() == "2× H200, NVLink"


def test_value_claims_are_met_within_their_rows_own_bound(tmp_path):
    runs = _run(tmp_path, [
        {"study": "dsv3", "arm": "mxfp8", "val_loss_delta": -0.0157, "tolerance": 0.0221},
        {"study": "dsv3", "arm": "mxfp8_all", "val_loss_delta": 0.03, "tolerance": 0.0221},
    ])
    spec = {"id": "p", "claim": "c", "run": "2026-01-01_abcdef0_h200x2_layer.jsonl", "where": {"study": "dsv3"},
            "key": "val_loss_delta", "compare": "value", "limit_key": "tolerance"}
    inside = report.evaluate({**spec, "row": {"arm": "mxfp8"}}, runs)
    assert inside.figure() == "-0.0157" and inside.met() == "yes" and inside.target() == "|Δ| ≤ 0.0221"
    outside = report.evaluate({**spec, "row": {"arm": "mxfp8_all"}}, runs)
    assert outside.figure() == "+0.0300" and outside.met() == "no"


def test_claims_file_limits_the_readme_table(tmp_path):
    claims = [{"id": f"c{i}", "claim": "c", "readme": True} for i in range(16)]
    path = tmp_path / "claims.yaml"
    path.write_text(json.dumps({"claims": claims}))  # JSON is YAML
    with pytest.raises(ValueError, match="at most 15"):
        report.load_claims(path)
    path.write_text(json.dumps({"claims": [{"id": "a"}, {"id": "a"}]}))
    with pytest.raises(ValueError, match="used twice"):
        report.load_claims(path)
    committed = report.load_claims()
    assert 0 < sum(bool(c.get("readme")) for c in committed) <= 15
    assert all("target" in c for c in committed if c.get("readme"))


def test_every_committed_row_names_its_provenance():
    """Each row: commit, date, machine, versions and command; the file name says the same."""
    from benchmarks.rows import PROVENANCE_KEYS, Machine

    files = sorted(report.RESULTS.glob("*.jsonl"))
    assert files
    for path in files:
        for row in report.read_rows(path):
            assert set(PROVENANCE_KEYS) <= set(row), (path.name, sorted(set(PROVENANCE_KEYS) - set(row)))
            assert len(row["commit"]) == 40 and int(row["commit"], 16) >= 0, path.name
            assert row.get("commit_source", "recorded") in ("recorded", "inferred"), path.name
            machine = Machine(**row["machine"])
            assert machine.gpu and machine.count >= 1 and machine.link, path.name
            assert row["versions"].get("torch") and row["command"].strip(), path.name
            expect = f"{row['date'][:10]}_{row['commit'][:7]}_{machine.slug}_{row['bench']}.jsonl"
            assert path.name == expect, (path.name, expect)


@git_checkout
def test_an_explicit_commit_wins_over_git(tmp_path, monkeypatch):
    """A tree copied to a GPU machine can carry a .git of another commit than its files."""
    from benchmarks import rows

    monkeypatch.setenv(rows.COMMIT_ENV, "f" * 40)
    commit, dirty, why = rows.git_commit()
    assert (commit, dirty) == ("f" * 40, None) and rows.DIRTY_ENV in why  # not in this history
    written = rows.ResultsFile("demo", tmp_path, machine=rows.Machine("NVIDIA H200", 1, "none", 16),
                               versions={"torch": "2.11.0+cu130"}, command="python x.py").write(ms=1.0)
    assert written["commit"] == "f" * 40 and written["versions"] == {"torch": "2.11.0+cu130"}
    assert written["dirty"] is None and written["dirty_reason"] == why
    assert (tmp_path / f"{written['date'][:10]}_fffffff_h200x1_demo.jsonl").is_file()
    monkeypatch.delenv(rows.COMMIT_ENV)
    assert rows.git_commit()[0] == subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                                  capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("commit", ["9db6276", "F" * 40, "f" * 39])
def test_an_explicit_commit_must_be_the_full_id(commit, monkeypatch):
    """Every row records the full commit: an abbreviated one is refused before anything runs."""
    from benchmarks import rows

    monkeypatch.setenv(rows.COMMIT_ENV, commit)
    with pytest.raises(ValueError, match="full 40-character id"):
        rows.git_commit()


def test_every_claim_id_the_design_notes_cite_exists():
    """docs/design.md cites its figures by claim id ("[parity-dsv3-mxfp8]"); each must name a
    claim of benchmarks/claims.yaml, so a figure there always has its row in docs/results.md."""
    import re

    import yaml

    ids = {c["id"] for c in yaml.safe_load((REPO / "benchmarks" / "claims.yaml").read_text())["claims"]}
    cited = set(re.findall(r"\[([a-z0-9]+(?:-[a-z0-9]+)+)\](?!\()", (REPO / "docs" / "design.md").read_text()))
    assert cited and cited <= ids, f"cited in docs/design.md but not in claims.yaml: {sorted(cited - ids)}"


@git_command
def test_dirty_of_a_copied_tree_is_what_its_files_say_or_unknown(tmp_path, monkeypatch):
    """A copy of the tree (no .git, or a .git of another commit) named by $MXFP8EP_COMMIT."""
    import shutil

    from benchmarks import rows

    repo, c = _repo_with_history(tmp_path)
    monkeypatch.setenv(rows.COMMIT_ENV, c["b"])
    # with a .git that holds the commit: the files against that commit, whatever HEAD is
    assert rows.git_commit(repo) == (c["b"], True, None)  # HEAD is d: the tree is not b's
    _git(repo, "checkout", "-q", c["b"])
    assert rows.git_commit(repo) == (c["b"], False, None)
    (repo / "mxfp8_ep" / "x.py").write_text("edited")
    assert rows.git_commit(repo) == (c["b"], True, None)
    # without one: unknown, and said why, unless the one who copied it says
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    commit, dirty, why = rows.git_commit(copy)
    assert (commit, dirty) == (c["b"], None) and "without a git history" in why
    monkeypatch.setenv(rows.DIRTY_ENV, "false")
    assert rows.git_commit(copy) == (c["b"], False, None)
    monkeypatch.setenv(rows.DIRTY_ENV, "maybe")
    with pytest.raises(ValueError, match="MXFP8EP_DIRTY"):
        rows.git_commit(copy)
    # a row written there says so
    monkeypatch.delenv(rows.DIRTY_ENV)
    monkeypatch.setattr(rows, "REPO", copy)
    row = rows.ResultsFile("demo", tmp_path / "out", machine=rows.Machine("cpu", 2, "gloo", 2),
                           versions={"torch": "x"}, command="x").write(ms=1.0)
    assert row["dirty"] is None and "without a git history" in row["dirty_reason"]


# ------------------------------------------------------------------------------ what counts as a change
CODE = '''"""A module."""


def f(x):
    """Doubles."""
    return 2 * x  # twice
'''
SAME_CODE = '''"""A module, described again."""
def f(x):
    # the comment moved
    return (2 *
            x)
'''


def test_code_ignores_comments_docstrings_and_formatting():
    assert report.code_of("m.py", CODE) == report.code_of("m.py", SAME_CODE)
    assert report.code_of("m.py", CODE) != report.code_of("m.py", CODE.replace("2 * x", "3 * x"))
    assert report.code_of("c.yaml", "a: 1  # one\nb: [2]\n") == report.code_of("c.yaml", "# lead\nb:\n  - 2\na: 1\n")
    assert report.code_of("c.yaml", "a: 1\n") != report.code_of("c.yaml", "a: 2\n")
    assert report.code_of("m.py", "def (") == "def ("  # does not parse: its text
    assert report.code_of("p.toml", "a = 1  # one\n") == report.code_of("p.toml", "# pins\na = 1\n")
    assert report.code_of("p.toml", "a = 1\n") != report.code_of("p.toml", "a = 2\n")


def test_every_bench_depends_on_the_pins_and_the_gpu_bench_script():
    for name, bench in report.BENCHES.items():
        assert set(report.EVERY_BENCH) <= set(bench.paths), name
    assert "recipes/" in report.BENCHES["capacity_replays"].paths


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


@git_command
def test_only_code_changes_mark_a_run_and_the_measuring_script_counts(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    measured = _commit(repo, {"mxfp8_ep/m.py": CODE, "benchmarks/layer.py": CODE, "benchmarks/legs.py": CODE,
                              "benchmarks/harness.py": CODE, "conf/c.yaml": "a: 1\n", "launch/l.py": CODE},
                       "measured here")
    layer, legs, train = (report.BENCHES[b].paths for b in ("layer", "legs", "train"))
    _commit(repo, {"mxfp8_ep/m.py": SAME_CODE, "conf/c.yaml": "a: 1  # why\n"}, "comments only")
    h = report.History(repo)
    assert h.status(measured, layer) == h.status(measured, train) == "current"
    _commit(repo, {"benchmarks/layer.py": CODE.replace("2 * x", "3 * x")}, "the layer bench changed")
    h = report.History(repo)
    assert h.status(measured, layer) == "STALE" and h.changed(measured, layer) == ["benchmarks/layer.py"]
    assert h.status(measured, legs) == h.status(measured, train) == "current"
    _commit(repo, {"benchmarks/layer.py": CODE}, "and back")
    assert report.History(repo).status(measured, layer) == "current"  # the code is the measured code again


class Answering(report.History):
    """A history with no problem to note, whatever git this tree has (its ``changed`` stood in)."""

    def __init__(self, repo: Path):
        super().__init__(repo)
        self.problem = None


def test_tables_show_target_met_hardware_commit_and_the_marks(tmp_path, monkeypatch):
    runs = _run(tmp_path, [
        {"shape": "dsv3", "pass": "fwd+bwd", "arm": "torchtitan", "ms": 60.0},
        {"shape": "dsv3", "pass": "fwd+bwd", "arm": "mxfp8/symm", "ms": 40.0},
    ])
    (run,) = runs.values()
    for row in run.rows:
        row.update(dirty=None, dirty_reason="copied tree without a git history")
    spec = {"id": "x", "claim": "the layer", "short": "layer", "run": run.name, "readme": True,
            "where": {"shape": "dsv3", "pass": "fwd+bwd"}, "row": {"arm": "mxfp8/symm"},
            "baseline": {"arm": "torchtitan"}, "key": "ms", "better": "lower", "target": 1.4}
    claim = report.evaluate(spec, runs)

    class Stale(Answering):
        def changed(self, commit, paths):
            return ["benchmarks/layer.py"]

    history = Stale(REPO)
    block = report.render_readme_block([claim], history)
    assert "| result | measured | target | met | hardware | commit, date | data |" in block
    assert "| layer | 1.500× † | ≥1.4× | yes | 2×H200 NVLink | `abcdef0` (dirty?) 2026-01-01 | [layer] |" in block
    lead = block.split("\n")[1]
    assert "† marks a figure whose measured code" in lead and "(dirty?): measured from a copy" in lead
    header = "\n".join(report.run_header(run, history))
    assert "dirty: unknown, copied tree without a git history" in header
    assert "**STALE**: the code changed since in `benchmarks/layer.py`" in header

    class Current(Answering):
        def changed(self, commit, paths):
            return []

    block = report.render_readme_block([claim], Current(REPO))
    assert "| layer | 1.500× | ≥1.4× | yes |" in block


@full_history
def test_report_check_in_a_clone_passes_a_comment_commit_and_marks_a_layer_bench_change(tmp_path):
    """In a clone of this repository with the layer runs made current (their rows' commit set to
    HEAD): a commit of comments and docstrings under mxfp8_ep/ leaves `--check` passing; a code
    change in benchmarks/layer.py fails it, and the report marks exactly the layer rows."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, capture_output=True)
    _git(clone, "checkout", "-q", _git(REPO, "rev-parse", "HEAD"))
    for name in ("report.py", "rows.py"):  # the report as in this working tree
        (clone / "benchmarks" / name).write_text((REPO / "benchmarks" / name).read_text())
    head = _git(clone, "rev-parse", "HEAD")
    for path in (clone / "benchmarks" / "results").glob("*_layer.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(json.dumps({**r, "commit": head}) + "\n" for r in rows))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "benchmarks.report", *args], cwd=clone, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(clone)}, timeout=120)

    def marked() -> dict[str, bool]:
        block = (clone / "README.md").read_text().split(report.BEGIN)[1].split(report.END)[0]
        cells = [line.split(" | ") for line in block.splitlines() if line.startswith("| ") and "[" in line]
        return {c[0]: c[1].endswith("†") for c in cells}

    assert run().returncode == 0
    _commit(clone, {}, "layer runs at HEAD, report regenerated")
    before = marked()
    layer = {name for name in before if "layer" in name and "titan 0.3.0" not in name}
    assert layer and not any(before[n] for n in layer)

    config = clone / "mxfp8_ep" / "config.py"
    text = config.read_text()
    first_doc_end = text.index('"""', 3)
    _commit(clone, {"mxfp8_ep/config.py": text[:first_doc_end] + " Reworded." + text[first_doc_end:]
                    + "\n# a comment at the end\n"}, "comments and a docstring")
    proc = run("--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr

    layer_py = clone / "benchmarks" / "layer.py"
    _commit(clone, {"benchmarks/layer.py": layer_py.read_text() + "\nWARMUP_DEFAULT = 3\n"}, "layer bench code")
    assert run("--check").returncode == 1
    assert run().returncode == 0
    after = marked()
    assert {n for n in after if after[n] != before[n]} == layer and all(after[n] for n in layer)


def _parity_runs(tmp_path: Path, files: dict[str, list[dict]]) -> dict:
    """Parity run files (name -> rows), the provenance of ``_run`` with the bench parity."""
    for name, rows in files.items():
        prov = {"bench": "parity", "commit": "abcdef0" * 5 + "ab", "dirty": False,
                "date": f"{name[:10]}T00:00:00Z", "machine": {"gpu": "NVIDIA H200", "count": 1, "link": "none",
                                                             "host_cpus": 16},
                "versions": {"torch": "2.11"}, "command": "x"}
        (tmp_path / name).write_text("".join(json.dumps({**prov, **r}) + "\n" for r in rows))
    return report.load_runs(tmp_path)


def _parity_row(study, arm, seed, val, **fields):
    return {"study": study, "arm": arm, "seed": seed, "final_val_loss": val, "world_size": 1, **fields}


def test_the_numerics_table_shows_each_study_from_its_newest_rows(tmp_path):
    """One row per study: the newest file's rows of it (an older file's are not shown), the bf16
    seeds (their mean ± std where the verdicts took the mean), each MXFP8 run with its distance
    in %, the bound, which runs lie outside it, the GPU shared by the ranks, and STALE marks;
    a study without rows is not measured."""
    from benchmarks import parity_table

    mean = {"reference": "bf16 mean of 3 seeds", "bf16_seeds": 3, "bf16_mean_val_loss": 4.41,
            "bf16_std_val_loss": 0.01, "tolerance": 0.02205}
    shared = {"gpu_shared": True, "world_size": 2}
    runs = _parity_runs(tmp_path, {
        "2026-01-01_abcdef0_h200x1_parity.jsonl": [_parity_row("dsv3", "bf16", 0, 9.0)],
        "2026-01-02_abcdef0_h200x1_parity.jsonl": [
            _parity_row("dsv3", "bf16", 0, 4.40), _parity_row("dsv3", "bf16", 1, 4.41, tolerance=0.022),
            _parity_row("dsv3", "mxfp8_all", 0, 4.41, val_loss_delta=0.01, tolerance=0.022, within_tolerance=True),
            *[_parity_row("dsv3_symm", "bf16", s, v, **mean, **shared) for s, v in enumerate((4.40, 4.41, 4.42))],
            _parity_row("dsv3_symm", "mxfp8", 0, 4.435, val_loss_delta=0.025, within_tolerance=False, **mean, **shared),
            *[_parity_row("dsv3_symm", "mxfp8_all", s, 4.41 + d, val_loss_delta=d, within_tolerance=abs(d) < 0.02,
                          **mean, **shared) for s, d in enumerate((0.005, -0.025))]],
    })
    block = parity_table.render(runs, lambda run: "STALE", report.MARKS, tmp_path)
    assert block.startswith(parity_table.BEGIN) and block.endswith(parity_table.END)
    lines = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0][2:] for line in lines] == [label for _, label in parity_table.STUDIES]
    dsv3, symm, llama4, cpu = lines
    assert dsv3 == ("| DeepSeek-V3-like 117M (32 experts top-4 + shared), EP=1, every row quantized | "
                    "4.4000 / 4.4100 † | – | 4.4100 (+0.23%) † | ±0.0220 | yes | 1×H200 | `abcdef0` 2026-01-02 |")
    assert symm == ("| DeepSeek-V3-like 117M, EP=2 over symm, the 2 ranks sharing one GPU | "
                    "4.4100 ± 0.0100 (3 seeds) † | "
                    "4.4350 (+0.57%) † | 4.4150 (+0.11%) / 4.3850 (−0.57%) † | ±0.0221 | "
                    "no: mxfp8, mxfp8_all seed 1 | 1×H200, 2 ranks on it | `abcdef0` 2026-01-02 |")
    assert parity_table.NOT_MEASURED in llama4 and parity_table.NOT_MEASURED in cpu
    assert "†: the code these runs measured has changed" in block
    current = parity_table.render(runs, lambda run: "current", report.MARKS, tmp_path)
    assert "†" not in current and "4.4350 (+0.57%) |" in current


def test_a_later_file_adds_seeds_to_a_study_and_they_are_judged_by_its_bf16_reference(tmp_path):
    """Seeds of an arm run later, without the study's bf16 runs: the table takes each arm and
    seed from the newest file that has it, judges the new runs against the bf16 rows' reference
    and bound, names both commits, and marks the study STALE where either file is."""
    from benchmarks import parity_table

    mean = {"reference": "bf16 mean of 3 seeds", "bf16_seeds": 3, "bf16_mean_val_loss": 4.41,
            "bf16_std_val_loss": 0.01, "tolerance": 0.022}
    runs = _parity_runs(tmp_path, {
        "2026-01-01_abcdef0_h200x1_parity.jsonl": [
            *[_parity_row("dsv3_symm", "bf16", s, v, val_loss_delta=v - 4.41, **mean) for s, v in
              enumerate((4.40, 4.41, 4.42))],
            _parity_row("dsv3_symm", "mxfp8", 0, 4.43, val_loss_delta=0.02, within_tolerance=True, **mean)],
        "2026-01-05_abcdef0_h200x1_parity.jsonl": [
            _parity_row("dsv3_symm", "mxfp8", 1, 4.40), _parity_row("dsv3_symm", "mxfp8", 2, 4.44)],
    })
    files = parity_table.study_runs(runs, "dsv3_symm")
    rows, sources = parity_table.study_rows(files, "dsv3_symm")
    assert len(rows) == 6 and sources == files
    judged = {r["seed"]: r for r in rows if r["arm"] == "mxfp8"}
    assert judged[1]["within_tolerance"] is True and judged[2]["within_tolerance"] is False
    assert abs(judged[2]["val_loss_delta"] - 0.03) < 1e-9 and judged[2]["tolerance"] == 0.022
    states = {id(files[0]): "current", id(files[1]): "STALE"}
    block = parity_table.render(runs, lambda run: states[id(run)], report.MARKS, tmp_path)
    symm = next(line for line in block.splitlines() if line.startswith("| DeepSeek-V3-like 117M, EP=2"))
    assert "4.4300 (+0.45%) / 4.4000 (−0.23%) / 4.4400 (+0.68%) †" in symm
    assert "no: mxfp8 seed 2" in symm and "`abcdef0` 2026-01-01, `abcdef0` 2026-01-05" in symm


def _bench_runs(tmp_path: Path, files: dict[str, list[dict]]) -> dict:
    for name, rows in files.items():
        prov = {"commit": "abcdef0" * 5 + "ab", "dirty": False, "date": f"{name[:10]}T00:00:00Z",
                "machine": {"gpu": "NVIDIA H200", "count": 1, "link": "shared-gpu", "host_cpus": 16},
                "versions": {"torch": "2.11"}, "command": "x"}
        (tmp_path / name).write_text("".join(json.dumps({**prov, **r}) + "\n" for r in rows))
    return report.load_runs(tmp_path)


def test_the_capacity_figures_come_from_the_newest_rows(tmp_path):
    """The README's elastic-capacity block: the layer's peak against torchtitan's, whole and
    above the weights, per EP degree; the estimate at the start, ceiling and worst case; the
    replays of long runs; STALE marks; a bench without rows is not measured."""
    from benchmarks import capacity_figures

    def layer(ep, arm, peak, above):
        return {"bench": "layer_memory", "ep": ep, "arm": arm, "pass": "fwd+bwd", "peak_gib": peak,
                "above_weights_gib": above, "dims": {"dim": 64, "experts": 8, "top_k": 2, "tokens_per_rank": 1024}}

    def est(arm, gib, factor):
        return {"bench": "memory_estimate", "model": "deepseek_v3/16B", "ep": 8, "seq_len": 4096,
                "local_batch_size": 2, "activation_checkpoint": "selective", "arm": arm, "gib": gib,
                "capacity_factor": factor}

    runs = _bench_runs(tmp_path, {
        "2026-01-01_abcdef0_h200x1_layer_memory.jsonl": [layer(2, "torchtitan", 99.0, 9.0)],
        "2026-01-02_abcdef0_h200x1_layer_memory.jsonl": [
            layer(2, "torchtitan", 20.0, 4.0), layer(2, "mxfp8/symm", 21.0, 5.0),
            layer(2, "mxfp8/symm:ceiling", 22.0, 6.0), layer(2, "mxfp8/symm:worst", 23.0, 7.0)],
        "2026-01-02_abcdef0_cpux1_memory_estimate.jsonl": [
            est("nccl", 60.0, None), est("symm", 61.0, 1.25), est("symm:ceiling", 70.0, 2.0),
            est("symm:worst", 139.0, None)],
    })
    block = capacity_figures.render(runs, lambda run: "STALE", report.MARKS)
    assert block.startswith(capacity_figures.BEGIN) and block.endswith(capacity_figures.END)
    assert "1.05× at EP=2 (1.10× at the ceiling, 1.15× at the worst case)" in block  # 21/20, 22/20, 23/20
    assert "16.0 of 20.0 GiB at EP=2" in block
    assert "above them symm needs 1.25× at EP=2 (1.50× at the ceiling, 1.75× at the worst case)" in block
    assert "61.0 GiB per GPU at the start (1.25× the balanced case), 70.0 at the ceiling (2.0×), 139.0 with every " \
           "layer at the worst case, against 60.0 on nccl" in block
    assert f"capacity_replays: {capacity_figures.NOT_MEASURED}" in block
    assert f"capacity_study: {capacity_figures.NOT_MEASURED}" in block
    assert block.count("†") == 3  # two figures and the legend
    assert "†" not in capacity_figures.render(runs, lambda run: "current", report.MARKS)


def test_the_layer_figures_take_each_ep_degree_from_its_newest_file_by_date(tmp_path):
    """Two layer files of one day: the later one (its name sorts first) measured EP=4 alone, at
    the default only; EP=2 still comes from the earlier file, with what symm holds of its peak."""
    from benchmarks import capacity_figures

    def layer(ep, arm, peak, above, **held):
        return {"bench": "layer_memory", "ep": ep, "arm": arm, "pass": "fwd+bwd", "peak_gib": peak,
                "above_weights_gib": above, "dims": {"dim": 64, "experts": 8, "top_k": 2, "tokens_per_rank": 1024},
                **held}

    held = {"peer_buffers_gib": 0.44, "activation_pool_gib": 0.0}
    files = {"2026-01-02_fffffff_h100x1_layer_memory.jsonl": ("01", [
        layer(2, "torchtitan", 20.0, 4.0), layer(2, "mxfp8/symm", 21.0, 5.0, **held),
        layer(2, "mxfp8/symm:worst", 23.0, 7.0, **held),
        layer(4, "torchtitan", 10.0, 2.0), layer(4, "mxfp8/symm", 19.0, 11.0, **held)]),
        "2026-01-02_0000000_h100x1_layer_memory.jsonl": ("05", [
            layer(4, "torchtitan", 10.0, 2.0), layer(4, "mxfp8/symm", 11.0, 3.0, **held)])}
    for name, (hour, rows) in files.items():
        prov = {"commit": name[11:18] * 5 + name[11:16], "dirty": False, "date": f"2026-01-02T{hour}:00:00Z",
                "machine": {"gpu": "NVIDIA H100 80GB HBM3", "count": 1, "link": "shared-gpu", "host_cpus": 16},
                "versions": {"torch": "2.11"}, "command": "x"}
        (tmp_path / name).write_text("".join(json.dumps({**prov, **r}) + "\n" for r in rows))
    block = capacity_figures.render(report.load_runs(tmp_path), lambda run: "current", report.MARKS)
    ep2, ep4 = (line for line in block.splitlines() if line.startswith("- Measured"))
    assert "`fffffff`" in ep2 and "1.05× at EP=2 (1.15× at the worst case)" in ep2 and "EP=4" not in ep2, ep2
    assert "(of it symm holds 0.44 GiB peer buffers and 0.00 GiB activation pool at EP=2)" in ep2, ep2
    assert "`0000000`" in ep4 and "1.10× at EP=4 of torchtitan's" in ep4 and "1.50× at EP=4" in ep4, ep4


def test_the_replay_figures_per_ep_degree_and_the_growth_study_at_the_defaults(tmp_path):
    """Each EP degree's replays from the newest file with runs at it (a later EP=4 run does not
    hide the EP=2 runs); the growth study's rows at the defaults, per EP degree."""
    from benchmarks import capacity_figures

    def replay(ep, steps, replays, last, start, end, spills=0):
        return {"bench": "capacity_replays", "model": "parity_dsv3", "ep": ep, "steps": steps,
                "capacity_replays": replays, "last_replay_step": last, "capacity_spills": spills,
                "start_capacity_rows": start, "capacity_rows": end}

    def study(ep, defaults, reruns):
        return {"bench": "capacity_study", "kind": "policy", "target": "deepseek_v3/16B", "gpus": 8, "ep": ep,
                "steps": 1500, "study_moe_layers": 26, "activation_checkpoint": "selective", "capacity_factor": 1.25,
                "headroom": 0.25, "capacity_ceiling": None, "pool_factor": 1.25, "pool_headroom": 0.1,
                "pool_ceiling": 1.5, "defaults": defaults, "replays": 2, "spills": 1, "reruns_per_1000": reruns,
                "gib_ceiling": 66.0, "gib_nccl": 60.0, "gib_nccl_routed": 62.0, "vs_nccl_routed": 1.0645}

    def loads(ep):
        return {"bench": "capacity_study", "kind": "routing", "ep": ep, "max_layer_load": 3.9, "max_rank_sum": 1.3,
                "max_rank_sum_second_half": 1.2, "rank_sum_bound": False}

    runs = _bench_runs(tmp_path, {
        "2026-01-01_abcdef0_h200x1_capacity_replays.jsonl": [replay(2, 3000, 2, 53, 100, 160),
                                                             replay(2, 3000, 2, 122, 100, 160)],
        "2026-01-03_abcdef0_h200x1_capacity_replays.jsonl": [replay(4, 1000, 3, 90, 200, 300, spills=1)],
        "2026-01-04_abcdef0_cpux1_capacity_study.jsonl": [loads(2), loads(8), study(8, False, 30.0),
                                                          study(2, True, 2.0), study(8, True, 3.0)],
    })
    block = capacity_figures.render(runs, lambda run: "current", report.MARKS)
    assert ("Replays, 2 runs of `parity_dsv3` at EP=2 over 3,000 steps, 1× H200, ranks sharing the GPU, `abcdef0` "
            "2026-01-01 ([capacity_replays](docs/results.md#capacity_replays)): 2 replays per run, the last at step "
            "122, 0 spills; the capacity started at 100 rows and ended at 160 (1.60× the start).") in block
    assert "Replays, 1 run of `parity_dsv3` at EP=4 over 1,000 steps" in block
    assert "3 replays, the last at step 90, 1 spills" in block
    assert "1,500 steps of a 26-MoE-layer model's routing" in block
    assert ("at the defaults (pool 1.25× growing +10% up to 1.5×; capacity 1.25× growing +25% up to the worst "
            "case)") in block
    assert ("EP=2: busiest layer up to 3.90× balanced, busiest rank's sum over the layers up to 1.30× (1.20× in the "
            "second half), 2 reruns per 1,000 steps (2 replays, 1 spills), 66.0 GiB per GPU at the ceilings, 1.06× "
            "nccl's 62.0 on the same routing (60.0 balanced)") in block
    assert "EP=8: busiest layer up to 3.90" in block and "3 reruns per 1,000" in block and "30 reruns" not in block


def test_every_run_says_the_command_that_runs_it_now_and_that_command_runs():
    """docs/results.md keeps each run's command as it ran at its commit (scripts have been renamed
    since; some ran from another checkout's path) and names the one that measures it again now: a
    suite of benchmarks/run.sh, or a script or module here that takes the options given."""
    import re
    import shlex

    history = report.History()
    for run in report.load_runs().values():
        header = "\n".join(report.run_header(run, history))
        assert f"- command, as run at `{run.first['commit'][:7]}`:" in header
        assert "- to run it now (from the repository root): `" in header, run.name
    suites = subprocess.run(["bash", "-c", "source <(sed -n '/^suites() {/,/^}/p' benchmarks/run.sh); suites"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\n")
    suites = {line.split()[0] for line in suites if line.strip()}
    assert set(report.RERUN) == set(report.BENCHES)
    for bench, command in report.RERUN.items():
        words = shlex.split(command)
        if words[:2] == ["bash", "benchmarks/run.sh"]:
            assert words[2] in suites and words[3:] == ["OUT"], (bench, command)
            continue
        assert words[0] == "python", command
        target = words[1:3] if words[1] == "-m" else words[1:2]
        assert (REPO / (target[1].replace(".", "/") + ".py" if target[0] == "-m" else target[0])).is_file(), command
        usage = subprocess.run([sys.executable, *target, "--help"], cwd=REPO, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert usage.returncode == 0, usage.stderr[-2000:]
        rest = words[1 + len(target):]
        for before, word in zip([""] + rest, rest):
            if word.startswith("--"):
                assert re.search(rf"{re.escape(word)}\b", usage.stdout), (command, word)
            elif word != "OUT":  # a path, or an option of the conf group the flag names (--model <conf/model>)
                group = REPO / "conf" / before.removeprefix("--")
                assert (REPO / word).exists() or (before and (group / f"{word}.yaml").is_file()), (command, word)
