"""The wire-format seam (``mxfp8_ep.format.wire_format``): every format's facts agree with the staging
layout and its reference codec, and the format module is the only code in the library, the
recipe and the benchmarks that tells formats apart by name or member, and (with the format's
own codec and kernels) that holds a format's constants (``tests.seam_scan``)."""

from __future__ import annotations

import pytest
import torch

from mxfp8_ep.kernels.launch_shapes import KernelShapes
from mxfp8_ep.exchange.staging import decode_rows, encode_rows, staged_row_nbytes, staging_views, store_rows
from mxfp8_ep.format.wire_format import WireFormat, wire_format
from tests.seam_scan import ROOT, FORMAT_MODULES, format_branches, format_constants, found_in, scanned_files

FORMAT_MODULE = ROOT / "mxfp8_ep" / "format" / "wire_format.py"


def test_only_the_format_module_branches_on_formats():
    """The library, the recipe (launch/) and the benchmarks ask ``WireFormat``, never compare
    with a format's name or member, nor list the format names by hand."""
    found = found_in(scanned_files(FORMAT_MODULE), format_branches)
    assert found == {}, f"format branches outside mxfp8_ep/format/wire_format.py (ask WireFormat): {found}"


def test_the_format_scan_finds_each_kind_of_branch():
    assert format_branches('if fmt == "mxfp8":\n    pass\n') == [1]
    assert format_branches('ok = fmt in ("bf16", "x")\n') == [1]
    assert format_branches('match fmt:\n    case "bf16":\n        pass\n') == [2]
    assert format_branches("if wire is not WireFormat.MXFP8:\n    pass\n") == [1]
    assert format_branches("same = fmt == WireFormat.BF16\n") == [1]
    assert format_branches('for fmt in ("bf16", "mxfp8"):\n    pass\n') == [1]
    assert format_branches('if preset == "mxfp8_all":\n    pass\n') == []
    assert format_branches('x = WireFormat("mxfp8").quantized\n') == []


def test_format_constants_come_from_the_format():
    """Outside the format's own modules no code imports or defines a format's constants (block
    size, e4m3's maximum, the e8m0 bias) by hand: it asks ``WireFormat``."""
    files = scanned_files(FORMAT_MODULE)
    found = found_in({p: s for p, s in files.items() if p not in FORMAT_MODULES}, format_constants)
    assert found == {}, f"format constants outside the format's modules (ask WireFormat): {found}"
    assert set(FORMAT_MODULES) <= {*files, "mxfp8_ep/format/wire_format.py"}, "a format module moved: update the list"


def test_the_constant_scan_finds_each_kind():
    assert format_constants("from mxfp8_ep.format.mxfp8 import BLOCK_SIZE, E4M3_MAX\n") == [1]
    assert format_constants("E8M0_BIAS = 127\n") == [1]
    assert format_constants("x = q.abs() == 448.0\n") == [1]
    assert format_constants("block = WireFormat.MXFP8.block_size\n") == []


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


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_rows_decode_to_the_same_values_when_quantized_again(rounding, dtype):
    """A row decoded from a quantized format and encoded again decodes to the same values (the
    two_hop transport quantizes a token once for the node hop, and the fan-out's encode of the
    decoded row must not round it a second time): blocks over a wide range of magnitudes, zeros,
    subnormal-sized values and blocks whose largest value rounded down. The one exception is
    torchao's floor rounding at e8m0's smallest scale (a block's max below 2**-118): it divides
    by 2**-126 but records 2**-127, so each round trip halves such a block."""
    g = torch.Generator().manual_seed(9)
    rows, dim = 64, 256
    magnitude = torch.exp2(torch.randint(-140, 120, (rows, dim // 32, 1), generator=g).float())
    values = (torch.randn(rows, dim // 32, 32, generator=g) * magnitude).reshape(rows, dim)
    values[0] = 0
    values[1, :32] = 224.4  # rounds down to 224 under rceil's scale
    values = values.to(dtype)
    for fmt in (f for f in WireFormat if f.quantized):
        elements, scales = encode_rows(values, rounding, fmt)
        once = decode_rows((elements, scales), torch.arange(rows), dtype, fmt)
        twice = decode_rows((*encode_rows(once, rounding, fmt),), torch.arange(rows), dtype, fmt)
        moved = (once != twice).view(rows, -1, fmt.block_size).any(dim=-1)
        bottom = scales.view(rows, -1) == 0
        allowed = bottom if rounding == "floor" else torch.zeros_like(bottom)
        assert not (moved & ~allowed).any(), f"{fmt} {rounding} {dtype}: a second quantization moved values"
        assert bottom.any() and not torch.equal(once, values)  # the range reached the bottom; the first one rounded
