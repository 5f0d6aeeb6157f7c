"""A small time model of one EP exchange leg in bf16 and MXFP8, and its check against our
measurements (docs/performance.md explains the model, its constants and where it is wrong).

    python benchmarks/speed_model.py                        # predicted speedups, links x shapes
    python benchmarks/speed_model.py --bw 50 --rows 65536 --dim 7168 --ep 16 --design nccl
    python benchmarks/speed_model.py --check benchmarks/results/*.json [--json out.json]

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
* ``unfused``: ``mxfp8_ep.all_to_all.all_to_all_v`` (``benchmarks/a2a.py``, ``NcclTokenDispatcher``
  built directly, ``mxfp8_ep.titan030``'s nccl transport): MXFP8 adds a copy of the remote rows
  out, a quantize pass, a dequantize pass and a copy of all rows back.

``staged=False`` is a bare all-to-all (``benchmarks/a2a.py``): no gather/permute passes and no
fixed costs. Imports no torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

BYTES = {"bf16": 2.0, "mxfp8": 1.0 + 1.0 / 32}  # e4m3 + one e8m0 scale per 32 elements
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


# bf16 all_to_all_single of 131072 x 5120 per rank (65536 rows remote) took 2.15 ms on NVLink:
# 671 MB / 2.15 ms = 312 GB/s; e4m3 + scales 1.15 ms -> 0.04 ms over 346 MB / 312 GB/s.
NVLINK = LinkParams("nvlink", 312.0, 0.04, "measured (NCCL all_to_all_single, bf16)")
# The symm transport's SM stores into the peer: one SM copy of the remote bytes, 385 GB/s.
NVLINK_SYMM = LinkParams("nvlink_symm", 385.0, 0.02, "measured (SM-store copy ceiling; barrier 0.02 ms)")
# NCCL_P2P_DISABLE=1, (16, 8192, 5120) bf16 all-to-all 27.8 ms: 671 MB / (27.8 - 0.05) ms.
SHM = LinkParams("shm", round(65536 * 5120 * 2 / (27.8 - 0.05) / 1e6, 2), 0.05,
                 "measured (NCCL shm, bf16 27.8 ms; latency assumed)")
IB50 = LinkParams("ib50", 50.0, 0.05, "assumed (400 Gb/s NIC per GPU)")
IB25 = LinkParams("ib25", 25.0, 0.05, "assumed (200 Gb/s NIC per GPU)")
HBM_LIKE = LinkParams("hbm_like", 4000.0, 0.0, "assumed (a link as fast as HBM)")

# The measurements the fitted constants are fit to (2xH200, benchmarks/results/), one each:
# leg 131072 routed rows x 5120, even, NVLink, dispatch fwd: bf16/symm
# (dispatcher_h200x2_second_session.json).
# Its striped push overlaps the local rows' HBM copies with the wire; this additive model books
# that as a faster pass (an effective rate above H200's ~4.1 TB/s copy), docs/performance.md.
FIT_SYMM_BF16_MS = 2.738  # bf16/symm -> HbmParams.pass_gbps
# ... and nccl_links_h200x2.json, link nvlink:
FIT_NCCL_BF16_DISPATCH_MS = 4.446  # bf16/nccl (torchtitan's math) -> NcclCosts.titan_dispatch_ms
# mxfp8/nccl and mxfp8_all/nccl (fused) -> NcclCosts.fused_dispatch_ms. Both send the same
# dispatch bytes yet measured 3.076 and 2.617 ms in one run (unexplained): the fit takes their mean.
FIT_NCCL_MXFP8_DISPATCH_MS = (3.076 + 2.617) / 2
# ... and combine fwd: bf16/nccl -> NcclCosts.titan_combine_bytes
FIT_NCCL_BF16_COMBINE_MS = 11.641
# a2a_h200x2_naive.json, (16, 8192, 5120) even dispatch fwd, mxfp8 (unfused) arm.
FIT_UNFUSED_MXFP8_MS = 3.117
FIT_LEG = (131072, 5120)  # rows, dim of the leg the nccl_links fits use
# The files the constants were fit to and checked against: the code of the second session.
# Later code measured faster fused pushes (dispatcher_h200x2.json, fifth session: the fused
# nccl dispatch 2.41 ms where the fit takes 2.85 ms), which the model does not follow (not refit).
FIT_FILES = ("a2a_h200x2_naive.json", "dispatcher_h200x2_second_session.json", "nccl_links_h200x2.json")


# Measurements reported for links we have no raw rows of in the repo (2xH200, torch 2.11,
# NCCL 2.28.9, benchmarks/a2a.py, even routing, both legs MXFP8, unfused); the rows of
# benchmarks/results/nccl_links_h200x2.json, when present, are checked next to them.
REPORTED = (
    {"link": "shm", "input_shape": (16, 8192, 5120), "pass": "fwd", "bf16_ms": 27.8, "mxfp8_ms": 16.4},
    {"link": "shm", "input_shape": (16, 8192, 5120), "pass": "fwd+bwd", "speedup": 1.68},
    {"link": "shm", "input_shape": (4, 8192, 7168), "pass": "fwd", "speedup": (1.65, 1.69)},
    {"link": "socket", "input_shape": (16, 8192, 5120), "pass": "fwd", "speedup": (1.8, 2.0)},
)
# Loopback sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): nccl_links_h200x2.json, leg 131072 x
# 5120, even, fwd, 5 samples each (noisy). Each row gives a bandwidth (its wire bytes over its
# ms minus the modelled passes and fixed costs); the link is fit to their median. (arm, leg, ms)
SOCKET_FIT_ROWS = (
    ("torchtitan", "dispatch", 314.52), ("torchtitan", "combine", 340.61),
    ("bf16/nccl", "dispatch", 372.572), ("bf16/nccl", "combine", 352.156),
    ("mxfp8/nccl", "dispatch", 174.143),  # (its combine fwd is bf16 through the fused path: left out)
    ("mxfp8_all/nccl", "dispatch", 188.283), ("mxfp8_all/nccl", "combine", 196.339),
)
SOCKET_LATENCY_MS = 0.1  # assumed


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
    if leg.design == "nccl" and fmt == "mxfp8":
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
    if fmt == "mxfp8":
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
        return costs.fused_dispatch_ms if fmt == "mxfp8" else costs.titan_dispatch_ms
    if fmt == "mxfp8":
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
    pass_gbps = hbm_ms(sym, "bf16", probe) / (FIT_SYMM_BF16_MS - sym_wire)
    bare = Leg(131072, 5120, 2, "unfused", staged=False)
    bare_wire = NVLINK.latency_ms + wire_bytes(bare, "mxfp8") / (NVLINK.gbps * GB) * 1e3
    unfused_gbps = hbm_ms(bare, "mxfp8", probe) / (FIT_UNFUSED_MXFP8_MS - bare_wire)
    return HbmParams(pass_gbps=pass_gbps, unfused_gbps=unfused_gbps)


@functools.lru_cache(maxsize=None)
def default_hbm() -> HbmParams:
    return fit_hbm()


def fit_nccl(hbm: Optional[HbmParams] = None) -> NcclCosts:
    """Solve ``leg_ms`` of the nccl design for each fixed cost at its one NVLink measurement
    (131072 x 5120, EP 2); the shm and socket rows of nccl_links_h200x2.json then check them."""
    hbm = hbm or default_hbm()
    zero = NcclCosts(0.0, 0.0, 0.0)
    disp = Leg(*FIT_LEG, 2, "nccl", True, "dispatch")
    comb = Leg(*FIT_LEG, 2, "nccl", True, "combine")
    fused = FIT_NCCL_MXFP8_DISPATCH_MS - leg_ms(disp, "mxfp8", NVLINK, hbm, zero)
    titan = FIT_NCCL_BF16_DISPATCH_MS - leg_ms(disp, "bf16", NVLINK, hbm, zero)
    extra_ms = FIT_NCCL_BF16_COMBINE_MS - leg_ms(comb, "bf16", NVLINK, hbm, zero)
    return NcclCosts(fused_dispatch_ms=fused, titan_dispatch_ms=titan,
                     titan_combine_bytes=extra_ms / 1e3 * hbm.pass_gbps * GB / comb.elems)


@functools.lru_cache(maxsize=None)
def default_nccl() -> NcclCosts:
    return fit_nccl()


def socket_bandwidths() -> list[float]:
    """GB/s each SOCKET_FIT_ROWS row implies under the nccl design."""
    out = []
    for arm, kind, ms in SOCKET_FIT_ROWS:
        fmt = "mxfp8" if arm.startswith("mxfp8") else "bf16"
        leg = Leg(*FIT_LEG, 2, "nccl", True, kind)
        rest = SOCKET_LATENCY_MS + hbm_ms(leg, fmt) + fixed_ms(leg, fmt)
        out.append(wire_bytes(leg, fmt) / GB / ((ms - rest) / 1e3))
    return out


@functools.lru_cache(maxsize=None)
def socket_link() -> LinkParams:
    bw = sorted(socket_bandwidths())
    n = len(bw)
    median = bw[n // 2] if n % 2 else (bw[n // 2 - 1] + bw[n // 2]) / 2
    return LinkParams("socket", round(median, 2), SOCKET_LATENCY_MS,
                      f"fit: median of {n} loopback-socket leg rows ({bw[0]:.2f}-{bw[-1]:.2f} GB/s)")


def links() -> dict[str, LinkParams]:
    return {l.name: l for l in (NVLINK, NVLINK_SYMM, SHM, socket_link(), IB50, IB25, HBM_LIKE)}


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
             for fmt in ("bf16", "mxfp8")}
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


def _a2a_rows(path: Path, report: dict) -> list[dict]:
    link_name = report.get("env", {}).get("link", "nvlink")  # this file's run had no link field: NVLink
    link = links().get(link_name, NVLINK)
    out = []
    for r in report["rows"]:
        if r.get("routing") != "even":
            continue  # the model is for even routing (Zipf: the busiest rank sets the pace)
        b, s, d = r["input_shape"]
        leg = Leg(b * s, d, r.get("num_splits", 2), "unfused", staged=False)
        legs = 2 if r["pass"] == "fwd+bwd" else 1
        fit = (b * s, d, r["op"], r["pass"]) == (131072, 5120, "dispatch", "fwd")
        out.append(_check(path.name, f"a2a {tuple(r['input_shape'])} {r['op']} {r['pass']}",
                          link, leg, r["bf16_ms"] / r["mxfp8_ms"], legs,
                          "fit: mxfp8 ms" if fit else "check", measured_ms=(r["bf16_ms"], r["mxfp8_ms"])))
    return out


_LEG_SHAPE = re.compile(r"(\d+) routed rows x (\d+)")
_TUPLE_SHAPE = re.compile(r"\((\d+),\s*(\d+),\s*(\d+)\)")


def _shape_of(shape) -> Optional[tuple[int, int]]:
    """(rows, dim) from a row's shape field, or None (e.g. a whole MoE layer)."""
    if isinstance(shape, (list, tuple)) and len(shape) == 3:
        return shape[0] * shape[1], shape[2]
    if not isinstance(shape, str):
        return None
    if m := _LEG_SHAPE.search(shape):
        return int(m.group(1)), int(m.group(2))
    if m := _TUPLE_SHAPE.search(shape):
        return int(m.group(1)) * int(m.group(2)), int(m.group(3))
    return None


