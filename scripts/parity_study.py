"""Run the bf16-vs-MXFP8 parity study's GPU arms side by side on one GPU, in time-boxed calls
that each continue where the last one stopped.

    python scripts/parity_study.py --dry-run                 # print the commands, start nothing
    python scripts/parity_study.py --deadline-s 500          # start or continue every arm
    python scripts/parity_study.py --study dsv3 --export DIR # one study; copy results to DIR

The arms (``ARMS``) are runs of ``recipes/parity_dsv3.yaml`` and ``recipes/parity_llama4.yaml``:

    dsv3:   bf16 seed 0, bf16 seed 1, mxfp8, mxfp8_all
    llama4: bf16, mxfp8_all

Each arm is one ``python launch/train.py +recipe=<recipe> a2a=<preset> training.seed=<seed>``
process (EP 1, one process, torch elastic picks a free rendezvous port) with its own run dir
``<out>/<study>/<arm>``; all of them share the GPU. A call starts every arm that has not
reached its last step: a new run, or ``training.resume=<run dir>`` when the run dir has a
checkpoint. ``--deadline-s`` after the call started, it sends SIGTERM to the arms still
running: they stop at the next step boundary, save a checkpoint and exit; ``--grace-s`` later
whatever is left is killed (the newest complete checkpoint stays). Then it prints where each
arm stands; once every arm of a study has finished, it writes that study's comparison
(``launch/compare_runs.py``) into ``<out>/<study>/``. ``--export DIR`` copies the small
files (summaries, console lines, configs, offline wandb runs, comparisons, launch logs) to
DIR; checkpoints stay where they are for the next call.

At EP 1 no token row crosses a wire. The MXFP8 arms therefore pass
``a2a.quantize_local_rows=true`` (every row goes through MXFP8 as if it crossed) and
``logging.numerics_every=50`` (the quantization telemetry); without the first the MXFP8 arms
would train exactly like bf16.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from launch.run_dir import CONSOLE_LOG, RUN_CONFIG, SUMMARY, checkpoint_steps  # noqa: E402
from launch.run_summary import RunSummary  # noqa: E402
from mxfp8_ep.config import A2AConfig  # noqa: E402

DEFAULT_OUT = REPO / "outputs" / "parity"
POLL_S = 5.0
# What the MXFP8 arms add at EP 1: every row through MXFP8, and the telemetry (bf16 legs have
# nothing to sample).
MXFP8_ARM_OPTIONS = ("a2a.quantize_local_rows=true", "logging.numerics_every=50")


@dataclass(frozen=True)
class Arm:
    study: str
    name: str
    recipe: str
    a2a: str
    seed: int

    def run_dir(self, out: Path) -> Path:
        return out / self.study / self.name


ARMS = (
    Arm("dsv3", "bf16_seed0", "parity_dsv3", "bf16", 0),
    Arm("dsv3", "bf16_seed1", "parity_dsv3", "bf16", 1),
    Arm("dsv3", "mxfp8", "parity_dsv3", "mxfp8", 0),
    Arm("dsv3", "mxfp8_all", "parity_dsv3", "mxfp8_all", 0),
    Arm("llama4", "bf16", "parity_llama4", "bf16", 0),
    Arm("llama4", "mxfp8_all", "parity_llama4", "mxfp8_all", 0),
)
STUDIES = tuple(dict.fromkeys(a.study for a in ARMS))


def study_options(arm: Arm) -> list[str]:
    return list(MXFP8_ARM_OPTIONS) if A2AConfig.preset(arm.a2a).any_quantized else []


def state(arm: Arm, out: Path) -> tuple[str, Optional[RunSummary]]:
    """"done", "resume" (has a checkpoint) or "new", and the run's summary if any."""
    run_dir = arm.run_dir(out)
    s = RunSummary.read(run_dir)
    if s is not None and s.stopped_by is None and s.steps >= s.target_steps > 0:
        return "done", s
    if checkpoint_steps(run_dir, "checkpoint"):
        return "resume", s
    return "new", s


def command(arm: Arm, out: Path, how: str, extra: list[str]) -> list[str]:
    where = (f"training.resume={arm.run_dir(out)}" if how == "resume"
             else f"hydra.run.dir={arm.run_dir(out)}")
    return [sys.executable, str(REPO / "launch" / "train.py"), f"+recipe={arm.recipe}",
            f"a2a={arm.a2a}", f"training.seed={arm.seed}", *study_options(arm), *extra, where]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "2")  # six processes share the host's cores
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run(arms: list[Arm], out: Path, deadline_s: float, grace_s: float, extra: list[str]) -> dict[str, int]:
    """Start the unfinished arms, stop them at the deadline; exit codes by arm name."""
    start = time.monotonic()
    procs: dict[Arm, subprocess.Popen] = {}
    for arm in arms:
        how, _ = state(arm, out)
        if how == "done":
            continue
        arm.run_dir(out).parent.mkdir(parents=True, exist_ok=True)
        log = open(arm.run_dir(out).parent / f"{arm.name}.launch.log", "a")
        cmd = command(arm, out, how, extra)
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        procs[arm] = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        print(f"[{time.monotonic() - start:5.0f}s] {arm.study}/{arm.name}: {how} (pid {procs[arm].pid})",
              flush=True)
    stopping_at: Optional[float] = None
    while any(p.poll() is None for p in procs.values()):
        now = time.monotonic() - start
        if stopping_at is None and now >= deadline_s:
            stopping_at = now
            print(f"[{now:5.0f}s] deadline: SIGTERM to the running arms (they checkpoint and exit)",
                  flush=True)
            _signal_all(procs, signal.SIGTERM)
        if stopping_at is not None and now >= stopping_at + grace_s:
            print(f"[{now:5.0f}s] still running after {grace_s:.0f}s: SIGKILL", flush=True)
            _signal_all(procs, signal.SIGKILL)
            break
        time.sleep(POLL_S)
    return {arm.name: p.wait() for arm, p in procs.items()}


