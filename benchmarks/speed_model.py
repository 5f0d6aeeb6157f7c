"""A small time model of one EP exchange leg in bf16 and MXFP8, and its check against our
measurements (docs/performance.md explains the model, its constants and where it is wrong).

    python benchmarks/speed_model.py                        # predicted speedups, links x shapes
    python benchmarks/speed_model.py --bw 50 --rows 65536 --dim 7168 --ep 16 --design unfused
    python benchmarks/speed_model.py --check benchmarks/results/*.json [--json out.json]

One leg per rank, even routing, EP degree W: ``rows`` routed rows (tokens x top-k) of ``dim``
elements leave each rank, a fraction (W-1)/W of them to other ranks. Time of a format:

    t = latency + remote bytes(format) / link GB/s + HBM bytes(format) / HBM GB/s

``unfused`` (the nccl transport, ``mxfp8_ep.all_to_all``): MXFP8 adds a copy of the remote
rows out, a quantize pass, a dequantize pass and a copy of all rows back. ``fused`` (the symm
transport): quantize and dequantize ride in the gather and permute passes the leg makes anyway,
so MXFP8 only changes how many bytes those passes and the wire move. ``staged=False`` is a bare
all-to-all (``benchmarks/a2a.py``): no gather/permute passes. Imports no torch.
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

# The two measurements the HBM constants are fit to (2xH200, benchmarks/results/):
# dispatcher_h200x2.json, leg 131072 routed rows x 5120, even, bf16/symm dispatch fwd;
FIT_SYMM_BF16_MS = 3.005
# a2a_h200x2_naive.json, (16, 8192, 5120) even dispatch fwd, mxfp8 (unfused) arm.
FIT_UNFUSED_MXFP8_MS = 3.117


# Measurements reported for links we have no raw rows of in the repo (2xH200, torch 2.11,
# NCCL 2.28.9, benchmarks/a2a.py, even routing, both legs MXFP8, unfused); the rows of
# benchmarks/results/nccl_links_h200x2.json, when present, are checked next to them.
REPORTED = (
    {"link": "shm", "input_shape": (16, 8192, 5120), "pass": "fwd", "bf16_ms": 27.8, "mxfp8_ms": 16.4},
    {"link": "shm", "input_shape": (16, 8192, 5120), "pass": "fwd+bwd", "speedup": 1.68},
    {"link": "shm", "input_shape": (4, 8192, 7168), "pass": "fwd", "speedup": (1.65, 1.69)},
    {"link": "socket", "input_shape": (16, 8192, 5120), "pass": "fwd", "speedup": (1.8, 2.0)},
)
# Loopback sockets: no ms reported, only 1.8-2.0x (noisy); the bandwidth below is the one at
# which the model gives 1.85x at (16, 8192, 5120), i.e. derived from the measurement, not measured.
SOCKET_SPEEDUP = 1.85


@dataclass(frozen=True)
class Leg:
    """One exchange leg on one rank (even routing)."""

    rows: int  # routed rows leaving the rank (tokens x top-k)
    dim: int
    ep: int = 2
    design: str = "fused"  # fused | unfused
    staged: bool = True  # gather/permute passes included (a dispatcher leg) or a bare all-to-all

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


def leg_ms(leg: Leg, fmt: str, link: LinkParams, hbm: Optional[HbmParams] = None) -> float:
    return link.latency_ms + wire_bytes(leg, fmt) / (link.gbps * GB) * 1e3 + hbm_ms(leg, fmt, hbm)


def speedup(link_gbps: float, rows: int, dim: int, ep: int = 2, design: str = "fused",
            staged: bool = True, latency_ms: float = 0.05, hbm: Optional[HbmParams] = None) -> float:
    """bf16 time / MXFP8 time of one leg (> 1: MXFP8 is faster)."""
    link = LinkParams("custom", link_gbps, latency_ms, "argument")
    leg = Leg(rows, dim, ep, design, staged)
    return leg_ms(leg, "bf16", link, hbm) / leg_ms(leg, "mxfp8", link, hbm)


def bandwidth_for_speedup(target: float, leg: Leg, latency_ms: float = 0.05,
                          hbm: Optional[HbmParams] = None) -> float:
    """The link GB/s at which the model gives ``target`` (bisection; speedup falls with GB/s)."""
    lo, hi = 1e-3, 1e5
    if not speedup(hi, leg.rows, leg.dim, leg.ep, leg.design, leg.staged, latency_ms, hbm) < target \
            < speedup(lo, leg.rows, leg.dim, leg.ep, leg.design, leg.staged, latency_ms, hbm):
        raise ValueError(f"speedup {target} is outside what the model gives for {leg}")
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        s = speedup(mid, leg.rows, leg.dim, leg.ep, leg.design, leg.staged, latency_ms, hbm)
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


def socket_link() -> LinkParams:
    leg = Leg(131072, 5120, 2, "unfused", staged=False)
    gbps = bandwidth_for_speedup(SOCKET_SPEEDUP, leg, latency_ms=0.1)
    return LinkParams("socket", round(gbps, 1), 0.1, f"derived from the measured {SOCKET_SPEEDUP}x (1.8-2.0x)")


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
    return two_level_wire_ms(leg, fmt, gpus_per_node, intra, inter) + hbm_ms(leg, fmt, hbm)


def multinode_rows(rows: int = 8192 * 8, dim: int = 7168, gpus_per_node: int = 8) -> list[dict]:
    """EP placements of one DeepSeek-V3-like leg on 8-GPU nodes: bf16 vs MXFP8 ms."""
    out = []
    cases = [("EP 8 in a node", 8, "symm", "fused", NVLINK_SYMM, None),
             ("EP 8 in a node", 8, "nccl", "unfused", NVLINK, None)]
    for nic in (IB50, IB25):
        cases += [("EP 16 over 2 nodes", 16, "nccl", "unfused", NVLINK, nic),
                  ("EP 16 over 2 nodes", 16, "fused over NCCL (not built)", "fused", NVLINK, nic)]
    for placement, ep, transport, design, intra, inter in cases:
        leg = Leg(rows, dim, ep, design)
        t = {fmt: (leg_ms(leg, fmt, intra) if inter is None
                   else two_level_leg_ms(leg, fmt, gpus_per_node, intra, inter))
             for fmt in ("bf16", "mxfp8")}
        out.append({"placement": placement, "ep": ep, "transport": transport, "design": design,
                    "intra": intra.name, "inter": inter.name if inter else None, "rows": rows,
                    "dim": dim, "bf16_ms": t["bf16"], "mxfp8_ms": t["mxfp8"],
                    "speedup": t["bf16"] / t["mxfp8"]})
    return out


# ------------------------------------------------------------------------ predictions table
SHAPES = {  # per rank: routed rows = tokens x top-k
    "DeepSeek-V3-like": (8192 * 8, 7168),
    "Llama4-like": (16384 * 1, 5120),
}


def prediction_rows(ep: int = 2) -> list[dict]:
    out = []
    for link in links().values():
        if link.name == "hbm_like":
            continue
        for shape, (rows, dim) in SHAPES.items():
            for design in ("unfused", "fused"):
                if link.name == "nvlink_symm" and design == "unfused":
                    continue  # the symm transport is the fused design
                leg = Leg(rows, dim, ep, design)
                t16, t8 = leg_ms(leg, "bf16", link), leg_ms(leg, "mxfp8", link)
                out.append({"link": link.name, "gbps": link.gbps, "shape": shape, "rows": rows,
                            "dim": dim, "ep": ep, "design": design, "bf16_ms": t16,
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
            "staged": leg.staged, "rows": leg.rows, "dim": leg.dim, "ep": leg.ep,
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
    pass, ms, [link]}. Each MXFP8 arm is compared with the bf16 arm of its transport (for nccl
    also torchtitan's, which is the same exchange), same bench/link/shape/pass."""
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
            base = arms.get(f"bf16/{transport}") or (arms.get("torchtitan") if transport == "nccl" else None)
            if base is None:
                continue
            if preset == "mxfp8" and "combine" in passes and "bwd" not in passes:
                continue  # the mxfp8 preset sends combine forward in bf16: nothing to predict
            design = "fused" if transport == "symm" else "unfused"
            link = NVLINK_SYMM if (transport == "symm" and link_name == "nvlink") else links().get(link_name)
            if link is None:
                continue
            leg = Leg(rows_dim[0], rows_dim[1], 2, design, staged=(bench == "leg"))
            legs = 2 if "fwd+bwd" in passes else 1
            fit = transport == "symm" and bench == "leg" and passes == "dispatch fwd" and \
                rows_dim == (131072, 5120)
            base_arm = f"bf16/{transport}" if f"bf16/{transport}" in arms else "torchtitan"
            out.append(_check(path.name, f"{bench} {passes} {arm} vs {base_arm} "
                              f"({shape.split(' per rank')[0]})", link, leg, base / ms, legs,
                              "fit: bf16 ms" if fit else "check", measured_ms=(base, ms)))
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
        role = {"socket": "fit: link GB/s", "shm": "check"}[r["link"]]
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
    return out + _reported_rows()


