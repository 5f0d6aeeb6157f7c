"""The commands' first check (``launch/train.py``, ``launch/compare_runs.py``): this interpreter
can import the recipe, or one line names the fix (exit 2) instead of an ImportError traceback.
Imports nothing of the recipe, so a Python without it can run it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def require_recipe_python(needs: tuple[str, ...] = ("hydra", "launch")) -> None:
    """Exit 2 with one line when this interpreter lacks one of ``needs`` (a venv that is not
    active, or a Python nothing was installed into)."""
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        venv = Path(__file__).resolve().parent.parent / ".venv"
        fix = (f"activate its venv (`. {venv}/bin/activate`)" if (venv / "bin" / "python").exists()
               else "activate the venv you installed into, or install with `bash scripts/install.sh`")
        print(f"[mxfp8ep] {sys.executable} cannot import {' or '.join(missing)}, which the recipe needs: "
              f"{fix}, then run the command again", file=sys.stderr)
        raise SystemExit(2)
