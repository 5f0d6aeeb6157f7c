"""What the built package says about itself: its license, from pyproject.toml and LICENSE (the
metadata setuptools writes for a wheel, built from a copy of the sources: nothing is written
into the checkout)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from email.parser import Parser

from tests.hydra_compose import REPO


def test_the_package_is_bsd_3_clause(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for package in ("mxfp8_ep", "launch"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "meta").mkdir()
    hook = ("import sys; from setuptools import build_meta; "
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", hook, str(tmp_path / "meta")], cwd=src,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist_info = tmp_path / "meta" / proc.stdout.split()[-1]
    meta = Parser().parsestr((dist_info / "METADATA").read_text())
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta.get_all("License-File") == ["LICENSE"]
    text = (dist_info / "licenses" / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n\nCopyright (c) 2026, the mxfp8-ep authors\n")
    assert "Neither the name of the copyright holder nor the names of its" in text
