"""Scans of the source for code that tells wire formats or transports apart by hand, outside the
one module that defines them (``mxfp8_ep/format/wire_format.py``, ``mxfp8_ep/transport.py``): what the
seam tests (tests/test_wire_format.py, tests/test_transport_registry.py) run over the library,
the recipe and the benchmarks. Each scan returns the line numbers it finds in a source text."""

from __future__ import annotations

import ast
from pathlib import Path

from mxfp8_ep.transport import Transport
from mxfp8_ep.format.wire_format import WireFormat

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("mxfp8_ep", "launch", "benchmarks")
FORMAT_NAMES = frozenset(f.value for f in WireFormat)
TRANSPORT_NAMES = frozenset(t.value for t in Transport)
DISPLAYS = (ast.Tuple, ast.List, ast.Set)


def scanned_files(outside: Path) -> dict[str, str]:
    """Relative path -> source of every Python file under ``SCANNED`` but ``outside``."""
    return {str(p.relative_to(ROOT)): p.read_text() for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))
            if p != outside}


def found_in(files: dict[str, str], scan) -> dict[str, list[int]]:
    """The files where ``scan`` finds lines, with those lines."""
    return {path: lines for path, source in files.items() if (lines := scan(source))}


def _names(node: ast.AST, names: frozenset[str]) -> set[str]:
    """The names among ``names`` that ``node`` spells as a string constant, itself or as an element
    of a tuple, list or set display."""
    elements = node.elts if isinstance(node, DISPLAYS) else [node]
    return {e.value for e in elements if isinstance(e, ast.Constant) and e.value in names}


def _is_format_member(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "WireFormat" \
        and node.attr in WireFormat.__members__


def format_branches(source: str) -> list[int]:
    """Lines that compare something with a wire format's name (``fmt == "mxfp8"``, ``x in ("bf16",
    ...)``, a ``match`` case) or with a ``WireFormat`` member (``fmt is WireFormat.MXFP8``), and
    displays that list two or more format names by hand: code that should ask the format
    (``WireFormat.quantized``, ``row_bytes``, ...) or ``WIRE_FORMATS``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names(o, FORMAT_NAMES) or _is_format_member(o) for o in operands):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _names(node.value, FORMAT_NAMES):
            lines.append(node.lineno)
        elif isinstance(node, DISPLAYS) and len(_names(node, FORMAT_NAMES)) >= 2:
            lines.append(node.lineno)
    return sorted(set(lines))


def _mentions_transport(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Name) and "transport" in n.id.lower())
               or (isinstance(n, ast.Attribute) and "transport" in n.attr.lower()) for n in ast.walk(node))


def _called(call: ast.Call) -> str | None:
    """The name a call calls (``f(...)``, ``module.f(...)``)."""
    return getattr(call.func, "id", getattr(call.func, "attr", None))


def transport_branches(source: str) -> list[int]:
    """Lines that spell transport names where ``Transport`` should be asked: a comparison of
    something named ``*transport*`` with a transport's name (``a2a.transport == "symm"``), a
    ``match`` on one with a name as a case, a display or dict that lists two or more transport
    names by hand, and a name given to ``register_transport``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names(o, TRANSPORT_NAMES) for o in operands) and any(map(_mentions_transport, operands)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match) and _mentions_transport(node.subject):
            lines += [c.pattern.lineno for c in node.cases
                      if isinstance(c.pattern, ast.MatchValue) and _names(c.pattern.value, TRANSPORT_NAMES)]
        elif isinstance(node, DISPLAYS) and len(_names(node, TRANSPORT_NAMES)) >= 2:
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict):
            if len(set().union(*(_names(k, TRANSPORT_NAMES) for k in node.keys if k))) >= 2:
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and _called(node) == "register_transport":
            if any(_names(a, TRANSPORT_NAMES) for a in node.args):
                lines.append(node.lineno)
    return sorted(set(lines))


# The format's own modules: its definition, its torch codec, its in-register encode / decode and
# the quantize ops built on them. Every other module asks ``WireFormat`` for the format's facts.
FORMAT_MODULES = frozenset({"mxfp8_ep/format/wire_format.py", "mxfp8_ep/format/mxfp8.py",
                            "mxfp8_ep/kernels/triton_kernels.py", "mxfp8_ep/kernels/quantize.py"})
_CONSTANT_NAMES = ("E4M3", "E8M0", "BLOCK_SIZE")


def _constant_name(name: str) -> bool:
    return any(part in name.upper() for part in _CONSTANT_NAMES)


def format_constants(source: str) -> list[int]:
    """Lines that import or define a wire format's constant by hand (a name with ``E4M3``,
    ``E8M0`` or ``BLOCK_SIZE`` in it) or write a number that is only a format's (448, e4m3's
    largest magnitude): code that should ask ``WireFormat`` (``block_size``, ``element_max``,
    ``scale_bias``, ...)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and any(_constant_name(a.name) for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and _constant_name(t.id) for t in targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 448:
            lines.append(node.lineno)
    return sorted(set(lines))
