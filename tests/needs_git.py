"""Skip marks for tests that need git: the command (repositories built in tmp), this tree as a
git checkout, or its full history. The test image has none of them (no git package;
.dockerignore leaves .git out)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _shallow() -> bool | None:
    """Whether this tree is a shallow clone; None when it is no git checkout (or git is missing)."""
    if shutil.which("git") is None:
        return None
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                          capture_output=True, text=True)
    return None if proc.returncode else proc.stdout.strip() == "true"


_SHALLOW = _shallow()
git_command = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")
git_checkout = pytest.mark.skipif(_SHALLOW is None, reason="needs this tree as a git checkout")
full_history = pytest.mark.skipif(_SHALLOW is not False, reason="needs this tree's full git history")
