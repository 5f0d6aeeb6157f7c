"""README.md: at most 250 lines; its first screen says what the project is, the two commands (install
and run the default; the tests, as .ci/run runs them) and what MXFP8 buys and where, with the
figures of the README's own generated results table."""

from __future__ import annotations

import re

from tests.hydra_compose import REPO

README = (REPO / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:50])


def _measured(result: str) -> float:
    """The measured figure of a row of the generated results block."""
    row = re.search(rf"^\| {re.escape(result)} \| ([\d.]+)×", README, flags=re.M)
    assert row, result
    return float(row.group(1))


def test_the_readme_is_short_and_its_first_screen_says_what_and_how():
    assert len(README.splitlines()) <= 250
    assert FIRST_SCREEN.index("## Quick start") < FIRST_SCREEN.index("bash scripts/test.sh")
    assert "```bash\nbash scripts/install.sh && python launch/train.py\n```" in FIRST_SCREEN
    assert "\nbash scripts/test.sh\n" in (REPO / ".ci" / "run").read_text()  # the command CI runs
    assert "2 of the 4 legs in MXFP8" in FIRST_SCREEN.replace("\n  ", " ")
    nvlink = _measured("Training tokens/s, mxfp8/symm vs bf16/symm")
    slow = _measured("Training tokens/s, mxfp8_all/nccl + overlap vs bf16/nccl")
    assert f"{nvlink:.3f}× the tokens/s of bf16" in FIRST_SCREEN
    assert f"{slow:.2f}× bf16 with all four legs in MXFP8" in FIRST_SCREEN.replace("\n  ", " ")
    assert "docs/results.md#train)" in FIRST_SCREEN and "docs/results.md#train_shm)" in FIRST_SCREEN