# ---------------------------------------------------------------------------------- CLI
def _fmt_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def format_predictions(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["link"], r["gbps"]), {})[(r["shape"], r["design"])] = r["speedup"]
    cols = [(s, d) for s in SHAPES for d in ("unfused", "fused")]
    headers = ["link", "GB/s"] + [f"{s} {d}" for s, d in cols]
    return _fmt_table(headers, [[l, g] + [f"{v[c]:.2f}x" if c in v else "-" for c in cols]
                                for (l, g), v in by.items()])


def format_multinode(rows: list[dict]) -> str:
    body = [[r["placement"], r["transport"], r["intra"] + (f" + {r['inter']}" if r["inter"] else ""),
             f"{r['bf16_ms']:.2f}", f"{r['mxfp8_ms']:.2f}", f"{r['speedup']:.2f}x"] for r in rows]
    return _fmt_table(["placement", "transport", "links", "bf16 ms", "mxfp8 ms", "speedup"], body)


def format_checks(rows: list[dict]) -> str:
    body = []
    for r in rows:
        meas = (f"{r['measured_range'][0]:.2f}-{r['measured_range'][1]:.2f}x" if r["measured_range"]
                else f"{r['measured']:.2f}x")
        ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        body.append([r["source"], r["what"], f"{r['link']} ({r['design']})",
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
    p.add_argument("--design", choices=("fused", "unfused"), default="fused")
    p.add_argument("--bare", action="store_true", help="bare all-to-all (no gather/permute passes)")
    args = p.parse_args(argv)

    report: dict = {"links": {k: asdict(v) for k, v in links().items()}, "hbm": asdict(default_hbm())}
    if args.bw is not None:
        s = speedup(args.bw, args.rows, args.dim, args.ep, args.design, not args.bare)
        print(f"{args.design} {'bare' if args.bare else 'leg'} rows={args.rows} dim={args.dim} "
              f"ep={args.ep} at {args.bw:g} GB/s: MXFP8 {s:.3f}x bf16 (limit {BYTE_RATIO:.3f}x)")
        report["single"] = {"bw": args.bw, "rows": args.rows, "dim": args.dim, "ep": args.ep,
                            "design": args.design, "staged": not args.bare, "speedup": s}
    else:
        preds = prediction_rows(args.ep)
        print(f"Predicted MXFP8 speedup over bf16, one dispatcher leg, EP={args.ep}, even routing "
              f"(limit {BYTE_RATIO:.3f}x):")
        print(format_predictions(preds))
        multi = multinode_rows()
        print("\nOne DeepSeek-V3-like leg (65536 rows x 7168 per GPU) on 8-GPU nodes:")
        print(format_multinode(multi))
        report["predictions"], report["multinode"] = preds, multi
    if args.check is not None:
        files = [Path(f) for f in args.check] or sorted(Path(__file__).parent.glob("results/*.json"))
        checks = check_files(files)
        print("\nPredicted vs measured (speedup = bf16 ms / MXFP8 ms):")
        print(format_checks(checks))
        report["checks"] = checks
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=list) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
