"""Fixtures for tests against a real, local SLURM cluster (scripts/slurm_local.sh).

`slurm_cluster` (session): installs the Debian packages if missing, starts munge, MariaDB,
slurmdbd, slurmctld and two fake nodes (n1, n2; 2 CPUs each), yields a `SlurmCluster`, and at
the end stops what it started (a cluster that was already running is left running).
Skips only when it cannot work at all (not root, or packages missing and no apt-get) or when
MXFP8EP_SKIP_SLURM says why not (the test image); any other failure to bring the cluster up is a
test error, so CI notices.

`submitit_folder` (function): a fresh, empty folder per test. Never reuse a submitit folder
across clusters: purging the cluster state resets job ids, and a stale folder then mixes jobs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_local.sh"
REQUIRED = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "munged", "mariadbd")


@dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    slurm_conf: Path
    partition: str = "debug"  # default partition, no time limit
    # Every partition that exists; "short" has MaxTime=5 min, enforced at submission.
    partitions: tuple[str, ...] = ("debug", "short")
    bad_partition: str = "no_such_partition"
    nodes: tuple[str, ...] = ("n1", "n2")
    cpus_per_node: int = 2
    started_here: bool = False
    env: dict[str, str] = field(default_factory=dict)


def _run(args: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def slurm_cluster():
    if reason := os.environ.get("MXFP8EP_SKIP_SLURM"):  # the test image sets it
        pytest.skip(f"MXFP8EP_SKIP_SLURM: {reason}")
    if os.geteuid() != 0:
        pytest.skip("local SLURM cluster needs root (daemons run as root/munge/mysql)")
    if not all(shutil.which(c) for c in REQUIRED) and shutil.which("apt-get") is None:
        pytest.skip("SLURM packages missing and no apt-get to install them")

    state_dir = Path(os.environ.get("MXFP8EP_SLURM_STATE", "/tmp/mxfp8ep-slurm"))
    env = {**os.environ, "MXFP8EP_SLURM_STATE": str(state_dir)}
    slurm_conf = state_dir / "etc" / "slurm.conf"

    already = _run(["status"], 60, env).returncode == 0
    t0 = time.monotonic()
    inst = _run(["install"], 900, env)
    if inst.returncode != 0:
        pytest.fail(f"scripts/slurm_local.sh install failed:\n{inst.stdout}\n{inst.stderr}")
    start = _run(["start"], 300, env)
    if start.returncode != 0:
        pytest.fail(f"scripts/slurm_local.sh start failed:\n{start.stdout}\n{start.stderr}")
    print(f"\n[slurm_cluster] ready in {time.monotonic() - t0:.1f}s (already running: {already})")

    # Register this session: a session that started the cluster stops it at the end only if
    # no other live test session (another pytest on this machine) is still using it.
    sessions = state_dir / "sessions"
    sessions.mkdir(exist_ok=True)
    me = sessions / str(os.getpid())
    me.touch()

    # Point every SLURM client (ours and submitit's subprocesses) at this cluster, even if
    # /etc/slurm/slurm.conf belongs to something else.
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(slurm_conf)
    try:
        yield SlurmCluster(
            state_dir=state_dir,
            slurm_conf=slurm_conf,
            started_here=not already,
            env={"SLURM_CONF": str(slurm_conf)},
        )
    finally:
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        me.unlink(missing_ok=True)
        others = _live_sessions(sessions)
        if not already and others:
            print(f"\n[slurm_cluster] left running: still used by sessions {others}")
        elif not already:
            stop = _run(["stop"], 120, env)
            if stop.returncode != 0:
                print(f"[slurm_cluster] stop failed:\n{stop.stdout}\n{stop.stderr}")


def _live_sessions(sessions: Path) -> list[int]:
    live = []
    for f in sessions.glob("*"):
        try:
            pid = int(f.name)
            status = Path(f"/proc/{pid}/status").read_text()
        except (ValueError, OSError):
            f.unlink(missing_ok=True)  # stale: that process is gone
            continue
        if "\nState:\tZ" in status:
            f.unlink(missing_ok=True)
            continue
        live.append(pid)
    return live


@pytest.fixture
def submitit_folder(tmp_path: Path, slurm_cluster: SlurmCluster) -> Path:
    folder = tmp_path / "submitit"
    folder.mkdir()
    return folder
