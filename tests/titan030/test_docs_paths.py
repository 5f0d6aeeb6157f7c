"""Under torchtitan 0.3.0: the import paths README.md and docs/*.md show that reach the 0.3.0
adapter (``mxfp8_ep.titan030``, the ``--override.imports`` target) import and resolve
(tests/test_docs_imports.py checks the rest, and skips these where 0.2.2 is installed)."""

from __future__ import annotations

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from tests.docs_imports import check, shown, torchtitan_needed  # noqa: E402

SHOWN = shown()
TITAN030 = sorted(s for s in SHOWN["statement"] | SHOWN["name"] if torchtitan_needed(s) == "0.3.0")


def test_the_pages_show_the_override():
    assert "mxfp8_ep.titan030.token_dispatcher" in TITAN030


@pytest.mark.parametrize("shown_text", TITAN030)
def test_import_path_imports(shown_text):
    check(shown_text)
