"""``logging=wandb_online`` never trains without a record: no credentials is refused before
launch (launch/config/wandb_login.py), and an online start that fails during the run keeps the
record offline in the run dir and says so (launch/titan/wandb_run.py's ``start_wandb``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.run.wandb_offline import read_runs
from launch.titan.wandb_run import WandbSettings, start_wandb
from tests.train_cli import run_train

KEY = "k" * 40


def test_online_without_a_login_is_refused_before_launch(tmp_path):
    proc = run_train(tmp_path, "logging=wandb_online", timeout=120, HOME=str(tmp_path),
                     NETRC=str(tmp_path / "no_netrc"))
    assert proc.returncode == 2
    problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 1 and "Traceback" not in proc.stderr
    assert problems[0].startswith("  - logging=wandb_online: wandb is not logged in here (no WANDB_API_KEY")
    assert "`wandb login`" in problems[0] and "logging=wandb_offline" in problems[0]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("how", ["netrc", "env"])
def test_online_with_a_login_passes(tmp_path, how):
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {KEY}\n")
    env = {"NETRC": str(netrc)} if how == "netrc" else {"NETRC": str(tmp_path / "none"), "WANDB_API_KEY": KEY}
    proc = run_train(tmp_path, "--cfg", "job", "logging=wandb_online", timeout=120, HOME=str(tmp_path), **env)
    assert proc.returncode == 0, proc.stderr
    assert "wandb_mode: online" in proc.stdout


def test_a_failed_online_start_keeps_the_record_offline_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: refused
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    monkeypatch.setenv("WANDB_SILENT", "true")
    said = []
    settings = WandbSettings(mode="online", project="p", run_id="run1", name="a2a=bf16", group="g",
                             entity=None, tags=(), dir=str(tmp_path))
    log = start_wandb(settings, {"recipe": {"a2a": {"name": "bf16"}}}, said.append)
    assert log is not None and log.settings.mode == "offline"
    for step in (1, 2):
        log.log({"loss": 1.0 / step}, step)
    log.close()
    log.wandb.teardown()
    (line,) = said
    assert line.startswith("warning: wandb (online) could not start: ")
    assert f"written offline instead, in {tmp_path / 'wandb'}" in line and "wandb sync" in line
    (run,) = read_runs(str(tmp_path / "wandb"))
    assert run.run_id == "run1" and [row["_step"] for row in run.history] == [1, 2]


def test_an_online_start_waits_a_bounded_time_and_says_so(tmp_path, monkeypatch):
    """wandb waits 90 s for its server by default, saying nothing: the run waits
    ONLINE_INIT_TIMEOUT_S (or $WANDB_INIT_TIMEOUT), and its start-up line says for how long and
    what follows."""
    from launch.titan import wandb_run

    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.example:8080")
    assert wandb_run.init_timeout_s() == wandb_run.ONLINE_INIT_TIMEOUT_S < 90
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text().replace("\n", " ")
    assert f"waits for the server at most {wandb_run.ONLINE_INIT_TIMEOUT_S:g} s (`WANDB_INIT_TIMEOUT`" in usage
    assert wandb_run.start_line("online") == (
        f"start-up: wandb (online): connecting to http://wandb.example:8080; without an answer in "
        f"{wandb_run.ONLINE_INIT_TIMEOUT_S:g} s the run's record is written offline instead")
    assert wandb_run.start_line("offline") == "start-up: wandb (offline)"
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    assert wandb_run.init_timeout_s() == 5.0

    seen = {}

    class Stop(Exception):
        pass

    def init(**kw):
        seen.update(kw)
        raise Stop

    import wandb

    monkeypatch.setattr(wandb, "init", init)
    settings = WandbSettings(mode="online", project="p", run_id="r", name=None, group=None, entity=None, tags=(),
                             dir=str(tmp_path))
    with pytest.raises(Stop):
        wandb_run.RecipeWandBLogger(settings, {})
    assert seen["settings"].init_timeout == 5.0

