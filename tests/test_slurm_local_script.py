"""scripts/slurm_local.sh as docs/slurm_local.md shows it: its commands run as written by root
on a machine without sudo, and another user's call runs itself again through sudo. No cluster
is started: the commands here find no state dir (the live cluster is in tests/slurm)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tests.hydra_compose import REPO

SCRIPT = REPO / "scripts" / "slurm_local.sh"


def documented_commands() -> list[str]:
    """The lines of docs/slurm_local.md's code blocks that call the script."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "slurm_local.md").read_text(), flags=re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
            if "slurm_local.sh" in line]


def machine(tmp_path: Path, uid: int, sudo: bool) -> dict[str, str]:
    """The environment of a machine where ``id -u`` says ``uid``, with or without a sudo (one
    that records its arguments), and the tools the script needs before it starts daemons."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    if sudo:
        (bin_dir / "sudo").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/sudo-args\n')
    for tool in ("bash", "flock", "rm", "cat", "sed", "readlink"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    return {"PATH": str(bin_dir), "MXFP8EP_SLURM_STATE": str(tmp_path / "state"), "HOME": str(tmp_path)}


def run(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), "-c", command], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def test_the_documented_commands_run_as_root_without_sudo(tmp_path):
    commands = documented_commands()
    assert {c.split()[-1] for c in commands} >= {"install", "start", "stop", "purge", "status"}, commands
    env = machine(tmp_path, uid=0, sudo=False)
    for command in commands:
        if command.split()[-1] in ("stop", "purge"):  # install and start would set up a cluster
            proc = run(command, env)
            assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
            assert f"no state dir {tmp_path / 'state'}" in proc.stderr


@pytest.mark.parametrize("command", ["install-missing", "start", "stop", "purge"])
def test_another_user_goes_through_sudo(tmp_path, command):
    env = machine(tmp_path, uid=1000, sudo=True)
    if command == "install-missing":  # the packages are missing (no slurmctld on this PATH)
        command = "install"
    proc = run(f"{SCRIPT} {command}", env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sudo-args").read_text().split() == [
        f"MXFP8EP_SLURM_STATE={tmp_path / 'state'}", "MXFP8EP_SLURM_START_TIMEOUT=60", "bash",
        str(SCRIPT), command]


def test_another_user_without_sudo_is_told_to_be_root(tmp_path):
    proc = run(f"{SCRIPT} start", machine(tmp_path, uid=1000, sudo=False))
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("[slurm_local] ERROR: must run as root (daemons run as root/munge/mysql), "
                                   "and there is no sudo here: run it as root")


def test_the_docs_give_the_live_slurm_tests_count_pytest_collects():
    """One count of the live SLURM tests, docs/slurm_local.md's, and it is tests/slurm's: no
    other page states one."""
    import subprocess
    import sys

    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/slurm"], cwd=REPO,
                               capture_output=True, text=True, timeout=120).stdout
    count = int(re.search(r"^(\d+) tests? collected", collected, flags=re.M).group(1))
    page = (REPO / "docs" / "slurm_local.md").read_text()
    assert re.search(r"python -m pytest tests/slurm +# as root; (\d+) tests,", page).group(1) == str(count)
    for doc in [*(REPO / "docs").glob("*.md"), REPO / "README.md"]:
        if doc.name != "slurm_local.md":
            assert not re.search(r"\d+ (live )?SLURM tests", doc.read_text()), doc.name
