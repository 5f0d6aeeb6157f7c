"""A small time model of one EP exchange leg in bf16 and MXFP8, a floor-plus-wire model of the
whole layer, and their check against the measured rows in benchmarks/results/
(docs/performance.md explains both, their constants and where they are wrong).

    python -m benchmarks.speed_model                        # predicted speedups, links x shapes
    python -m benchmarks.speed_model --bw 50 --rows 65536 --dim 7168 --ep 16 --design nccl
    python -m benchmarks.speed_model --check [RUN.jsonl ...] [--json out.json]

One leg per rank, even routing, EP degree W: ``rows`` routed rows (tokens x top-k) of ``dim``
elements leave each rank, a fraction (W-1)/W of them to other ranks. Time of a format:

    t = latency + remote bytes(format) / link GB/s + HBM bytes(format) / HBM GB/s + fixed ms

Designs (``Leg.design``):

* ``nccl``: the nccl transport as built. MXFP8 legs go through ``FusedNcclTokenDispatcher``:
  one push pass (gather + quantize, local rows straight to the expert-major output), ONE
  all_to_all_single of packed rows [D e4m3 | D/32 scales], one receiving pass (dequantize into
  the expert-major layout, or into the fp32 top-k reduction). Its dispatch leg also pays a
  fitted fixed cost (routing tables, host latency after the per-layer device-to-host sync).
  bf16 is torchtitan's math (``NcclTokenDispatcher``): gather + permute passes, a fitted fixed
  cost on dispatch and fitted extra passes on combine (unpermute, unsort, bmm reduction).
* ``fused``: the symm transport (SM stores into the peer): quantize and dequantize ride in the
  gather and permute passes the leg makes anyway; no fixed costs.
* ``unfused``: ``mxfp8_ep.exchange.all_to_all.all_to_all_v`` (``NcclTokenDispatcher`` built directly,
  ``mxfp8_ep.titan030``'s nccl transport): MXFP8 adds a copy of the remote rows out, a quantize
  pass, a dequantize pass and a copy of all rows back.

``staged=False`` is a bare all-to-all: no gather/permute passes and no fixed costs. Every fitted
constant is read from the row it is fit to (``FITS``). Imports no torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from benchmarks.rows import read_rows
from mxfp8_ep.config import PRESETS
from mxfp8_ep.transport import Transport
from mxfp8_ep.format.wire_format import WIRE_FORMATS, WireFormat

# Wire bytes per element of a bf16 activation in each format (MXFP8: e4m3 + one e8m0 scale per
# 32 elements), over a row of whole blocks.
_ROW = 1024
BYTES = {f.value: f.row_bytes(_ROW, 2) / _ROW for f in WireFormat}
BYTE_RATIO = BYTES["bf16"] / BYTES["mxfp8"]  # 1.939..., the speedup limit on a slow link
GB = 1e9


@dataclass(frozen=True)
class LinkParams:
    """What an all-to-all achieves per GPU and direction on a link: GB/s of remote bytes
    (algorithm bandwidth) and a fixed cost per exchange. ``source``: measured / fit / assumed."""

    name: str
    gbps: float
    latency_ms: float
    source: str


@dataclass(frozen=True)
class HbmParams:
    """Effective HBM throughput (bytes read + written per second) of the passes around the wire;
    ``fit_hbm`` fits each to one measurement (docs/performance.md, "Constants")."""

    pass_gbps: float  # gather / permute passes (both designs)
    unfused_gbps: float  # the unfused MXFP8 extra passes (2 copies, quantize, dequantize)


# The measured rows the model's constants come from (benchmarks/results/, 2xH200): one row each,
# or the median of a link's rows. ``RowRef`` names a run file and the fields that pick the row.
@dataclass(frozen=True)
class RowRef:
    """One measured row: a run file in benchmarks/results/ and the field values that pick it."""

    file: str
    match: tuple  # ((field, value), ...)
    key: str = "ms"

    def rows(self) -> list[dict]:
        return [r for r in run_rows(self.file) if all(r.get(k) == v for k, v in self.match)]

    def value(self) -> float:
        found = self.rows()
        if len(found) != 1:
            raise LookupError(f"{self.file}: {len(found)} rows match {dict(self.match)}, expected 1")
        return float(found[0][self.key])


RESULTS = Path(__file__).resolve().parent / "results"
LEGS_RUN = "2026-11-30_e51a1c7_h200x2_legs.jsonl"  # symm legs, 131072 routed rows x 5120
LINKS_RUN = "2026-11-30_62a8d8c_h200x2_links.jsonl"  # nccl legs over NVLink and NCCL shm
SOCKET_RUN = "2026-11-30_d7508cc_h200x2_links.jsonl"  # nccl legs over loopback sockets
A2A_RUN = "2026-11-30_781f820_h200x2_a2a.jsonl"  # the unfused all_to_all_v, bare
KERNELS_RUN = "2026-12-01_c051b53_h200x2_kernels.jsonl"  # each exchange kernel alone, with ceilings
FIT_RUNS = (A2A_RUN, LEGS_RUN, LINKS_RUN, SOCKET_RUN)  # what --check compares with by default


@functools.lru_cache(maxsize=None)
def run_rows(name: str) -> list[dict]:
    return read_rows(RESULTS / name)


def _leg(arm: str, leg: str = "dispatch", link: str = "nvlink", run: str = LINKS_RUN) -> RowRef:
    return RowRef(run, (("arm", arm), ("leg", leg), ("link", link), ("routing", "even"), ("pass", "fwd")))


_A2A_EVEN = (("input_shape", [16, 8192, 5120]), ("routing", "even"), ("op", "dispatch"), ("pass", "fwd"))
FITS = {
    # a bare bf16 all_to_all_single over NVLink -> NVLINK.gbps (latency assumed)
    "nvlink_bf16_a2a": RowRef(A2A_RUN, _A2A_EVEN, "bf16_ms"),
    # one SM copy of the remote bytes into the peer, and the barrier -> NVLINK_SYMM
    "symm_copy_gbps": RowRef(KERNELS_RUN, (("fmt", "bf16"), ("kernel", "p2p_copy")), "nvlink_GBps"),
    "symm_barrier": RowRef(KERNELS_RUN, (("fmt", "bf16"), ("kernel", "barrier"))),
    # bf16/symm dispatch leg -> HbmParams.pass_gbps. Its striped push overlaps the local rows'
    # HBM copies with the wire, which this additive model books as a faster pass.
    "symm_bf16_dispatch": _leg("bf16/symm", run=LEGS_RUN),
    # the unfused MXFP8 all-to-all -> HbmParams.unfused_gbps
    "unfused_mxfp8": RowRef(A2A_RUN, _A2A_EVEN, "mxfp8_ms"),
    # torchtitan's math over NVLink -> NcclCosts.titan_dispatch_ms, titan_combine_bytes
    "nccl_bf16_dispatch": _leg("bf16/nccl"),
    "nccl_bf16_combine": _leg("bf16/nccl", "combine"),
    # the fused MXFP8 dispatch -> NcclCosts.fused_dispatch_ms: the mean of the two presets' rows,
    # which send the same bytes (their gap in one run is not explained)
    "nccl_mxfp8_dispatch": _leg("mxfp8/nccl"),
    "nccl_mxfp8_all_dispatch": _leg("mxfp8_all/nccl"),
}
FIT_LEG = (131072, 5120)  # rows, dim of the legs the fits use

_BARE = 65536 * 5120 * 2  # remote bf16 bytes of the (16, 8192, 5120) all-to-all at EP 2
NVLINK_LATENCY_MS = 0.04  # assumed: an e4m3 + scales all-to-all of the same rows took 1.15 ms
NVLINK = LinkParams("nvlink", round(_BARE / (FITS["nvlink_bf16_a2a"].value() - NVLINK_LATENCY_MS) / 1e6, 1),
                    NVLINK_LATENCY_MS, "fit: bare bf16 all_to_all_single (a2a run)")
NVLINK_SYMM = LinkParams("nvlink_symm", FITS["symm_copy_gbps"].value(), round(FITS["symm_barrier"].value(), 3),
                         "measured: SM copy into the peer and the barrier (kernels run)")
IB50 = LinkParams("ib50", 50.0, 0.05, "assumed (400 Gb/s NIC per GPU)")
IB25 = LinkParams("ib25", 25.0, 0.05, "assumed (200 Gb/s NIC per GPU)")
HBM_LIKE = LinkParams("hbm_like", 4000.0, 0.0, "assumed (a link as fast as HBM)")
# NCCL shm and loopback sockets: each even leg row of the link gives a bandwidth (its wire bytes
# over its ms less the modelled passes and fixed costs); the link is fit to their median.
SLOW_LINKS = {"shm": (LINKS_RUN, 0.05), "socket": (SOCKET_RUN, 0.1)}  # run, assumed latency ms


@dataclass(frozen=True)
class NcclCosts:
    """The nccl transport's costs that are not bytes over a link or through the modelled passes,
    each fit to one NVLink measurement (``fit_nccl``; docs/performance.md, "Constants")."""

    fused_dispatch_ms: float  # fixed ms of a fused (MXFP8-config) dispatch leg
    titan_dispatch_ms: float  # fixed ms of torchtitan's bf16 dispatch leg
    titan_combine_bytes: float  # extra HBM bytes per element of torchtitan's bf16 combine leg


DESIGNS = ("nccl", "fused", "unfused")


@dataclass(frozen=True)
class Leg:
    """One exchange leg on one rank (even routing)."""

    rows: int  # routed rows leaving the rank (tokens x top-k)
    dim: int
    ep: int = 2
    design: str = "fused"  # nccl | fused | unfused (see the module docstring)
    staged: bool = True  # gather/permute passes included (a dispatcher leg) or a bare all-to-all
    kind: str = "dispatch"  # dispatch | combine (only the nccl design tells them apart)

    def __post_init__(self):
        if self.design not in DESIGNS or self.kind not in ("dispatch", "combine"):
            raise ValueError(f"bad leg {self}")

    @property
    def elems(self) -> float:
        return float(self.rows) * self.dim

    @property
    def remote_fraction(self) -> float:
        return (self.ep - 1) / self.ep


def wire_bytes(leg: Leg, fmt: str) -> float:
    return leg.elems * leg.remote_fraction * BYTES[fmt]


def hbm_ms(leg: Leg, fmt: str, hbm: Optional[HbmParams] = None) -> float:
    """Milliseconds of HBM passes besides the wire."""
    hbm = hbm or default_hbm()
    b, r = BYTES[fmt], leg.remote_fraction
    local = 1.0 - r
    ms = 0.0
    quantized = WireFormat(fmt).quantized
    if leg.design == "nccl" and quantized:
        if leg.staged:
            # push: read every row (2), write local rows expert-major (2l) and remote rows
            # packed into the send buffer (b r); receive: read them (b r), write them (2r)
            ms += leg.elems * (4 + 2 * b * r) / (hbm.pass_gbps * GB) * 1e3
        return ms
    if leg.design == "nccl":  # bf16: torchtitan's math, gather + permute as in "unfused"
        return ms + (leg.elems * 8 / (hbm.pass_gbps * GB) * 1e3 if leg.staged else 0.0)
    if leg.design == "fused":
        if leg.staged:
            # push: read every row (2), store local rows (2); receive: read local rows (2) and
            # remote rows in the wire format (b), write every row expert-major (2)
            ms += leg.elems * (4 + 4 * local + b * r) / (hbm.pass_gbps * GB) * 1e3
        return ms
    if leg.staged:  # torchtitan's gather and permute, read + write of every row each, bf16
        ms += leg.elems * 8 / (hbm.pass_gbps * GB) * 1e3
    if quantized:
        # copy remote rows out (2 + 2), quantize (2 + b), dequantize (b + 2), copy all rows back
        extra = leg.elems * (r * (4 + 2 * (2 + b)) + 4)
        ms += extra / (hbm.unfused_gbps * GB) * 1e3
    return ms


def fixed_ms(leg: Leg, fmt: str, hbm: Optional[HbmParams] = None,
             costs: Optional[NcclCosts] = None) -> float:
    """The nccl design's fitted costs outside link bytes and the modelled passes (0 otherwise):
    dispatch: a fixed ms per leg (MXFP8: fused; bf16: torchtitan's); bf16 combine: torchtitan's
    extra passes (unpermute, unsort, bmm reduction), as bytes per element through HBM."""
    if leg.design != "nccl" or not leg.staged:
        return 0.0
    costs = costs or default_nccl()
    if leg.kind == "dispatch":
        return costs.fused_dispatch_ms if WireFormat(fmt).quantized else costs.titan_dispatch_ms
    if WireFormat(fmt).quantized:
        return 0.0
    hbm = hbm or default_hbm()
    return leg.elems * costs.titan_combine_bytes / (hbm.pass_gbps * GB) * 1e3


def leg_ms(leg: Leg, fmt: str, link: LinkParams, hbm: Optional[HbmParams] = None,
           costs: Optional[NcclCosts] = None) -> float:
    return (link.latency_ms + wire_bytes(leg, fmt) / (link.gbps * GB) * 1e3 + hbm_ms(leg, fmt, hbm)
            + fixed_ms(leg, fmt, hbm, costs))


def speedup(link_gbps: float, rows: int, dim: int, ep: int = 2, design: str = "fused",
            staged: bool = True, latency_ms: float = 0.05, hbm: Optional[HbmParams] = None,
            kind: str = "dispatch") -> float:
    """bf16 time / MXFP8 time of one leg (> 1: MXFP8 is faster)."""
    link = LinkParams("custom", link_gbps, latency_ms, "argument")
    leg = Leg(rows, dim, ep, design, staged, kind)
    return leg_ms(leg, "bf16", link, hbm) / leg_ms(leg, "mxfp8", link, hbm)


def bandwidth_for_speedup(target: float, leg: Leg, latency_ms: float = 0.05,
                          hbm: Optional[HbmParams] = None) -> float:
    """The link GB/s at which the model gives ``target`` (bisection; speedup falls with GB/s)."""
    lo, hi = 1e-3, 1e5
    args = (leg.rows, leg.dim, leg.ep, leg.design, leg.staged, latency_ms, hbm, leg.kind)
    if not speedup(hi, *args) < target < speedup(lo, *args):
        raise ValueError(f"speedup {target} is outside what the model gives for {leg}")
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        s = speedup(mid, *args)
        lo, hi = (mid, hi) if s > target else (lo, mid)
    return (lo * hi) ** 0.5


def fit_hbm() -> HbmParams:
    """Solve ``leg_ms`` for each HBM throughput at its one measurement."""
    sym = Leg(131072, 5120, 2, "fused", staged=True)
    sym_wire = NVLINK_SYMM.latency_ms + wire_bytes(sym, "bf16") / (NVLINK_SYMM.gbps * GB) * 1e3
    probe = HbmParams(pass_gbps=1.0, unfused_gbps=1.0)  # ms at 1 GB/s = GB moved
    pass_gbps = hbm_ms(sym, "bf16", probe) / (FITS["symm_bf16_dispatch"].value() - sym_wire)
    bare = Leg(131072, 5120, 2, "unfused", staged=False)
    bare_wire = NVLINK.latency_ms + wire_bytes(bare, "mxfp8") / (NVLINK.gbps * GB) * 1e3
    unfused_gbps = hbm_ms(bare, "mxfp8", probe) / (FITS["unfused_mxfp8"].value() - bare_wire)
    return HbmParams(pass_gbps=pass_gbps, unfused_gbps=unfused_gbps)


@functools.lru_cache(maxsize=None)
def default_hbm() -> HbmParams:
    return fit_hbm()


def fused_dispatch_fit_ms() -> float:
    return (FITS["nccl_mxfp8_dispatch"].value() + FITS["nccl_mxfp8_all_dispatch"].value()) / 2


def fit_nccl(hbm: Optional[HbmParams] = None) -> NcclCosts:
    """Solve ``leg_ms`` of the nccl design for each fixed cost at its one NVLink measurement
    (131072 x 5120, EP 2); the shm and socket rows of the links runs then check them."""
    hbm = hbm or default_hbm()
    zero = NcclCosts(0.0, 0.0, 0.0)
    disp = Leg(*FIT_LEG, 2, "nccl", True, "dispatch")
    comb = Leg(*FIT_LEG, 2, "nccl", True, "combine")
    fused = fused_dispatch_fit_ms() - leg_ms(disp, "mxfp8", NVLINK, hbm, zero)
    titan = FITS["nccl_bf16_dispatch"].value() - leg_ms(disp, "bf16", NVLINK, hbm, zero)
    extra_ms = FITS["nccl_bf16_combine"].value() - leg_ms(comb, "bf16", NVLINK, hbm, zero)
    return NcclCosts(fused_dispatch_ms=fused, titan_dispatch_ms=titan,
                     titan_combine_bytes=extra_ms / 1e3 * hbm.pass_gbps * GB / comb.elems)


@functools.lru_cache(maxsize=None)
def default_nccl() -> NcclCosts:
    return fit_nccl()


def link_fit_rows(name: str) -> list[dict]:
    """The even leg rows a slow link is fit to (the ``mxfp8`` preset's combine: bf16 on the wire)."""
    run, _ = SLOW_LINKS[name]
    return [r for r in run_rows(run) if r["link"] == name and r["routing"] == "even" and ":" not in r["arm"]
            and not (r["arm"].startswith("mxfp8/") and r["leg"] == "combine")]


def link_bandwidths(name: str) -> list[float]:
    """GB/s each fit row of a slow link implies under the nccl design."""
    _, latency = SLOW_LINKS[name]
    out = []
    for r in link_fit_rows(name):
        fmt = "mxfp8" if r["arm"].startswith("mxfp8") else "bf16"
        leg = Leg(r["rows"], r["dim"], 2, "nccl", True, r["leg"])
        rest = latency + hbm_ms(leg, fmt) + fixed_ms(leg, fmt)
        out.append(wire_bytes(leg, fmt) / GB / ((r["ms"] - rest) / 1e3))
    return out


@functools.lru_cache(maxsize=None)
def slow_link(name: str) -> LinkParams:
    bw = sorted(link_bandwidths(name))
    n = len(bw)
    median = bw[n // 2] if n % 2 else (bw[n // 2 - 1] + bw[n // 2]) / 2
    return LinkParams(name, round(median, 2), SLOW_LINKS[name][1],
                      f"fit: median of {n} leg rows ({bw[0]:.2f}-{bw[-1]:.2f} GB/s)")


def links() -> dict[str, LinkParams]:
    return {link.name: link
            for link in (NVLINK, NVLINK_SYMM, slow_link("shm"), slow_link("socket"), IB50, IB25, HBM_LIKE)}


def two_level_wire_ms(leg: Leg, fmt: str, gpus_per_node: int, intra: LinkParams,
                      inter: LinkParams) -> float:
    """Wire time of a leg whose EP group spans nodes (EP ranks contiguous, as torchtitan's mesh
    lays them out): NCCL sends the intra-node and inter-node pieces at once, so the slower
    piece sets the time."""
    in_node = min(leg.ep, gpus_per_node)
    f_intra = (in_node - 1) / leg.ep
    f_inter = (leg.ep - in_node) / leg.ep
    b = leg.elems * BYTES[fmt]
    return max(intra.latency_ms + b * f_intra / (intra.gbps * GB) * 1e3,
               inter.latency_ms + b * f_inter / (inter.gbps * GB) * 1e3 if f_inter else 0.0)


def two_level_leg_ms(leg: Leg, fmt: str, gpus_per_node: int, intra: LinkParams,
                     inter: LinkParams, hbm: Optional[HbmParams] = None) -> float:
    return (two_level_wire_ms(leg, fmt, gpus_per_node, intra, inter) + hbm_ms(leg, fmt, hbm)
            + fixed_ms(leg, fmt, hbm))


def multinode_rows(rows: int = 8192 * 8, dim: int = 7168, gpus_per_node: int = 8) -> list[dict]:
    """EP placements of one DeepSeek-V3-like leg on 8-GPU nodes: bf16 vs MXFP8 ms (the symm
    transport: its bf16 arm; the nccl transport: torchtitan's bf16 math vs the fused MXFP8)."""
    out = []
    cases = [("EP 8 in a node", 8, "symm", "fused", "dispatch", NVLINK_SYMM, None)]
    cases += [("EP 8 in a node", 8, "nccl", "nccl", kind, NVLINK, None) for kind in ("dispatch", "combine")]
    for nic in (IB50, IB25):
        cases += [("EP 16 over 2 nodes", 16, "nccl (auto)", "nccl", kind, NVLINK, nic)
                  for kind in ("dispatch", "combine")]
    for placement, ep, transport, design, kind, intra, inter in cases:
        leg = Leg(rows, dim, ep, design, True, kind)
        t = {fmt: (leg_ms(leg, fmt, intra) if inter is None
                   else two_level_leg_ms(leg, fmt, gpus_per_node, intra, inter))
             for fmt in WIRE_FORMATS}
        out.append({"placement": placement, "ep": ep, "transport": transport, "design": design,
                    "kind": kind, "intra": intra.name, "inter": inter.name if inter else None, "rows": rows,
                    "dim": dim, "bf16_ms": t["bf16"], "mxfp8_ms": t["mxfp8"],
                    "speedup": t["bf16"] / t["mxfp8"]})
    return out


# ------------------------------------------------------------------------ predictions table
SHAPES = {  # per rank: routed rows = tokens x top-k
    "DeepSeek-V3-like": (8192 * 8, 7168),
    "Llama4-like": (16384 * 1, 5120),
}


# Columns of the predictions table: (design, leg kind).
PRED_COLS = (("nccl", "dispatch"), ("nccl", "combine"), ("fused", "dispatch"))


def prediction_rows(ep: int = 2) -> list[dict]:
    out = []
    for link in links().values():
        if link.name == "hbm_like":
            continue
        for shape, (rows, dim) in SHAPES.items():
            for design, kind in PRED_COLS:
                if link.name == "nvlink_symm" and design == "nccl":
                    continue  # the symm transport is the fused design
                leg = Leg(rows, dim, ep, design, True, kind)
                t16, t8 = leg_ms(leg, "bf16", link), leg_ms(leg, "mxfp8", link)
                out.append({"link": link.name, "gbps": link.gbps, "shape": shape, "rows": rows,
                            "dim": dim, "ep": ep, "design": design, "kind": kind, "bf16_ms": t16,
                            "mxfp8_ms": t8, "speedup": t16 / t8})
    return out


# -------------------------------------------------------------------- predicted vs measured
def _check(source: str, what: str, link: LinkParams, leg: Leg, measured: float, legs: int = 1,
           role: str = "check", measured_range: Optional[tuple] = None,
           measured_ms: tuple = (None, None)) -> dict:
    t16 = legs * leg_ms(leg, "bf16", link)
    t8 = legs * leg_ms(leg, "mxfp8", link)
    pred = t16 / t8
    return {"source": source, "what": what, "link": link.name, "design": leg.design,
            "kind": leg.kind, "staged": leg.staged, "rows": leg.rows, "dim": leg.dim, "ep": leg.ep,
            "pred_bf16_ms": t16, "pred_mxfp8_ms": t8, "bf16_ms": measured_ms[0],
            "mxfp8_ms": measured_ms[1], "predicted": pred, "measured": measured,
            "measured_range": measured_range, "rel_err": pred / measured - 1, "role": role}


def _fit_sides(run: str, row: dict) -> list[str]:
    """Which FITS pick this row (the constant's name), for a check row's role."""
    return [name for name, ref in FITS.items() if ref.file == run and all(row.get(k) == v for k, v in ref.match)]


def _role(run: str, link_name: str, sides: dict) -> str:
    """``fit: ...`` when a constant was fit to one of the row's two times (the other stays a
    prediction); ``check`` otherwise. ``sides``: {"bf16 ms": row, "mxfp8 ms": row}."""
    if link_name in SLOW_LINKS:
        return f"check ({link_name} GB/s: median fit)"
    fitted = []
    for side, (row, key) in sides.items():
        names = [n for n in _fit_sides(run, row) if FITS[n].key == key]
        if names:
            fitted.append(side + (" (mean of both MXFP8 arms)" if "nccl_mxfp8_all_dispatch" in names
                                  or "nccl_mxfp8_dispatch" in names else ""))
    return "fit: " + " + ".join(fitted) if fitted else "check"


def _a2a_checks(run: str, rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r.get("routing") != "even":
            continue  # the model is for even routing (Zipf: the busiest rank sets the pace)
        b, s, d = r["input_shape"]
        leg = Leg(b * s, d, r.get("num_splits", 2), "unfused", staged=False)
        link = links()[r.get("link", "nvlink")]
        role = _role(run, link.name, {"bf16 ms": (r, "bf16_ms"), "mxfp8 ms": (r, "mxfp8_ms")})
        out.append(_check(run, f"a2a {tuple(r['input_shape'])} {r['op']} {r['pass']}", link, leg,
                          r["bf16_ms"] / r["mxfp8_ms"], 2 if r["pass"] == "fwd+bwd" else 1, role,
                          measured_ms=(r["bf16_ms"], r["mxfp8_ms"])))
    return out


def _leg_checks(run: str, rows: list[dict]) -> list[dict]:
    """Each MXFP8 arm against the bf16 arm of its transport, same link, leg shape and pass:
    mxfp8*/symm with bf16/symm, mxfp8*/nccl (fused) with bf16/nccl (torchtitan's math;
    ``torchtitan`` when there is no bf16/nccl row). Arm variants (``arm:modifier``) are left out."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r.get("routing") == "even" and ":" not in r["arm"]:
            key = (r["link"], r["rows"], r["dim"], r["leg"], r["pass"])
            groups.setdefault(key, {})[r["arm"]] = r
    out = []
    for (link_name, n, dim, kind, passes), arms in groups.items():
        for arm, r in arms.items():
            if not arm.startswith("mxfp8"):
                continue
            preset, transport = arm.split("/")
            base_arm = f"bf16/{transport}" if f"bf16/{transport}" in arms else \
                ("torchtitan" if transport == Transport.NCCL and "torchtitan" in arms else None)
            combine_fwd = WireFormat(PRESETS[preset]["combine_fwd"])
            if base_arm is None or (kind == "combine" and passes == "fwd" and not combine_fwd.quantized):
                continue  # nothing to compare with, or the preset's combine fwd is bf16 on the wire
            link = NVLINK_SYMM if (transport == Transport.SYMM and link_name == "nvlink") else links()[link_name]
            leg = Leg(n, dim, 2, "fused" if transport == Transport.SYMM else "nccl", True, kind)
            base = arms[base_arm]
            role = _role(run, link_name, {"bf16 ms": (base, "ms"), "mxfp8 ms": (r, "ms")})
            out.append(_check(run, f"leg {kind} {passes} {arm} vs {base_arm} ({n} routed rows x {dim})",
                              link, leg, base["ms"] / r["ms"], 2 if passes == "fwd+bwd" else 1, role,
                              measured_ms=(base["ms"], r["ms"])))
    return out


def check_runs(runs: Iterable[str | Path]) -> list[dict]:
    """Predicted-vs-measured rows for every run file given (a name in benchmarks/results/ or a
    path); files that do not exist are skipped."""
    out = []
    for run in runs:
        path = Path(run) if Path(run).exists() else RESULTS / str(run)
        if not path.exists():
            continue
        rows = read_rows(path)
        out += _a2a_checks(path.name, [r for r in rows if "bf16_ms" in r])
        out += _leg_checks(path.name, [r for r in rows if "leg" in r])
    return out


# ------------------------------------------------------------------- the layer: floor + wire
# A whole EP layer priced as its no-wire floor (one rank's share of the layer on one GPU: every
# row stays) plus the bytes its four legs put on the link at the SM-store ceiling, nothing
# overlapped. Its inputs are rows: the floor run, torchtitan's EP=2 layer, the kernels run's ceiling.
FLOOR_RUN = "2026-12-02_ece860a_h200x1_layer.jsonl"  # dsv3_rank: 128 experts, 8192 tokens, one GPU
LAYER_RUN = "2026-12-01_4755761_h200x2_layer.jsonl"  # the DeepSeek-V3-like layer at EP=2
LAYER_LEGS = ("dispatch_fwd", "combine_fwd", "combine_bwd", "dispatch_bwd")
# How each leg crosses: once per (token, rank) it has an expert on ("token"), or once per routed
# row ("row"). TOKEN_LAYOUT is the symm transport's default for top-k > 1 (partial sums on the
# token-bound legs); ROW_LAYOUT_DISPATCH_ONCE is the layout of LAYER_RUN's code.
TOKEN_LAYOUT = dict.fromkeys(LAYER_LEGS, "token")
ROW_LAYOUT_DISPATCH_ONCE = {**dict.fromkeys(LAYER_LEGS, "row"), "dispatch_fwd": "token"}


def peers_per_token(ep: int, experts: int, top_k: int) -> float:
    """Expected other ranks that own at least one of a token's top-k experts (uniform routing)."""
    per_rank = experts // ep
    return (ep - 1) * (1 - math.comb(experts - per_rank, top_k) / math.comb(experts, top_k))


def layer_wire_bytes(preset: str, ep: int, layout: dict, tokens: int = 8192, dim: int = 7168,
                     experts: int = 256, top_k: int = 8) -> float:
    """Bytes one rank sends in one forward+backward of the layer (four legs)."""
    total = 0.0
    for leg in LAYER_LEGS:
        fmt = PRESETS[preset][leg]
        rows = tokens * peers_per_token(ep, experts, top_k) if layout[leg] == "token" \
            else tokens * top_k * (ep - 1) / ep
        total += rows * dim * BYTES[fmt]
    return total


def _layer_ms(run: str, arm: str, shape: str) -> float:
    return RowRef(run, (("shape", shape), ("arm", arm), ("pass", "fwd+bwd"))).value()


def layer_model_rows(eps: tuple = (2, 8), layout: Optional[dict] = None) -> list[dict]:
    """Predicted forward+backward ms of the DeepSeek-V3-like layer per preset and EP degree."""
    layout = layout or TOKEN_LAYOUT
    gbps = NVLINK_SYMM.gbps
    titan = _layer_ms(LAYER_RUN, "torchtitan", "dsv3")
    floor = {"bf16": _layer_ms(FLOOR_RUN, "bf16/symm", "dsv3_rank")}
    floor["mxfp8"] = floor["mxfp8_all"] = _layer_ms(FLOOR_RUN, "mxfp8_all/symm", "dsv3_rank")  # no row quantized
    out = []
    for ep in eps:
        bf16_ms = None
        for preset in PRESETS:
            wire = layer_wire_bytes(preset, ep, layout)
            ms = floor[preset] + wire / (gbps * GB) * 1e3
            bf16_ms = bf16_ms or ms
            out.append({"ep": ep, "arm": f"{preset}/symm", "floor_ms": floor[preset], "wire_mb": wire / 1e6,
                        "wire_ms": wire / (gbps * GB) * 1e3, "predicted_ms": ms, "vs_bf16_symm": bf16_ms / ms,
                        "vs_torchtitan_ep2": titan / ms if ep == 2 else None})
    return out


def layer_model_checks() -> list[dict]:
    """The model against LAYER_RUN (the layout its code sent): what the measurement leaves over."""
    measured = {r["arm"]: r["ms"] for r in run_rows(LAYER_RUN) if r["shape"] == "dsv3" and r["pass"] == "fwd+bwd"}
    return [{**r, "measured_ms": measured[r["arm"]], "left_over_ms": measured[r["arm"]] - r["predicted_ms"]}
            for r in layer_model_rows((2,), ROW_LAYOUT_DISPATCH_ONCE) if r["arm"] in measured]


# ---------------------------------------------------------------------------------- CLI
def _fmt_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def format_predictions(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["link"], r["gbps"]), {})[(r["shape"], r["design"], r["kind"])] = r["speedup"]
    cols = [(s, d, k) for s in SHAPES for d, k in PRED_COLS]
    headers = ["link", "GB/s"] + [f"{s} {d} {k}" if d == "nccl" else f"{s} fused (no fixed costs)"
                                  for s, d, k in cols]
    return _fmt_table(headers, [[link, g] + [f"{v[c]:.2f}x" if c in v else "-" for c in cols]
                                for (link, g), v in by.items()])


def format_multinode(rows: list[dict]) -> str:
    body = [[r["placement"], r["transport"], r["kind"],
             r["intra"] + (f" + {r['inter']}" if r["inter"] else ""),
             f"{r['bf16_ms']:.2f}", f"{r['mxfp8_ms']:.2f}", f"{r['speedup']:.2f}x"] for r in rows]
    return _fmt_table(["placement", "transport", "leg", "links", "bf16 ms", "mxfp8 ms", "speedup"], body)


def format_checks(rows: list[dict]) -> str:
    body = []
    for r in rows:
        meas = (f"{r['measured_range'][0]:.2f}-{r['measured_range'][1]:.2f}x" if r["measured_range"]
                else f"{r['measured']:.2f}x")
        ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        design = r["design"] if r["staged"] else ("no passes" if r["design"] == "fused" else r["design"])
        body.append([r["source"], r["what"], f"{r['link']} ({design})",
                     f"{r['pred_bf16_ms']:.2f} / {r['pred_mxfp8_ms']:.2f}",
                     f"{ms(r['bf16_ms'])} / {ms(r['mxfp8_ms'])}", f"{r['predicted']:.2f}x",
                     meas, f"{100 * r['rel_err']:+.0f}%", r["role"]])
    return _fmt_table(["source", "what", "link (design)", "predicted ms bf16 / mxfp8",
                       "measured ms bf16 / mxfp8", "predicted", "measured", "error", "role"], body)


def format_layer_model(rows: list[dict]) -> str:
    ratio = lambda v: "-" if v is None else f"{v:.3f}x"  # noqa: E731
    body = [[r["ep"], r["arm"], f"{r['floor_ms']:.2f}", f"{r['wire_mb']:,.0f}", f"{r['wire_ms']:.2f}",
             f"{r['predicted_ms']:.2f}", ratio(r["vs_bf16_symm"]), ratio(r["vs_torchtitan_ep2"])]
            + ([f"{r['measured_ms']:.2f}", f"{r['left_over_ms']:+.2f}"] if "measured_ms" in r else [])
            for r in rows]
    headers = ["EP", "arm", "floor ms", "wire MB", "wire ms", "floor + wire ms", "vs bf16/symm",
               "vs torchtitan (EP=2)"]
    return _fmt_table(headers + (["measured ms", "left over ms"] if rows and "measured_ms" in rows[0] else []), body)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", nargs="*", metavar="RUN",
                   help="run files (benchmarks/results/*.jsonl) to compare with; default: FIT_RUNS")
    p.add_argument("--json", help="write predictions (and checks) here")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--bw", type=float, help="one prediction: link GB/s per GPU and direction")
    p.add_argument("--rows", type=int, default=65536, help="routed rows per rank (tokens x top-k)")
    p.add_argument("--dim", type=int, default=7168)
    p.add_argument("--design", choices=DESIGNS, default="fused",
                   help="nccl: the nccl transport (fused MXFP8 vs torchtitan's bf16); fused: symm; "
                        "unfused: all_to_all_v")
    p.add_argument("--leg", choices=("dispatch", "combine"), default="dispatch",
                   help="which leg (only the nccl design tells them apart)")
    p.add_argument("--bare", action="store_true", help="bare all-to-all (no gather/permute passes)")
    args = p.parse_args(argv)

    report: dict = {"links": {k: asdict(v) for k, v in links().items()}, "hbm": asdict(default_hbm()),
                    "nccl": asdict(default_nccl())}
    if args.bw is not None:
        s = speedup(args.bw, args.rows, args.dim, args.ep, args.design, not args.bare, kind=args.leg)
        print(f"{args.design} {'bare' if args.bare else args.leg} rows={args.rows} dim={args.dim} "
              f"ep={args.ep} at {args.bw:g} GB/s: MXFP8 {s:.3f}x bf16 (limit {BYTE_RATIO:.3f}x)")
        report["single"] = {"bw": args.bw, "rows": args.rows, "dim": args.dim, "ep": args.ep,
                            "design": args.design, "kind": args.leg, "staged": not args.bare,
                            "speedup": s}
    else:
        preds = prediction_rows(args.ep)
        print(f"Predicted MXFP8 speedup over bf16, one dispatcher leg, EP={args.ep}, even routing "
              f"(limit {BYTE_RATIO:.3f}x):")
        h, n = default_hbm(), default_nccl()
        print(f"fitted: HBM passes {h.pass_gbps:.0f} GB/s, unfused extra {h.unfused_gbps:.0f} GB/s; "
              f"nccl fixed: fused dispatch {n.fused_dispatch_ms:.2f} ms, torchtitan dispatch "
              f"{n.titan_dispatch_ms:.2f} ms, torchtitan combine {n.titan_combine_bytes:.1f} B/elem")
        print(format_predictions(preds))
        multi = multinode_rows()
        print("\nOne DeepSeek-V3-like leg (65536 rows x 7168 per GPU) on 8-GPU nodes:")
        print(format_multinode(multi))
        layer = layer_model_rows()
        print("\nThe DeepSeek-V3-like layer, floor + wire (every leg once per token and rank):")
        print(format_layer_model(layer))
        report["predictions"], report["multinode"], report["layer"] = preds, multi, layer
    if args.check is not None:
        checks = check_runs(args.check or FIT_RUNS)
        print("\nPredicted vs measured (speedup = bf16 ms / MXFP8 ms):")
        print(format_checks(checks))
        layer_checks = layer_model_checks()
        print(f"\nThe layer model against {LAYER_RUN} (its code's layout):")
        print(format_layer_model(layer_checks))
        report["checks"], report["layer_checks"] = checks, layer_checks
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=list) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
