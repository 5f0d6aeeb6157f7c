"""Where one training step's GPU time goes, from torchtitan's profiler traces.

    python launch/train.py model=dsv3_ep_bench ... training.profile_freq=10
    python benchmarks/step_profile.py <run_dir>/profile_traces --json step_profile.json

``training.profile_freq=N`` has torchtitan's profiler write one step's Chrome trace per rank
every ``N`` steps (``<run_dir>/profile_traces/iteration_<step>/rank<r>_trace.json``). This
script reads the newest iteration's traces (or the trace files given) and sorts every GPU
kernel, copy and fill of the step into categories: by kernel name (GEMMs, attention, NCCL,
this repo's Triton kernels), then by the CPU region that launched it (the optimizer step,
FSDP), else ``other``. Per rank it prints the step's GPU span, its busy time (union over
streams), its idle time and each category's kernel time, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The Triton kernels of this repo, by module: their names are the `def` names in the source.
_OUR_KERNEL_MODULES = {
    "dispatcher (mxfp8_ep Triton)": ("symm_kernels.py", "triton_kernels.py"),
    "expert activation (mxfp8_ep Triton)": ("grouped_experts.py",),
}

# Kernel-name rules, first match wins (after this repo's kernels).
_NAME_RULES = (
    ("attention", re.compile(r"flash|fmha|attn|attention|cudnn", re.I)),
    ("expert GEMMs (grouped)", re.compile(r"cutlass|grouped_?gemm|grouped_?mm", re.I)),
    ("dense GEMMs", re.compile(r"nvjet|gemm|xmma|cublas|sm90_", re.I)),
    ("NCCL all-to-all", re.compile(r"nccl.*(SendRecv|AllToAll|Send|Recv)", re.I)),
    ("NCCL FSDP / other collectives", re.compile(r"nccl", re.I)),
    ("symmetric-memory barrier", re.compile(r"symmetric_memory|barrier_kernel", re.I)),
)

# Launch-region rules for what the names leave: CPU annotations that enclose the launch.
_REGION_RULES = (
    ("optimizer step", re.compile(r"^Optimizer\.step")),
    ("FSDP copies / casts", re.compile(r"^FSDP::")),
)

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def our_kernel_names() -> dict[str, str]:
    """Kernel name -> category for this repo's Triton kernels."""
    names = {}
    for category, files in _OUR_KERNEL_MODULES.items():
        for file in files:
            text = (REPO / "mxfp8_ep" / file).read_text()
            for name in re.findall(r"^def (\w+_kernel)\(", text, flags=re.M):
                names[name] = category
    return names


@dataclass
class StepProfile:
    trace: str
    span_ms: float  # first GPU event start -> last GPU event end
    busy_ms: float  # union of GPU events over all streams
    idle_ms: float
    categories_ms: dict[str, float] = field(default_factory=dict)  # sum of event durations


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


class _Regions:
    """CPU annotations per thread, to find the region a launch happened in."""

    def __init__(self, events: list[dict]):
        # Per thread: (start, stop, category) of each annotation a region rule matches.
        self._by_thread: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op"):
                category = next((c for c, rule in _REGION_RULES if rule.search(e["name"])), None)
                if category is not None:
                    self._by_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], category))
        self._starts = {}
        for key, spans in self._by_thread.items():
            spans.sort()
            self._starts[key] = [s for s, _, _ in spans]

    def category(self, launch: dict | None) -> str | None:
        if launch is None:
            return None
        key = (launch.get("pid"), launch.get("tid"))
        spans = self._by_thread.get(key)
        if not spans:
            return None
        # Regions do not interleave within a thread; scan the ones that start before the launch.
        i = bisect.bisect_right(self._starts[key], launch["ts"])
        for start, stop, category in reversed(spans[:i]):
            if start <= launch["ts"] <= stop:
                return category
        return None


def categorize(name: str, launch: dict | None, regions: _Regions, ours: dict[str, str]) -> str:
    if name in ours:
        return ours[name]
    for category, rule in _NAME_RULES:
        if rule.search(name):
            return category
    region = regions.category(launch)
    if region is not None:
        return region
    if "multi_tensor_apply" in name:
        return "foreach kernels outside the optimizer (grad norm, clipping)"
    return "other (elementwise, copies, reductions)"


def summarize(trace_path: Path) -> StepProfile:
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    ours = our_kernel_names()
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    regions = _Regions(events)
    per_category: dict[str, float] = defaultdict(float)
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        name = e["name"] if e["cat"] == "kernel" else e["cat"]
        per_category[categorize(name, launch, regions, ours)] += e["dur"]
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    if not intervals:
        raise ValueError(f"{trace_path}: no GPU events (a CPU run, or profiling was off)")
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    busy = _union_us(intervals)
    return StepProfile(
        trace=str(trace_path), span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3,
        categories_ms={k: v / 1e3 for k, v in sorted(per_category.items(), key=lambda kv: -kv[1])},
    )


def newest_traces(path: Path) -> list[Path]:
    """A trace file itself, or the rank traces of the newest ``iteration_<step>`` under ``path``."""
    if path.is_file():
        return [path]
    iterations = sorted(path.glob("iteration_*"), key=lambda p: int(p.name.split("_")[1]))
    if not iterations:
        raise FileNotFoundError(f"no iteration_<step> folders under {path} (training.profile_freq > 0?)")
    return sorted(iterations[-1].glob("rank*_trace.json"))


def print_table(profiles: list[StepProfile]) -> None:
    names = list(dict.fromkeys(k for p in profiles for k in p.categories_ms))
    head = f"{'category':<40}" + "".join(f"{Path(p.trace).stem[:16]:>18}" for p in profiles)
    print(head)
    print("-" * len(head))
    for label, key in (("step span (GPU)", "span_ms"), ("busy", "busy_ms"), ("idle", "idle_ms")):
        print(f"{label:<40}" + "".join(f"{getattr(p, key):>15.2f} ms" for p in profiles))
    for name in names:
        print(f"{name:<40}" + "".join(
            f"{p.categories_ms.get(name, 0.0):>9.2f} ms {100 * p.categories_ms.get(name, 0.0) / p.span_ms:>4.1f}%"
            for p in profiles))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="profile_traces folders or trace files")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    profiles = [summarize(t) for p in args.paths for t in newest_traces(p)]
    print_table(profiles)
    if args.json:
        args.json.write_text(json.dumps([asdict(p) for p in profiles], indent=1))


if __name__ == "__main__":
    main()
