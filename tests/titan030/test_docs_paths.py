"""Under torchtitan 0.3.0: the import paths README.md and docs/*.md show that reach the 0.3.0
adapter (``mxfp8_ep.titan030``, the ``--override.imports`` target) import and resolve
(tests/test_docs_imports.py checks the rest, and skips these where 0.2.2 is installed)."""

from __future__ import annotations

import pytest

from tests.docs_imports import needs_titan030, resolve, shown

SHOWN = shown()


def test_the_pages_show_the_override():
    assert "mxfp8_ep.titan030.token_dispatcher" in SHOWN["name"]


@pytest.mark.parametrize("statement", sorted(s for s in SHOWN["statement"] if needs_titan030(s)))
def test_import_statement_runs(statement):
    exec(compile(statement, "<docs>", "exec"), {})


@pytest.mark.parametrize("name", sorted(n for n in SHOWN["name"] if needs_titan030(n)))
def test_dotted_name_resolves(name):
    resolve(name)