def _signal_all(procs: dict[Arm, subprocess.Popen], sig: int) -> None:
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def report(arms: list[Arm], out: Path, codes: dict[str, int]) -> bool:
    """Print one line per arm; True when every arm is done."""
    all_done = True
    for arm in arms:
        how, s = state(arm, out)
        all_done &= how == "done"
        if s is None:
            line = "no summary yet"
        else:
            val = f", val loss {s.final_val_loss:.4f}" if s.final_val_loss is not None else ""
            line = (f"step {s.steps}/{s.target_steps}, loss {s.final_loss:.4f}{val}"
                    + (f", {s.step_time_s:.3f} s/step" if s.step_time_s else ""))
        code = codes.get(arm.name)
        ran = "" if code is None else f" (exit {code})"
        print(f"  {arm.study}/{arm.name:12s} {how if how == 'done' else 'unfinished'}: {line}{ran}")
        if code not in (None, 0, 128 + signal.SIGTERM, -signal.SIGKILL):
            log = arm.run_dir(out).parent / f"{arm.name}.launch.log"
            tail = log.read_text().splitlines()[-15:] if log.is_file() else []
            print("    " + "\n    ".join(tail))
    return all_done


def write_rows(study_dir: Path, study: str, out_dir: Path, **provenance) -> Path:
    """The study's result as rows (``benchmarks.rows``, bench ``parity``): one per arm, from the
    comparison ``launch/compare_runs.py`` wrote into ``study_dir``: final and validation losses,
    the validation curve, the verdict against the bf16 baseline, throughput and the worst layer
    of each numerics statistic. ``provenance``: ``ResultsFile``'s machine / command / versions."""
    import json

    from benchmarks.rows import ResultsFile

    comparison = json.loads((study_dir / "comparison.json").read_text())
    verdicts = {v["run"]: v for v in comparison["verdicts"]}
    results = ResultsFile("parity", out_dir, **provenance)
    for run in comparison["runs"]:
        verdict = verdicts.get(run["run_name"], {})
        results.write(
            study=study, model=run["model"], arm=run["a2a"], seed=run["seed"], ep=run["ep"],
            world_size=run["world_size"], device=run["device"], run_name=run["run_name"],
            steps=run["steps"], final_loss=run["final_loss"], final_val_loss=run["final_val_loss"],
            val_steps=run["val_logged_steps"], val_losses=run["val_losses"],
            baseline=verdict.get("baseline", run["run_name"]), val_loss_delta=verdict.get("delta"),
            bf16_seed_spread=verdict.get("seed_spread"), tolerance=verdict.get("tolerance"),
            within_tolerance=verdict.get("within"), verdict=verdict.get("text"),
            tokens_per_s=run["tokens_per_s"], step_time_s=run["step_time_s"],
            a2a_bytes_per_step=run["a2a_bytes_per_step"],
            numerics_worst={leg: {stat: v["value"] for stat, v in stats.items()}
                            for leg, stats in (run.get("numerics_worst") or {}).items()},
        )
    return results.path


def export(out: Path, dest: Path, studies: list[str]) -> None:
    """The small files of every arm and comparison, without checkpoints or worker logs."""
    keep = {SUMMARY, CONSOLE_LOG, RUN_CONFIG}
    for study in studies:
        src = out / study
        if not src.is_dir():
            continue
        for path in src.rglob("*"):
            rel = path.relative_to(out)
            parts = rel.parts
            wanted = (path.is_file() and (path.name in keep or path.name.startswith("comparison")
                                          or path.name.endswith(".launch.log")
                                          or (len(parts) > 3 and parts[2] == "wandb")))
            if wanted and "checkpoint" not in parts:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    print(f"exported to {dest}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default=",".join(STUDIES), help=f"comma-separated, of {list(STUDIES)}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="run dirs go under here")
    ap.add_argument("--deadline-s", type=float, default=510.0,
                    help="stop the running arms this long after the start (default 510)")
    ap.add_argument("--grace-s", type=float, default=60.0, help="then kill what is left this much later")
    ap.add_argument("--export", type=Path, default=None, help="copy the small result files here")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("overrides", nargs="*", help="extra train.py overrides for every arm "
                                                 "(e.g. training.steps=200 for a trial)")
    args = ap.parse_args(argv)
    studies = [s for s in args.study.split(",") if s]
    unknown = sorted(set(studies) - set(STUDIES))
    if unknown:
        print(f"parity_study: unknown study {unknown}; known: {list(STUDIES)}", file=sys.stderr)
        return 2
    arms = [a for a in ARMS if a.study in studies]
    out = args.out.resolve()
    if args.dry_run:
        for arm in arms:
            how, _ = state(arm, out)
            print(f"# {arm.study}/{arm.name}: {how}")
            if how != "done":
                print(" ".join(command(arm, out, how, args.overrides)))
        return 0
    codes = run(arms, out, args.deadline_s, args.grace_s, args.overrides)
    print("parity study:")
    report(arms, out, codes)
    for study in studies:
        mine = [a for a in arms if a.study == study]
        if all(state(a, out)[0] == "done" for a in mine):
            from launch.compare_runs import main as compare_main

            compare_main([str(out / study)])
            print(f"rows: {write_rows(out / study, study, args.export or out / study)}")
    if args.export is not None:
        export(out, args.export, studies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
