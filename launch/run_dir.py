"""What a run dir holds, and the lookups on it.

A run dir (``hydra.run.dir``, one per sweep point under ``hydra.sweep.dir``) collects what a
run writes: ``train_config.yaml`` (the composed config the workers got), ``console.log`` (the
console lines of rank 0), ``summary.json`` (``launch.run_summary.RunSummary``), ``train.log``
(the launching process's log), ``worker_logs/`` (local) or ``slurm/`` (SLURM) with every
process's full output, ``wandb/`` and the torchtitan checkpoints. Its folder name says what
the run trains (:func:`run_name`); ``training.resume=<run dir>`` continues it (launch/resume.py).
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Iterable, Optional

RUN_CONFIG = "train_config.yaml"
CONSOLE_LOG = "console.log"
SUMMARY = "summary.json"
WORKER_LOGS = "worker_logs"

_STEP_DIR = re.compile(r"step-(\d+)$")

# Override keys (and the groups / fields under them) that say where and how a run is launched,
# logged, checked or resumed, not what it trains: run names and folder names leave them out.
NOT_IN_RUN_NAME = ("launcher", "logging", "validate", "hydra", "recipe", "experiment",
                   "training.resume")
# Longest run name a folder gets (file names stop at 255 bytes; the prefix adds a time stamp).
_MAX_FOLDER_NAME = 180


def run_name(overrides: Iterable[str], a2a: str, for_path: bool = False) -> str:
    """What a run trains, from its command-line overrides: ``a2a=mxfp8,training.steps=50``.

    The overrides of :data:`NOT_IN_RUN_NAME` are left out; the a2a preset is always named so
    the runs of a comparison tell themselves apart. ``for_path``: a folder name (``/`` in values
    becomes ``_``; cut to a length file systems take)."""
    kept = []
    for o in overrides:
        key = str(o).lstrip("+~").split("=", 1)[0]
        if not any(key == k or key.startswith(k + ".") for k in NOT_IN_RUN_NAME):
            kept.append(str(o))
    kept.sort()
    if not any(o.lstrip("+").startswith("a2a=") for o in kept):
        kept.insert(0, f"a2a={a2a}")
    name = ",".join(kept)
    if for_path:
        name = name.replace("/", "_")[:_MAX_FOLDER_NAME]
    return name


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


def free_folder(base: str, name: str) -> str:
    """``<base>/<name>``, or with the first suffix ``_2``, ``_3``, ... that no folder has."""
    path, n = f"{base}/{name}", 1
    while Path(path).exists():
        n += 1
        path = f"{base}/{name}_{n}"
    return path


def claim_run_config(run_dir: str | Path, text: str, new_run: bool) -> None:
    """Write the run's config. A new run creates it exclusively: of two launches racing into
    one folder, the second gets ``FileExistsError`` instead of overwriting the first's run."""
    with (Path(run_dir) / RUN_CONFIG).open("x" if new_run else "w") as f:
        f.write(text)


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

    previous = Path(run_dir) / RUN_CONFIG
    if previous.is_file():
        logging = OmegaConf.load(previous).get("logging", {})
        if logging.get("run_id"):
            return str(logging.run_id), logging.get("run_name")
    return uuid.uuid4().hex[:8], None
