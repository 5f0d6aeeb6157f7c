"""What a run dir holds, and the lookups on it.

A run dir (``hydra.run.dir``, one per sweep point under ``hydra.sweep.dir``) collects what a
run writes: ``train_config.yaml`` (the composed config the workers of its first launch got) and
Hydra's ``.hydra/``, ``console.log`` (the console lines of rank 0, every launch's),
``summary.json`` (``launch.run.run_summary.RunSummary``), ``stack.json`` (the torchtitan, torch
and triton versions it trains with: ``launch.config.stack``), ``train.log`` (the launching process's
log), ``worker_logs/`` (local) or ``slurm/`` (SLURM) with every process's full output,
``wandb/`` and the torchtitan checkpoints. ``training.resume=<run dir>`` continues it
(launch/run/resume.py); each resume adds ``resumes/<n>/`` with its own ``train_config.yaml`` and
``.hydra/`` (its command line in ``overrides.yaml``), and a line to ``console.log`` that
separates its lines from the earlier launches'. While a launch trains it, ``.training`` names
the launch (``launch.run.run_lock``). Its folder name says what the run trains
(:func:`folder_name`).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

RUN_CONFIG = "train_config.yaml"
CONSOLE_LOG = "console.log"
SUMMARY = "summary.json"
# Each training step's routing loads per MoE layer and EP degree (launch.titan.routing_telemetry).
ROUTING_LOG = "routing.jsonl"
STACK = "stack.json"
WORKER_LOGS = "worker_logs"
# resumes/<n>/: the config and command line of the n-th resume of the run.
RESUMES = "resumes"

_STEP_DIR = re.compile(r"step-(\d+)$")

# Override keys (and the groups / fields under them) that say where and how a run is launched,
# logged, checked or resumed, not what it trains: run names and folder names leave them out.
NOT_IN_RUN_NAME = ("launcher", "logging", "validate", "hydra", "recipe", "experiment",
                   "training.resume")
# Overrides that say how long a run trains, where its data and checkpoints are, or how often it
# measures or saves: a folder name holds them only as a hash (a resume may change the steps, and
# paths make long, mangled names).
NOT_NAMING = ("training.steps", "training.lr_schedule_steps", "training.checkpoint_enable",
              "training.checkpoint_interval", "training.checkpoint_folder", "training.checkpoint_keep",
              "training.dataset_path", "training.tokenizer_path", "training.val_every",
              "training.val_batches", "training.profile_freq")
# Longest folder name before the hash of the rest (the prefix adds a time stamp).
_MAX_NAMED = 120
_HASH_LEN = 6


def override_key(override: str) -> str:
    """``training.steps`` of ``training.steps=5`` (also of ``+...`` and ``~...``)."""
    return str(override).lstrip("+~").split("=", 1)[0]


def key_under(key: str, prefixes: Iterable[str]) -> bool:
    """Whether ``key`` is one of ``prefixes`` or a field under one (``a2a.kernel`` under ``a2a``)."""
    return any(key == k or key.startswith(k + ".") for k in prefixes)


def _kept(overrides: Iterable[str], a2a: str) -> list[str]:
    """The overrides that say what a run trains, sorted, the a2a preset always among them."""
    kept = sorted(str(o) for o in overrides if not key_under(override_key(o), NOT_IN_RUN_NAME))
    if not any(o.lstrip("+").startswith("a2a=") for o in kept):
        kept.insert(0, f"a2a={a2a}")
    return kept


def run_name(overrides: Iterable[str], a2a: str) -> str:
    """What a run trains, from its command-line overrides: ``a2a=mxfp8,training.steps=50``
    (the wandb run name). The overrides of :data:`NOT_IN_RUN_NAME` are left out; the a2a
    preset is always named so the runs of a comparison tell themselves apart."""
    return ",".join(_kept(overrides, a2a))


def folder_name(overrides: Iterable[str], a2a: str) -> str:
    """A run's folder name: the overrides of :func:`run_name` that name the experiment
    (``a2a=mxfp8,model=tiny_dsv3``; group options first), up to :data:`_MAX_NAMED` characters, then
    ``others=<hash>`` of the rest (:data:`NOT_NAMING`, and what did not fit) when there is any.
    ``/`` in values becomes ``_``."""
    named: list[str] = []
    rest: list[str] = []
    groups_first = sorted(_kept(overrides, a2a), key=lambda o: "." in override_key(o))
    for o in groups_first:
        fits = len(",".join(named + [o])) <= _MAX_NAMED
        (named if fits and not key_under(override_key(o), NOT_NAMING) else rest).append(o)
    if rest:
        named.append(f"others={hashlib.sha1(','.join(rest).encode()).hexdigest()[:_HASH_LEN]}")
    return ",".join(named).replace("/", "_")


def checkpoint_steps(run_dir: str | Path, checkpoint_folder: str) -> list[int]:
    """Steps of the complete torchtitan checkpoints in ``run_dir`` (DCP writes ``.metadata``
    last), oldest first."""
    folder = Path(run_dir) / checkpoint_folder
    steps = []
    for d in folder.glob("step-*"):
        m = _STEP_DIR.search(d.name)
        if m and (d / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def incomplete_checkpoint(step_dir: str | Path) -> Path:
    """Where the checkpoint of ``<folder>/step-<N>`` is written before it is whole:
    ``<folder>/.step<N>.incomplete``, a name torchtitan's search for ``step-<N>`` does not find."""
    step_dir = Path(step_dir)
    return step_dir.parent / f".{step_dir.name.replace('-', '')}.incomplete"


