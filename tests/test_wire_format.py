"""The wire-format seam (``mxfp8_ep.wire_format``): every format's facts agree with the staging
layout and its reference codec, and the format module is the only library code that tells
formats apart by name or defines a format's block size."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from mxfp8_ep.launch_shapes import KernelShapes
from mxfp8_ep.staging import decode_rows, encode_rows, staged_row_nbytes, staging_views, store_rows
from mxfp8_ep.wire_format import WireFormat, wire_format

LIBRARY = Path(__file__).resolve().parents[1] / "mxfp8_ep"
FORMAT_MODULE = LIBRARY / "wire_format.py"


def _format_name_comparisons(source: str) -> list[int]:
    """Lines of ``source`` that compare something with a wire format's name (``fmt ==
    "mxfp8"``, ``x in ("bf16", ...)``, ``match`` cases on the names)."""
    names = {f.value for f in WireFormat}
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                elements = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(e, ast.Constant) and e.value in names for e in elements):
                    lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in names:
            lines.append(node.lineno)
    return lines


def test_only_the_format_module_branches_on_format_names():
    """The library and the recipe (launch/) ask ``WireFormat``, never a format's name."""
    files = [*LIBRARY.rglob("*.py"), *(LIBRARY.parent / "launch").rglob("*.py")]
    found = {str(p.relative_to(LIBRARY.parent)): lines for p in sorted(files)
             if p != FORMAT_MODULE and (lines := _format_name_comparisons(p.read_text()))}
    assert found == {}, f"format-name branches outside mxfp8_ep/wire_format.py (use WireFormat): {found}"


def test_the_scan_finds_format_name_branches():
    assert _format_name_comparisons('if fmt == "mxfp8":\n    pass\n') == [1]
    assert _format_name_comparisons('ok = fmt in ("bf16", "x")\n') == [1]
    assert _format_name_comparisons('match fmt:\n    case "bf16":\n        pass\n') == [2]
    assert _format_name_comparisons('if preset == "mxfp8_all":\n    pass\n') == []


def test_block_sizes_are_defined_in_the_format_module_only():
    """No library module but the format module binds a ``*BLOCK_SIZE*`` name to a number."""
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path == FORMAT_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and "BLOCK_SIZE" in t.id for t in targets):
                    found.append(f"{path.relative_to(LIBRARY)}:{node.lineno}")
    assert found == []


@pytest.mark.parametrize("fmt", list(WireFormat))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_round_trip_through_a_staging_buffer(fmt, dtype):
    """``row_bytes`` is the staged row's size; rows stored with the format's encoding come back
    as the codec decodes them (unquantized: unchanged)."""
    dim, rows = 96, 5
    g = torch.Generator().manual_seed(5)
    values = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    nbytes = staged_row_nbytes(dim, dtype, fmt)
    assert nbytes == fmt.row_bytes(dim, values.element_size())
    buf = torch.zeros(rows * nbytes + 7, dtype=torch.uint8)
    views = staging_views(buf, rows, dim, dtype, fmt)
    assert sum(v.shape[1] * v.element_size() for v in views) == nbytes
    at = torch.tensor([4, 0, 3, 1, 2])
    encoded = encode_rows(values, "rceil", fmt)
    store_rows(buf, rows, at, values, encoded, torch.ones(rows, dtype=torch.bool), fmt)
    got = decode_rows(views, at, dtype, fmt)
    if fmt.quantized:
        want = fmt.codec().decode_rows(*encoded, dtype)
        assert torch.equal(got, want) and (got - values).abs().max() <= values.abs().max() / 8
    else:
        assert encoded is None and torch.equal(got, values)
    assert bool(buf[rows * nbytes:].eq(0).all()), "a row was stored past the buffer's rows"


@pytest.mark.parametrize("fmt", list(WireFormat))
def test_every_format_has_kernel_constants_launch_shapes_and_a_codec(fmt):
    constants = fmt.kernel_constants()
    assert set(constants) == {"ELEMENT", "SCALE", "GROUP"} and constants["GROUP"] % 32 == 0
    assert isinstance(KernelShapes.default(fmt), KernelShapes)
    assert wire_format(fmt.value) is fmt and fmt == fmt.value and fmt.__doc__
    if fmt.quantized:
        assert fmt.block_size == constants["GROUP"] and fmt.scale_bytes > 0
        assert hasattr(fmt.codec(), "encode_rows") and hasattr(fmt.codec(), "decode_rows")
        assert fmt.dim_error(fmt.block_size + 1) and fmt.dim_error(2 * fmt.block_size) is None
    else:
        assert fmt.dim_error(33) is None
        with pytest.raises(ValueError, match="not quantized"):
            fmt.codec()
    with pytest.raises(ValueError, match="unknown wire format 'fp4'"):
        wire_format("fp4")
