"""The import paths README.md and docs/*.md show: their ``import mxfp8_ep...`` and ``from
mxfp8_ep... import ...`` lines (code blocks and inline code), the ``--override.imports`` targets,
every dotted ``mxfp8_ep.x.y`` name in inline code, and every ``mxfp8_ep/...`` path; and how to
resolve a dotted name (the longest importable module, then attributes)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

_STATEMENT = r"from mxfp8_ep[\w.]* import [\w, ]+|import mxfp8_ep[\w.]*(?: as \w+)?"
_CODE_LINE = re.compile(rf"^[ \t]*({_STATEMENT})[ \t]*(?:#.*)?$", re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_OVERRIDE = re.compile(r"--override\.imports\s+['\"]?(mxfp8_ep[\w.]+)=")
_DOTTED = re.compile(r"(?<![\w/.])mxfp8_ep(?:\.\w+)+")
_PATH = re.compile(r"(?<![\w/.])mxfp8_ep/[\w/.]*")


def _inline(text: str) -> list[str]:
    return _INLINE.findall(text)


def statements(text: str) -> set[str]:
    """Import statements: whole lines in code blocks, whole inline code spans."""
    found = set(_CODE_LINE.findall(text))
    found.update(s.strip() for s in _inline(text) if re.fullmatch(_STATEMENT, s.strip()))
    return found


def dotted_names(text: str) -> set[str]:
    """``--override.imports`` targets and the dotted ``mxfp8_ep`` names of inline code (not
    inside an import statement, which ``statements`` reads whole)."""
    found = set(_OVERRIDE.findall(text))
    for span in _inline(text):
        if not re.fullmatch(_STATEMENT, span.strip()):
            found.update(name.rstrip(".") for name in _DOTTED.findall(span))
    return found


def paths(text: str) -> set[str]:
    """``mxfp8_ep/...`` paths of inline code and code blocks (placeholders like ``<format>`` left out)."""
    return {p.rstrip(".") for p in _PATH.findall(text)}


def shown() -> dict[str, set[str]]:
    """What the pages show, by kind: ``statement``, ``name``, ``path``."""
    out: dict[str, set[str]] = {"statement": set(), "name": set(), "path": set()}
    for page in PAGES:
        text = page.read_text()
        out["statement"] |= statements(text)
        out["name"] |= dotted_names(text)
        out["path"] |= paths(text)
    return out


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: the longest prefix that is a module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if not (module_name == e.name or module_name.startswith(f"{e.name}.")):
                raise  # a module that is there failed to import
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


def torchtitan_needed(shown_text: str) -> str | None:
    """The torchtitan version a statement or name needs: the 0.3.0 adapter (``mxfp8_ep.titan030``)
    and the 0.2.2 integration (``mxfp8_ep.titan022``) each raise ImportError under the other."""
    for version in ("030", "022"):
        if re.search(rf"mxfp8_ep\.titan{version}\b|from mxfp8_ep import .*\btitan{version}\b", shown_text):
            return f"0.{version[1]}.{version[2]}"
    return None


def check(shown_text: str) -> None:
    """Run an import statement, or resolve a dotted name."""
    if shown_text.startswith(("from ", "import ")):
        exec(compile(shown_text, "<docs>", "exec"), {})
    else:
        resolve(shown_text)