def remove_incomplete_checkpoints(run_dir: str | Path, checkpoint_folder: str) -> list[str]:
    """Remove what a checkpoint write cut short left in the run's checkpoint folder (a
    ``.step<N>.incomplete`` folder, a ``step-<N>`` without DCP's ``.metadata``); the names removed."""
    folder = Path(run_dir) / checkpoint_folder
    removed = []
    for d in sorted(folder.glob("*")) if folder.is_dir() else ():
        cut_short = d.name.endswith(".incomplete") or (_STEP_DIR.search(d.name) and not (d / ".metadata").is_file())
        if d.is_dir() and cut_short:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def trained_nothing(run_dir: str | Path, steps: Optional[int], checkpoint_folder: str) -> bool:
    """Whether the launch in ``run_dir`` trained no step: its summary says so (``steps``), or,
    without one, its ``console.log`` has no step line and there is no checkpoint."""
    if steps is not None:
        return steps == 0
    try:
        lines = (Path(run_dir) / CONSOLE_LOG).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    return not any(line.startswith("step ") for line in lines) and not checkpoint_steps(run_dir, checkpoint_folder)


def free_folder(base: str, name: str) -> str:
    """``<base>/<name>``, or with the first suffix ``_2``, ``_3``, ... that no folder has."""
    path, n = f"{base}/{name}", 1
    while Path(path).exists():
        n += 1
        path = f"{base}/{name}_{n}"
    return path


def claim_run_config(run_dir: str | Path, text: str, resume: Optional[int] = None) -> None:
    """Write the config of this launch: the run's ``train_config.yaml`` for a new run, the
    ``resumes/<resume>/`` one for a resume. Created exclusively: of two launches racing into one
    folder, the second gets ``FileExistsError`` instead of overwriting the first's config."""
    folder = Path(run_dir) if resume is None else resume_folder(run_dir, resume)
    with (folder / RUN_CONFIG).open("x") as f:
        f.write(text)


def resume_folder(run_dir: str | Path, resume: int) -> Path:
    return Path(run_dir) / RESUMES / str(resume)


def _resumes(run_dir: str | Path) -> list[int]:
    folder = Path(run_dir) / RESUMES
    return sorted(int(d.name) for d in folder.glob("*") if d.name.isdigit()) if folder.is_dir() else []