def _arm_rows(path: Path, rows: list[dict]) -> list[dict]:
    """Rows shaped like dispatcher_h200x2.json / nccl_links_h200x2.json: {bench, shape, arm,
    pass, ms, [link]}. Each MXFP8 arm is compared with the bf16 arm of its transport, same
    bench/link/shape/pass: mxfp8*/symm with bf16/symm, mxfp8*/nccl (fused) with bf16/nccl
    (torchtitan's math; ``torchtitan`` when there is no bf16/nccl row)."""
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if not isinstance(r, dict) or "arm" not in r or "ms" not in r:
            continue
        if "zipf" in str(r.get("shape", "")):
            continue
        key = (r.get("bench", ""), r.get("link", "nvlink"), str(r.get("shape", "")), r.get("pass", ""))
        groups.setdefault(key, {})[r["arm"]] = r["ms"]
    out = []
    for (bench, link_name, shape, passes), arms in groups.items():
        rows_dim = _shape_of(shape)
        if bench not in ("leg", "a2a") or rows_dim is None:
            continue  # whole layers: the model covers the exchange only
        for arm, ms in arms.items():
            if not arm.startswith("mxfp8"):
                continue
            transport = arm.split("/")[-1] if "/" in arm else "nccl"
            preset = arm.split("/")[0]
            base_arm = f"bf16/{transport}" if f"bf16/{transport}" in arms else \
                ("torchtitan" if transport == "nccl" and "torchtitan" in arms else None)
            if base_arm is None:
                continue
            if preset == "mxfp8" and "combine" in passes and "bwd" not in passes:
                continue  # the mxfp8 preset sends combine forward in bf16: nothing to predict
            if bench == "a2a":
                design = "unfused"  # benchmarks/a2a.py: all_to_all_v
            else:
                design = "fused" if transport == "symm" else "nccl"
            link = NVLINK_SYMM if (transport == "symm" and link_name == "nvlink") else links().get(link_name)
            if link is None:
                continue
            kind = "combine" if "combine" in passes else "dispatch"
            leg = Leg(rows_dim[0], rows_dim[1], 2, design, staged=(bench == "leg"), kind=kind)
            legs = 2 if "fwd+bwd" in passes else 1
            out.append(_check(path.name, f"{bench} {passes} {arm} vs {base_arm} "
                              f"({shape.split(' per rank')[0]})", link, leg, arms[base_arm] / ms, legs,
                              _arm_role(bench, link_name, rows_dim, passes, arm, base_arm),
                              measured_ms=(arms[base_arm], ms)))
    return out


