"""Where a number was measured: the recipe's commit and whether its files differ from it, the
time, the host. Benchmark rows (``benchmarks/rows.py``) and run summaries
(``launch.run.run_summary.RunSummary``) record the same facts from here.

The commit is ``$MXFP8EP_COMMIT`` when set (a copied working tree on a GPU machine: set it to
the commit that was copied), else ``git rev-parse HEAD`` of the checkout. ``dirty`` is True for a
tree whose tracked files differ from that commit: in a checkout, its uncommitted changes; in a
copied tree, its files against ``$MXFP8EP_COMMIT`` where the copy has a git history holding that
commit, else ``$MXFP8EP_DIRTY`` (``true``/``false``, from whoever copied it). When none of these
can tell, dirty is None with the reason.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
COMMIT_ENV = "MXFP8EP_COMMIT"
DIRTY_ENV = "MXFP8EP_DIRTY"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    except OSError:
        return None


def _dirty_env() -> bool | None:
    value = os.environ.get(DIRTY_ENV, "").strip().lower()
    if value in ("", "unknown"):
        return None
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ValueError(f"${DIRTY_ENV}={value!r}: expected true or false")


def git_commit(repo: Path = REPO) -> tuple[str, bool | None, str | None]:
    """(commit, dirty, why dirty is unknown) of the tree at ``repo`` (module docstring).
    ``$MXFP8EP_COMMIT`` wins when set: a copied tree can carry a ``.git`` of another commit than
    the files that were copied, so its files are compared with the named commit."""
    env = os.environ.get(COMMIT_ENV)
    if env:
        if not re.fullmatch(r"[0-9a-f]{40}", env):
            raise ValueError(f"${COMMIT_ENV}={env!r}: set it to the copied commit's full 40-character id "
                             f"($(git rev-parse HEAD)), which every row records")
        known = _git(repo, "cat-file", "-e", f"{env}^{{commit}}")
        if known is not None and known.returncode == 0:
            diff = _git(repo, "diff", "--quiet", env, "--")
            if diff is not None and diff.returncode in (0, 1):
                return env, diff.returncode == 1, None
        dirty = _dirty_env()
        if dirty is not None:
            return env, dirty, None
        return env, None, (f"copied tree without a git history holding {env[:7]} to compare its files "
                           f"with, and ${DIRTY_ENV} unset")
    head = _git(repo, "rev-parse", "HEAD")
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    if head is None or status is None or head.returncode or status.returncode:
        raise RuntimeError(
            f"cannot tell which commit is measured: {repo} is not a git checkout and ${COMMIT_ENV} "
            f"is unset; set {COMMIT_ENV}=$(git rev-parse HEAD) for the copied tree")
    return head.stdout.strip(), bool(status.stdout.strip()), None


def recipe_commit(repo: Path = REPO) -> tuple[Optional[str], Optional[bool], Optional[str]]:
    """:func:`git_commit`, never raising: (None, None, why) where it cannot tell (an installed
    copy without git history and no ``$MXFP8EP_COMMIT``, or a malformed one)."""
    try:
        return git_commit(repo)
    except (RuntimeError, ValueError) as e:
        return None, None, str(e)


def utc_now() -> str:
    """This moment, UTC, as every record writes it: ``2026-12-07T04:10:49Z``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def host_name() -> str:
    """The node this process runs on: SLURM's name for it inside a job, else the host's."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