def claim_resume(run_dir: str | Path) -> int:
    """The number of a new resume of the run in ``run_dir`` (1 for the first), its folder
    made: two resumes racing get different numbers."""
    while True:
        number = (_resumes(run_dir) or [0])[-1] + 1
        try:
            resume_folder(run_dir, number).mkdir(parents=True)
            return number
        except FileExistsError:
            continue


def latest_run_config(run_dir: str | Path) -> Path:
    """The config the run's newest launch ran with: its newest resume's, else the first
    launch's ``train_config.yaml``."""
    for number in reversed(_resumes(run_dir)):
        path = resume_folder(run_dir, number) / RUN_CONFIG
        if path.is_file():
            return path
    return Path(run_dir) / RUN_CONFIG


def resolve_run_dir(base: str, new: str, resume: Optional[str], checkpoint_folder: str) -> str:
    """``hydra.run.dir`` for ``training.resume``: None -> ``<base>/<new>`` (a new run);
    "auto" -> the run under ``base`` with the newest checkpoint (a new run when none has
    one); anything else is the run dir to continue. A new run whose folder name is taken (a
    launch in the same second with the same overrides) gets ``<new>_2``, ``<new>_3``, ..."""
    if resume is None:
        return free_folder(base, new)
    if resume != "auto":
        return resume
    runs = [d for d in Path(base).glob("*")
            if (d / RUN_CONFIG).is_file() and checkpoint_steps(d, checkpoint_folder)]
    if not runs:
        return free_folder(base, new)

    def newest_checkpoint_time(d: Path) -> float:
        step = checkpoint_steps(d, checkpoint_folder)[-1]
        return (d / checkpoint_folder / f"step-{step}" / ".metadata").stat().st_mtime

    return str(max(runs, key=newest_checkpoint_time))


def earlier_logging(run_dir: str | Path) -> tuple[str, Optional[str]]:
    """The wandb run id and run name of the run in ``run_dir``: the ones its earlier launch
    recorded in ``train_config.yaml`` (so a resumed run continues the same wandb run), else a
    new id and no name."""
    from omegaconf import OmegaConf

    previous = latest_run_config(run_dir)
    if previous.is_file():
        logging = OmegaConf.load(previous).get("logging", {})
        if logging.get("run_id"):
            return str(logging.run_id), logging.get("run_name")
    return uuid.uuid4().hex[:8], None


@dataclass(frozen=True)
class RunDirBefore:
    """What a run dir held before a launch, so that a launch refused before anything started
    (say, by sbatch) takes back what it added: a folder it made, files and folders that were
    not there (two levels deep: ``slurm/<file>``, ``resumes/<n>``), lines appended to logs."""

    run_dir: Path
    existed: bool
    entries: frozenset[str] = frozenset()
    sizes: tuple[tuple[str, int], ...] = ()
    # A folder the launch did not make: the run dir's nearest ancestor that existed.
    kept_ancestor: Optional[Path] = None

    @classmethod
    def take(cls, run_dir: str | Path) -> "RunDirBefore":
        d = Path(run_dir).absolute()
        if not d.is_dir():
            return cls(d, existed=False, kept_ancestor=next(p for p in d.parents if p.is_dir()))
        entries = {p.relative_to(d).as_posix() for top in d.iterdir()
                   for p in ([top, *top.iterdir()] if top.is_dir() else [top])}
        sizes = tuple((p.name, p.stat().st_size) for p in d.iterdir() if p.is_file())
        return cls(d, True, frozenset(entries), sizes)

    def restore(self) -> None:
        if not self.existed:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            for parent in self.run_dir.parents:  # outputs/<experiment>/ when the launch made them
                if parent == self.kept_ancestor or any(parent.iterdir()):
                    break
                parent.rmdir()
            return
        for rel in sorted(RunDirBefore.take(self.run_dir).entries - self.entries):
            parent = Path(rel).parent.as_posix()
            if parent == "." or parent in self.entries:  # new at a level that was there
                path = self.run_dir / rel
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        for name, size in self.sizes:
            path = self.run_dir / name
            if path.is_file() and path.stat().st_size > size:
                with path.open("r+b") as f:
                    f.truncate(size)
