"""Run the bf16-vs-MXFP8 parity study's GPU arms side by side on one GPU, in time-boxed calls
that each continue where the last one stopped.

    python scripts/parity_study.py --dry-run                     # print the commands, start nothing
    python scripts/parity_study.py --deadline-s 500              # start or continue every arm
    python scripts/parity_study.py --study dsv3 --export DIR     # one study; copy results to DIR
    python scripts/parity_study.py --study dsv3_symm --parallel 3 --deadline-s 480
    python scripts/parity_study.py --study dsv3_symm --arms mxfp8_seed1,mxfp8_seed2   # some arms

The studies (``STUDIES``) and their arms (``ARMS``), runs of ``recipes/parity_dsv3.yaml`` and
``recipes/parity_llama4.yaml``:

    dsv3:      EP 1, every row quantized: bf16 seeds 0 and 1, mxfp8, mxfp8_all
    llama4:    EP 1, every row quantized: bf16, mxfp8_all
    dsv3_symm: EP 2 over the symm transport, the two ranks sharing the GPU
               (parallelism=ep2_shared_gpu): bf16 seeds 0, 1, 2, mxfp8_all seeds 0, 1, mxfp8
               seeds 0, 1, 2

Each arm is one ``python launch/train.py +recipe=<recipe> a2a=<preset> training.seed=<seed>``
(torch elastic picks a free rendezvous port) with its own run dir ``<out>/<study>/<arm>``; all of
them share the GPU. A call starts every arm that has not reached its last step, ``--parallel``
at a time (default: all at once; an arm counts once, however many processes it starts): a new
run, or ``training.resume=<run dir>`` when the run dir has a checkpoint (the recipe saves one
every 250 steps, and one when stopped). ``--deadline-s`` after the call started, it starts no
more arms and sends SIGTERM to those still running: they stop at the next step boundary, save
a checkpoint and exit; ``--grace-s`` later whatever is left is killed (the newest complete
checkpoint stays). The same command again continues.

Whenever an arm finishes, its study's comparison (``launch/compare_runs.py``, over the arms
finished so far) is written into ``<out>/<study>/`` and its rows (bench ``parity``) into
``--export DIR`` (else ``<out>/<study>/``), replacing the rows the study had there from the same
commit: a call cut short keeps the rows of every arm that finished. At the end it prints where
each arm stands. ``--export DIR`` also gets the small files (summaries, console lines, configs,
offline wandb runs, comparisons, launch logs); checkpoints stay where they are for the next call.

At EP 1 no token row crosses a wire. The MXFP8 arms of those studies therefore pass
``a2a.quantize_local_rows=true`` (every row goes through MXFP8 as if it crossed) and
``logging.numerics_every=50`` (the quantization telemetry); without the first they would train
exactly like bf16. The symm study's rows cross between the two ranks as on two GPUs (the rows
that stay are not quantized); each rank takes 4 of the 8 sequences of a step, so the global
batch, the schedule and the validation tokens are the EP 1 study's. Its throughput is no speed
figure (``RunSummary.gpu_shared``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from launch.run.run_dir import CONSOLE_LOG, RUN_CONFIG, SUMMARY, checkpoint_steps  # noqa: E402
from launch.run.run_summary import RunSummary  # noqa: E402
from mxfp8_ep.config import A2AConfig  # noqa: E402

DEFAULT_OUT = REPO / "outputs" / "parity"
POLL_S = 5.0
COMPARISON_TEXT = "comparison.txt"  # what compare_runs printed for a study's finished arms
NUMERICS = "logging.numerics_every=50"  # the quantization telemetry (bf16 legs have nothing to sample)
# What the MXFP8 arms add at EP 1: every row through MXFP8, and the telemetry.
EP1_MXFP8_OPTIONS = ("a2a.quantize_local_rows=true", NUMERICS)
# Every arm of the symm study: EP 2 on the one GPU over the symm transport, 4 sequences per rank
# (the EP 1 study's global batch of 8), its own experiment name (wandb group, output folder).
SYMM_EP2_OPTIONS = ("parallelism=ep2_shared_gpu", "a2a.transport=symm", "training.local_batch_size=4",
                    "experiment=parity_dsv3_symm")


@dataclass(frozen=True)
class Study:
    """A recipe, what each of its arms adds to it, and what the MXFP8 arms add on top."""

    name: str
    recipe: str
    options: tuple[str, ...] = ()
    mxfp8_options: tuple[str, ...] = ()


STUDIES = {s.name: s for s in (
    Study("dsv3", "parity_dsv3", mxfp8_options=EP1_MXFP8_OPTIONS),
    Study("llama4", "parity_llama4", mxfp8_options=EP1_MXFP8_OPTIONS),
    Study("dsv3_symm", "parity_dsv3", options=SYMM_EP2_OPTIONS, mxfp8_options=(NUMERICS,)),
)}


@dataclass(frozen=True)
class Arm:
    study: str
    name: str
    a2a: str
    seed: int

    @property
    def recipe(self) -> str:
        return STUDIES[self.study].recipe

    def run_dir(self, out: Path) -> Path:
        return out / self.study / self.name


ARMS = (
    Arm("dsv3", "bf16_seed0", "bf16", 0),
    Arm("dsv3", "bf16_seed1", "bf16", 1),
    Arm("dsv3", "mxfp8", "mxfp8", 0),
    Arm("dsv3", "mxfp8_all", "mxfp8_all", 0),
    Arm("llama4", "bf16", "bf16", 0),
    Arm("llama4", "mxfp8_all", "mxfp8_all", 0),
    Arm("dsv3_symm", "bf16_seed0", "bf16", 0),
    Arm("dsv3_symm", "bf16_seed1", "bf16", 1),
    Arm("dsv3_symm", "bf16_seed2", "bf16", 2),
    Arm("dsv3_symm", "mxfp8_all_seed0", "mxfp8_all", 0),
    Arm("dsv3_symm", "mxfp8_all_seed1", "mxfp8_all", 1),
    Arm("dsv3_symm", "mxfp8", "mxfp8", 0),
    Arm("dsv3_symm", "mxfp8_seed1", "mxfp8", 1),
    Arm("dsv3_symm", "mxfp8_seed2", "mxfp8", 2),
)


def study_options(arm: Arm) -> list[str]:
    study = STUDIES[arm.study]
    return list(study.options) + (list(study.mxfp8_options) if A2AConfig.preset(arm.a2a).any_quantized else [])


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


def _start(arm: Arm, out: Path, extra: list[str]) -> tuple[str, subprocess.Popen]:
    how, _ = state(arm, out)
    arm.run_dir(out).parent.mkdir(parents=True, exist_ok=True)
    log = open(arm.run_dir(out).parent / f"{arm.name}.launch.log", "a")
    cmd = command(arm, out, how, extra)
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return how, proc


def run(arms: list[Arm], out: Path, deadline_s: float, grace_s: float, extra: list[str],
        parallel: int = 0, on_done: Optional[Callable[[Arm], None]] = None) -> dict[Arm, int]:
    """Start the unfinished arms, ``parallel`` at a time (0: all), until the deadline; then stop
    those running. ``on_done(arm)`` after each arm that finished its last step. Exit codes by arm."""
    start = time.monotonic()
    waiting = [a for a in arms if state(a, out)[0] != "done"]
    limit = parallel or len(waiting) or 1
    procs: dict[Arm, subprocess.Popen] = {}
    codes: dict[Arm, int] = {}
    stopping_at: Optional[float] = None
    while waiting or procs:
        now = time.monotonic() - start
        for arm, p in list(procs.items()):
            if p.poll() is not None:
                codes[arm] = procs.pop(arm).returncode
                if state(arm, out)[0] == "done":
                    print(f"[{now:5.0f}s] {arm.study}/{arm.name}: done", flush=True)
                    if on_done is not None:
                        on_done(arm)
        if stopping_at is None and now >= deadline_s:
            stopping_at, waiting = now, []
            if procs:
                print(f"[{now:5.0f}s] deadline: SIGTERM to the running arms (they checkpoint and exit)", flush=True)
                _signal_all(procs, signal.SIGTERM)
        if stopping_at is not None and procs and now >= stopping_at + grace_s:
            print(f"[{now:5.0f}s] still running after {grace_s:.0f}s: SIGKILL", flush=True)
            _signal_all(procs, signal.SIGKILL)
            codes.update({arm: p.wait() for arm, p in procs.items()})
            break
        while waiting and len(procs) < limit:
            arm = waiting.pop(0)
            how, procs[arm] = _start(arm, out, extra)
            print(f"[{now:5.0f}s] {arm.study}/{arm.name}: {how} (pid {procs[arm].pid})", flush=True)
        if procs:
            time.sleep(POLL_S)
    return codes


def _signal_all(procs: dict[Arm, subprocess.Popen], sig: int) -> None:
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def report(arms: list[Arm], out: Path, codes: dict[Arm, int]) -> bool:
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
        code = codes.get(arm)
        ran = "" if code is None else f" (exit {code})"
        print(f"  {arm.study}/{arm.name:12s} {how if how == 'done' else 'unfinished'}: {line}{ran}")
        if code not in (None, 0, 128 + signal.SIGTERM, -signal.SIGKILL):
            log = arm.run_dir(out).parent / f"{arm.name}.launch.log"
            tail = log.read_text().splitlines()[-15:] if log.is_file() else []
            print("    " + "\n    ".join(tail))
    return all_done


def study_rows(out: Path, study: str, dest: Path, **provenance) -> Optional[Path]:
    """The comparison of the study's finished arms (``launch/compare_runs.py`` into
    ``<out>/<study>/``, its printout in ``comparison.txt``) and their rows in ``dest``
    (``write_rows``); None while no arm has finished."""
    done = [a for a in ARMS if a.study == study and state(a, out)[0] == "done"]
    if not done:
        return None
    from launch.tools.compare_runs import main as compare_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = compare_main([str(a.run_dir(out)) for a in done] + ["--out", str(out / study)])
    (out / study / COMPARISON_TEXT).write_text(printed.getvalue())
    if code:
        raise RuntimeError(f"compare_runs failed on {study} (exit {code}): {printed.getvalue()[-2000:]}")
    return write_rows(out / study, study, dest, **provenance)


def write_rows(study_dir: Path, study: str, out_dir: Path, **provenance) -> Path:
    """The study's result as rows (``benchmarks.rows``, bench ``parity``): one per arm, from the
    comparison ``launch/compare_runs.py`` wrote into ``study_dir``: final and validation losses,
    the validation curve, the verdict against the bf16 reference (``compare_runs.bf16_reference``),
    throughput (no speed figure: the arms share the GPU), the symm capacity replays, the worst
    layer of each numerics statistic, and the corpus trained on (its sha256 and Debian package
    versions). The rows replace those of the same study and commit in ``out_dir``.
    ``provenance``: ``ResultsFile``'s machine / command / versions."""
    from benchmarks.rows import ResultsFile

    comparison = json.loads((study_dir / "comparison.json").read_text())
    verdicts = {v["run"]: v for v in comparison["verdicts"]}
    results = ResultsFile("parity", out_dir, **provenance)
    drop_rows(out_dir, study, results.provenance["commit"])
    for run in comparison["runs"]:
        verdict = verdicts.get(run["run_name"], {})
        legs = run["a2a_legs"]
        results.write(
            study=study, model=run["model"], arm=run["a2a"], seed=run["seed"], ep=run["ep"],
            world_size=run["world_size"], device=run["device"], gpu_shared=run["gpu_shared"],
            transport=legs.get("transport"), run_name=run["run_name"],
            steps=run["steps"], final_loss=run["final_loss"], final_val_loss=run["final_val_loss"],
            val_steps=run["val_logged_steps"], val_losses=run["val_losses"],
            baseline=verdict.get("baseline", run["run_name"]), reference=verdict.get("reference"),
            val_loss_delta=verdict.get("delta"), bf16_seeds=verdict.get("bf16_seeds"),
            bf16_mean_val_loss=verdict.get("bf16_mean"), bf16_std_val_loss=verdict.get("bf16_std"),
            bf16_seed_spread=verdict.get("seed_spread"), tolerance=verdict.get("tolerance"),
            parity_rule=verdict.get("rule"), within_tolerance=verdict.get("within"), verdict=verdict.get("text"),
            tokens_per_s=run["tokens_per_s"], step_time_s=run["step_time_s"],
            a2a_bytes_per_step=run["a2a_bytes_per_step"], capacity_factor=legs.get("capacity_factor"),
            capacity_replays=run["capacity_replays"], capacity_replay_steps=run["capacity_replay_steps"],
            numerics_worst={leg: {stat: v["value"] for stat, v in stats.items()}
                            for leg, stats in (run.get("numerics_worst") or {}).items()},
            **corpus_of(Path(run["path"])),
        )
    return results.path