def _arm_role(bench: str, link_name: str, rows_dim, passes: str, arm: str, base_arm: str) -> str:
    """Which of a row's two times a constant was fit to (the other stays a prediction)."""
    if bench == "leg" and link_name == "socket":
        return "check (socket GB/s: median fit)"
    if bench != "leg" or link_name != "nvlink" or rows_dim != FIT_LEG or passes not in (
            "dispatch fwd", "combine fwd"):
        return "check"
    fitted = []
    if base_arm == "bf16/symm" and passes == "dispatch fwd":
        fitted.append("bf16 ms")
    if base_arm == "bf16/nccl":
        fitted.append("bf16 ms")
    if arm.endswith("/nccl") and passes == "dispatch fwd":
        fitted.append("mxfp8 ms (mean of both MXFP8 arms)")
    return "fit: " + " + ".join(fitted) if fitted else "check"


def _dedupe(rows: list[dict]) -> list[dict]:
    """One row per measurement: the same arm times in two files (dispatcher_h200x2_second_session.json holds
    the nvlink rows of nccl_links_h200x2.json) become one row naming both files."""
    seen: dict[tuple, dict] = {}
    out = []
    for r in rows:
        key = (r["what"], r["link"], r["design"], r["bf16_ms"], r["mxfp8_ms"])
        if r["bf16_ms"] is not None and key in seen:
            seen[key]["source"] += " = " + r["source"]
            continue
        seen[key] = r
        out.append(r)
    return out


