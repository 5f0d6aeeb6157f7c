"""Every import path README.md and docs/*.md show runs: each ``import mxfp8_ep...`` / ``from
mxfp8_ep... import ...`` line, each ``--override.imports`` target, each dotted ``mxfp8_ep`` name in
inline code resolves, and each ``mxfp8_ep/...`` path exists. What reaches the torchtitan 0.3.0
adapter is skipped where another torchtitan is installed; tests/titan030/test_docs_paths.py
checks it in the 0.3.0 environment."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from tests.docs_imports import REPO, needs_titan030, resolve, shown

SHOWN = shown()
TITAN030 = version("torchtitan") == "0.3.0"


def _skip_without_titan030(text: str) -> None:
    if needs_titan030(text) and not TITAN030:
        pytest.skip(f"the torchtitan 0.3.0 adapter; this environment has torchtitan {version('torchtitan')} "
                    f"(tests/titan030/test_docs_paths.py runs it under 0.3.0)")


def test_the_pages_show_the_entry_points():
    assert "from mxfp8_ep import A2AConfig, install_expert_parallel" in SHOWN["statement"]
    assert {"mxfp8_ep.titan030.token_dispatcher", "mxfp8_ep.elastic.install_replays",
            "mxfp8_ep.config.PRESETS"} <= SHOWN["name"]
    assert "mxfp8_ep/config.py" in SHOWN["path"]


@pytest.mark.parametrize("statement", sorted(SHOWN["statement"]))
def test_import_statement_runs(statement):
    _skip_without_titan030(statement)
    exec(compile(statement, "<docs>", "exec"), {})


@pytest.mark.parametrize("name", sorted(SHOWN["name"]))
def test_dotted_name_resolves(name):
    _skip_without_titan030(name)
    resolve(name)


@pytest.mark.parametrize("path", sorted(SHOWN["path"]))
def test_path_exists(path):
    assert (REPO / path).exists(), f"{path} is named in README.md or docs/ but is not in the repository"