def drop_rows(out_dir: Path, study: str, commit: str) -> None:
    """Remove the rows of ``study`` measured on ``commit`` from the parity rows files in
    ``out_dir`` (a file left empty goes): a study's rows are written again as its arms finish."""
    for path in sorted(Path(out_dir).glob("*_parity.jsonl")):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines
                if not ((row := json.loads(line)).get("study") == study and row.get("commit") == commit)]
        if len(kept) == len(lines):
            continue
        if kept:
            path.write_text("".join(line + "\n" for line in kept))
        else:
            path.unlink()


def corpus_of(run_dir: Path) -> dict:
    """The corpus a run trained on, as its rows record it (``launch.titan.data.corpus_provenance``),
    from the run's ``train_config.yaml``: nothing known without it or for other datasets."""
    from omegaconf import DictConfig, OmegaConf

    from launch.titan.data import CORPUS_DATASET, corpus_provenance, data_source

    config = run_dir / RUN_CONFIG
    cfg = OmegaConf.load(config) if config.is_file() else None
    training = cfg.get("training") if isinstance(cfg, DictConfig) else None
    if training is None or training.get("dataset") != CORPUS_DATASET:
        return {"corpus_sha256": None, "corpus_packages": None}
    return corpus_provenance(data_source(CORPUS_DATASET, training.get("dataset_path"), None).path)


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
    ap.add_argument("--arms", default="", help="comma-separated arm names of the studies (default: all), "
                                               "e.g. mxfp8_seed1,mxfp8_seed2")
    ap.add_argument("--parallel", type=int, default=0,
                    help="at most this many arms at once, the next starting as one ends (default 0: all)")
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
    if args.parallel < 0:
        print(f"parity_study: --parallel {args.parallel}: 0 (every arm at once) or the most arms at once",
              file=sys.stderr)
        return 2
    arms = [a for a in ARMS if a.study in studies]
    named = [n for n in args.arms.split(",") if n]
    if set(named) - {a.name for a in arms}:
        print(f"parity_study: unknown arm {sorted(set(named) - {a.name for a in arms})} of {studies}; known: "
              f"{sorted({a.name for a in arms})}", file=sys.stderr)
        return 2
    arms = [a for a in arms if not named or a.name in named]
    out = args.out.resolve()
    if args.dry_run:
        for arm in arms:
            how, _ = state(arm, out)
            print(f"# {arm.study}/{arm.name}: {how}")
            if how != "done":
                print(" ".join(command(arm, out, how, args.overrides)))
        return 0
    def rows_of(study: str) -> None:
        path = study_rows(out, study, args.export or out / study)
        if path is not None:
            done = sum(state(a, out)[0] == "done" for a in arms if a.study == study)
            print(f"  rows of {study} ({done} of {sum(a.study == study for a in arms)} arms): {path}", flush=True)

    codes = run(arms, out, args.deadline_s, args.grace_s, args.overrides, args.parallel,
                on_done=lambda arm: rows_of(arm.study))
    print("parity study:")
    report(arms, out, codes)
    for study in studies:
        rows_of(study)
        if all(state(a, out)[0] == "done" for a in arms if a.study == study):
            print(f"\n{study}:\n" + (out / study / COMPARISON_TEXT).read_text())
    if args.export is not None:
        export(out, args.export, studies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
