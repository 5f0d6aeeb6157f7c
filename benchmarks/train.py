"""Recipe training runs as rows: each run's throughput against the baseline arm's in the same
sweep, and where one step's GPU time goes (torchtitan's profiler traces).

    python launch/train.py --multirun model=dsv3_ep_bench a2a=bf16,mxfp8 ... hydra.sweep.dir=RUNS
    python -m benchmarks.train RUNS --out OUT [--bench train] [--link shm]
    python -m benchmarks.train RUNS --out OUT --step-profile      # runs with training.profile_freq
    python -m benchmarks.train --numerics-every 50 --repeats 2 --out OUT -- OVERRIDES...

Each run dir's ``summary.json`` (``launch.run.run_summary.RunSummary``: totals over the logged
windows after the first, so tokens/s is their tokens over their time) and ``train_config.yaml``
give one row: its arm
(``<preset>/<transport>``, ``:overlap`` with ``parallelism.overlap_shared_experts``), tokens/s
(all ranks), step time, the loss at every logged step, all-to-all bytes per step, peak reserved
memory; and against the ``--baseline`` arm's run of the same model: ``speedup_vs_<baseline>``
(tokens/s over the baseline's) and ``loss_delta_vs_<baseline>`` (final loss minus the baseline's).
A run whose ranks shared one GPU (``parallelism.share_gpu``) says so (``gpu_shared``) and gets no
speed-up: its tokens/s are no speed figure.

``--step-profile``: ``training.profile_freq=N`` has torchtitan write one step's Chrome trace per
rank every ``N`` steps (``<run>/profile_traces/iteration_<step>/rank<r>_trace.json``). The newest
iteration's traces give a row per rank: the step's GPU span, busy time (union over streams),
idle time, and each category's kernel time: by kernel name (GEMMs, attention, NCCL, this repo's
Triton kernels), else by the CPU region that launched it (the optimizer step, FSDP), else other.

``--numerics-every N``: what the numerics telemetry costs a training step. This script runs
``launch/train.py OVERRIDES`` itself, with ``logging.numerics_every=0`` (off) and ``=N`` (on),
``--repeats`` times in turn (off, on, off, on, ...: drift of the machine reaches both arms alike).
A run's step time is its own headline number (its steady seconds over its steady steps), over
every step: the sampled steps, with their quantizing and the sums over ranks, and the steps
between them, which do no telemetry work. One row per run and one comparing the arms
(``on_vs_off``, ``overhead_pct``: step time on / off - 1, each arm's runs taken together: their
seconds over their steps), bench ``numerics_overhead``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.harness import LINKS, Results, key_of
from launch.run.run_summary import ratio_of_sums

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("model", "arm", "tokens_per_s", "speedup_vs_bf16_nccl", "step_time_s", "final_loss",
           "loss_delta_vs_bf16_nccl", "a2a_bytes_per_step")


def run_rows(paths: list[str], baseline: str) -> list[dict]:
    """One row per finished run under ``paths`` (run dirs or sweep dirs)."""
    from omegaconf import OmegaConf

    from launch.run.run_dir import RUN_CONFIG
    from launch.tools.compare_runs import collect

    rows = []
    for c in collect(paths):
        s = c.run
        config_file = Path(c.path) / RUN_CONFIG
        cfg = OmegaConf.load(config_file) if config_file.is_file() else OmegaConf.create({})
        overlap = bool(OmegaConf.select(cfg, "parallelism.overlap_shared_experts", default=False))
        transport = s.a2a_legs.get("transport", "?")
        rows.append({
            "model": s.model, "arm": f"{s.a2a}/{transport}" + (":overlap" if overlap else ""), "ep": s.ep,
            "world_size": s.world_size, "steps": s.steps, "seq_len": OmegaConf.select(cfg, "training.seq_len"),
            "local_batch_size": OmegaConf.select(cfg, "training.local_batch_size"),
            "tokens_per_s": s.tokens_per_s_global, "tokens_per_s_per_rank": s.tokens_per_s,
            "step_time_s": s.step_time_s, "final_loss": s.final_loss, "a2a_bytes_per_step": s.a2a_bytes_per_step,
            "max_memory_gib": s.max_memory_gib, "mfu_pct": s.mfu_pct, "steady_steps": s.steady_steps,
            "run_name": s.run_name, "gpu_shared": s.gpu_shared,
            "logged_steps": s.logged_steps, "losses": s.losses,
        })
    add_throughput_ratios(rows, baseline)
    return sorted(rows, key=lambda r: (r["model"], r["arm"] != baseline, r["arm"]))


def add_throughput_ratios(rows: list[dict], baseline: str) -> None:
    """``speedup_vs_<baseline>`` (tokens/s over the baseline run's, same model) and
    ``loss_delta_vs_<baseline>`` on every row; None where the sweep has no baseline run, and
    no speed-up where either run's ranks shared one GPU (``gpu_shared``: no speed figure)."""
    base = {r["model"]: r for r in rows if r["arm"] == baseline}
    name = key_of(baseline)
    for r in rows:
        b = base.get(r["model"])
        ok = b is not None and r["tokens_per_s"] and b["tokens_per_s"] and not (r["gpu_shared"] or b["gpu_shared"])
        r[f"speedup_vs_{name}"] = round(r["tokens_per_s"] / b["tokens_per_s"], 3) if ok else None
        ok = b is not None and r["final_loss"] is not None and b["final_loss"] is not None
        r[f"loss_delta_vs_{name}"] = round(r["final_loss"] - b["final_loss"], 4) if ok else None


# ---------------------------------------------------------------------- one step's GPU time

# The Triton kernels of this repo, by module: their names are the `def` names in the source.
_OUR_KERNEL_MODULES = {
    "dispatcher (mxfp8_ep Triton)": ("exchange/symm_kernels.py", "kernels/triton_kernels.py"),
    "expert activation (mxfp8_ep Triton)": ("kernels/expert_kernels.py",),
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


def step_profile_rows(paths: list[str]) -> list[dict]:
    """A row per rank trace of each run under ``paths`` that has ``profile_traces``."""
    rows = []
    for run_dir in _run_dirs(paths):
        traces = run_dir / "profile_traces"
        if not traces.is_dir():
            continue
        (run,) = run_rows([str(run_dir)], baseline="")
        for trace in newest_traces(traces):
            profile = asdict(summarize(trace))
            del profile["trace"]
            rows.append({"model": run["model"], "arm": run["arm"], "world_size": run["world_size"],
                         "iteration": int(trace.parent.name.split("_")[1]),
                         "rank": int(trace.name.split("_")[0].removeprefix("rank")), **profile})
    return rows


def _run_dirs(paths: list[str]) -> list[Path]:
    from launch.run.run_dir import SUMMARY

    return sorted({f.parent for p in paths for f in Path(p).rglob(SUMMARY)})


# -------------------------------------------------------------- the numerics telemetry's cost

NUMERICS_BENCH = "numerics_overhead"


def launch_run(overrides: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    """``launch/train.py OVERRIDES`` into ``run_dir``; its console goes to ``run_dir``."""
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "benchmark_console.txt").write_text(proc.stdout + proc.stderr)
    return proc


def trained_row(overrides: list[str], run_dir: Path) -> dict:
    """One recipe run (``launch_run``) and its ``run_rows`` row; exits with the run's output
    when it failed or logged no step time."""
    proc = launch_run(overrides, run_dir)
    rows = run_rows([str(run_dir)], baseline="") if proc.returncode == 0 else []
    if not rows or rows[0]["step_time_s"] is None:
        raise SystemExit(f"{' '.join(map(str, proc.args))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return rows[0]


def numerics_overhead(overrides: list[str], every: int, repeats: int, out: str, link: str | None = None,
                      bench: str = NUMERICS_BENCH) -> dict:
    """The runs with ``logging.numerics_every`` 0 and ``every`` in turn, a row each as it ends,
    then the ``on_vs_off`` row (returned)."""
    runs = Path(out).resolve() / "runs" / time.strftime("%Y-%m-%d_%H-%M-%S")  # fresh per call: never reused
    results = None
    times: dict[int, list[float]] = {0: [], every: []}
    steps: dict[int, list[int]] = {0: [], every: []}
    for repeat in range(repeats):
        for arm_every in (0, every):
            run_dir = runs / f"numerics_every_{arm_every}_{repeat}"
            r = trained_row([*overrides, f"logging.numerics_every={arm_every}"], run_dir)
            if results is None:
                results = Results(bench, out, link=link, count=r["world_size"])
            times[arm_every].append(r["step_time_s"])
            steps[arm_every].append(r["steady_steps"] or 1)  # a summary without it: runs count alike
            results.write([{"arm": "off" if arm_every == 0 else "on", "numerics_every": arm_every, "repeat": repeat,
                            "overrides": overrides, "steps": r["steps"], "step_time_s": r["step_time_s"],
                            "tokens_per_s": r["tokens_per_s_per_rank"], "final_loss": r["final_loss"],
                            "run_dir": str(run_dir)}])
    off, on = (ratio_of_sums(list(zip(times[arm], steps[arm]))) for arm in (0, every))
    (row,) = results.write([{"arm": "on_vs_off", "numerics_every": every, "repeats": repeats, "overrides": overrides,
                             "step_time_s_off": off, "step_time_s_on": on, "overhead_pct": 100 * (on / off - 1),
                             "step_times_off": times[0], "step_times_on": times[every]}])
    print(f"numerics_every={every}: step {on:.4f}s vs {off:.4f}s off, overhead {row['overhead_pct']:+.2f}% "
          f"({results.file.path})")
    return row


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="run or sweep directories; with --numerics-every: launch/train.py overrides (after --)")
    parser.add_argument("--out", required=True, help="folder of the results file (JSON Lines)")
    parser.add_argument("--bench", default=None,
                        help="the results' bench name (default: train, step_profile or numerics_overhead)")
    parser.add_argument("--baseline", default="bf16/nccl", help="the arm every run is compared with")
    parser.add_argument("--link", choices=sorted(LINKS), default=None, help="the link NCCL crossed in these runs")
    parser.add_argument("--step-profile", action="store_true", help="one step's GPU time by category, per rank")
    parser.add_argument("--numerics-every", type=int, default=None,
                        help="run the overrides with logging.numerics_every=0 and =N, and compare their step times")
    parser.add_argument("--repeats", type=int, default=None,
                        help="with --numerics-every: runs per arm, taken in turn (off, on, off, on, ...; default 2)")
    args = parser.parse_args(argv)
    if args.numerics_every is not None:
        if args.numerics_every <= 0:
            parser.error("--numerics-every must be > 0 (the arm with the telemetry)")
        if args.step_profile:
            parser.error("--numerics-every and --step-profile are separate modes")
        repeats = 2 if args.repeats is None else args.repeats
        if repeats <= 0:
            parser.error("--repeats must be > 0")
        return numerics_overhead(args.paths, args.numerics_every, repeats, args.out, args.link,
                                 bench=args.bench or NUMERICS_BENCH)
    if args.repeats is not None:
        parser.error("--repeats is an option of --numerics-every")
    if not args.paths:
        parser.error("the run or sweep directories are required")
    if args.step_profile:
        rows = step_profile_rows(args.paths)
        columns = ("arm", "rank", "span_ms", "busy_ms", "idle_ms")
    else:
        rows = run_rows(args.paths, args.baseline)
        columns = COLUMNS
    if not rows:
        raise SystemExit(f"no finished runs{' with profile traces' if args.step_profile else ''} under {args.paths}")
    count = max(r["world_size"] or 1 for r in rows)
    Results(args.bench or ("step_profile" if args.step_profile else "train"), args.out, link=args.link,
            count=count).write(rows, columns)
    if args.step_profile:
        for r in rows:
            print(f"{r['arm']} rank {r['rank']}: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in r["categories_ms"].items()))
    return None

if __name__ == "__main__":
    main()