def _reported_rows() -> list[dict]:
    out = []
    for r in REPORTED:
        b, s, d = r["input_shape"]
        leg = Leg(b * s, d, 2, "unfused", staged=False)
        link = links()[r["link"]]
        legs = 2 if r["pass"] == "fwd+bwd" else 1
        meas = r.get("speedup") or r["bf16_ms"] / r["mxfp8_ms"]
        rng = tuple(meas) if isinstance(meas, tuple) else None
        mid = sum(rng) / 2 if rng else meas
        role = "check"
        if r["link"] == "shm" and "bf16_ms" in r:
            role = "fit: link GB/s (bf16 ms)"
        out.append(_check("reported", f"a2a {r['input_shape']} {r['pass']}", link, leg, mid, legs,
                          role, rng, (r.get("bf16_ms"), r.get("mxfp8_ms"))))
    # The wire alone: pre-quantized e4m3 + uint8 scales vs bf16, all_to_all_single, NVLink.
    leg = Leg(131072, 5120, 2, "fused", staged=False)  # no passes: the wire and latency only
    out.append(_check("reported", "wire only: e4m3+scales vs bf16, 131072 x 5120", NVLINK, leg,
                      2.15 / 1.15, 1, "check", None, (2.15, 1.15)))
    return out


def check_files(paths: Iterable[Path]) -> list[dict]:
    """Predicted-vs-measured rows for every result file we can read (missing files are
    skipped, so nccl_links_h200x2.json is used once it exists), then the reported rows."""
    out = []
    for path in map(Path, paths):
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        rows = data.get("rows") if isinstance(data, dict) else data
        if not isinstance(rows, list) or not rows:
            continue
        if isinstance(rows[0], dict) and "bf16_ms" in rows[0]:
            out += _a2a_rows(path, data)
        else:
            out += _arm_rows(path, rows)
    return _dedupe(out) + _reported_rows()


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
    return _fmt_table(headers, [[l, g] + [f"{v[c]:.2f}x" if c in v else "-" for c in cols]
                                for (l, g), v in by.items()])


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


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", nargs="*", metavar="JSON", help="result files to compare with")
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
        report["predictions"], report["multinode"] = preds, multi
    if args.check is not None:
        files = [Path(f) for f in args.check] or [Path(__file__).parent / "results" / f for f in FIT_FILES]
        checks = check_files(files)
        print("\nPredicted vs measured (speedup = bf16 ms / MXFP8 ms):")
        print(format_checks(checks))
        report["checks"] = checks
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=list) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
