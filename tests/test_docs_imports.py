"""Every import path README.md and docs/*.md show runs: each ``import mxfp8_ep...`` / ``from
mxfp8_ep... import ...`` line, each ``--override.imports`` target, each dotted ``mxfp8_ep`` name in
inline code resolves, and each ``mxfp8_ep/...`` path exists. What reaches the integration of the
torchtitan that is not installed is skipped (the 0.3.0 adapter where 0.2.2 is);
tests/titan030/test_docs_paths.py checks the 0.3.0 ones in the 0.3.0 environment."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from tests.docs_imports import REPO, check, shown, torchtitan_needed

SHOWN = shown()


def test_the_pages_show_the_entry_points():
    assert "from mxfp8_ep import A2AConfig, install_expert_parallel" in SHOWN["statement"]
    assert {"mxfp8_ep.titan030.token_dispatcher", "mxfp8_ep.titan022", "mxfp8_ep.elastic.install_replays",
            "mxfp8_ep.config.PRESETS"} <= SHOWN["name"]
    assert "mxfp8_ep/config.py" in SHOWN["path"]


@pytest.mark.parametrize("shown_text", sorted(SHOWN["statement"] | SHOWN["name"]))
def test_import_path_imports(shown_text):
    needed = torchtitan_needed(shown_text)
    if needed and needed != version("torchtitan"):
        pytest.skip(f"needs torchtitan {needed}'s integration; this environment has torchtitan "
                    f"{version('torchtitan')} (tests/titan030/test_docs_paths.py runs the 0.3.0 ones)")
    check(shown_text)


@pytest.mark.parametrize("path", sorted(SHOWN["path"]))
def test_path_exists(path):
    assert (REPO / path).exists(), f"{path} is named in README.md or docs/ but is not in the repository"
