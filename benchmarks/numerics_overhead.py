"""What the numerics telemetry costs a training step: the recipe's step time with
``logging.numerics_every=N`` against the same run with it off.

    python -m benchmarks.numerics_overhead --every 50 --repeats 2 --out benchmarks/results/numerics -- \\
        model=dsv3_debugmodel parallelism=single a2a=mxfp8_all a2a.quantize_local_rows=true \\
        training.steps=300 training.seq_len=2048 training.local_batch_size=8 logging=none

Each arm is a whole ``launch/train.py`` run with the given overrides (the telemetry off, then on,
``--repeats`` times in turn, so that drift of the machine reaches both arms alike). The step
time is the run's own headline number (``summary.json``: the mean over its logged windows
after the first), over every step: the sampled steps, with their quantizing and the sums over
ranks, and the steps between them, which do no telemetry work. One row per run and one row
comparing the arms (``overhead_pct``: mean step time on / off - 1), through
``benchmarks.rows.ResultsFile``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.rows import ResultsFile, this_machine
from launch.run_summary import RunSummary

REPO = Path(__file__).resolve().parents[1]

BENCH = "numerics_overhead"


def run_arm(overrides: list[str], every: int, run_dir: Path) -> RunSummary:
    """One recipe run with ``logging.numerics_every=every``; its summary."""
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), *overrides,
           f"logging.numerics_every={every}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    (run_dir / "benchmark_console.txt").write_text(proc.stdout + proc.stderr)
    summary = RunSummary.read(run_dir)
    if proc.returncode != 0 or summary is None or summary.step_time_s is None:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=50, help="logging.numerics_every of the arm with the telemetry")
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm, taken in turn (off, on, off, on, ...)")
    parser.add_argument("--out", default="benchmarks/results/numerics", help="folder of the results file and runs")
    parser.add_argument("overrides", nargs="*", help="launch/train.py overrides (after --)")
    args = parser.parse_args(argv)
    if args.every <= 0:
        parser.error("--every must be > 0 (the arm with the telemetry)")
    out = Path(args.out).resolve()
    runs = out / "runs" / time.strftime("%Y-%m-%d_%H-%M-%S")  # a fresh folder per call: runs are never reused
    results = None
    times: dict[int, list[float]] = {0: [], args.every: []}
    for repeat in range(args.repeats):
        for every in (0, args.every):
            s = run_arm(args.overrides, every, runs / f"numerics_every_{every}_{repeat}")
            if results is None:
                results = ResultsFile(BENCH, out, machine=this_machine(count=s.world_size))
            times[every].append(s.step_time_s)
            results.write(arm="off" if every == 0 else "on", numerics_every=every, repeat=repeat,
                          overrides=args.overrides, steps=s.steps, step_time_s=s.step_time_s,
                          tokens_per_s=s.tokens_per_s, final_loss=s.final_loss, run_dir=s.run_dir)
    off, on = statistics.mean(times[0]), statistics.mean(times[args.every])
    row = results.write(arm="on_vs_off", numerics_every=args.every, repeats=args.repeats, overrides=args.overrides,
                        step_time_s_off=off, step_time_s_on=on, overhead_pct=100 * (on / off - 1),
                        step_times_off=times[0], step_times_on=times[args.every])
    print(f"numerics_every={args.every}: step {on:.4f}s vs {off:.4f}s off, overhead {row['overhead_pct']:+.2f}% "
          f"({results.path})")
    return row


if __name__ == "__main__":
    main()
