"""``training.resume``: which run continues, with which config, and what stops it.

* ``training.resume=<run dir>`` continues that run: the config its newest launch ran with
  (``launch.run.run_dir.latest_run_config``) with the overrides of the same command line on top
  (listed in one line), from its newest complete checkpoint, in its folder and its wandb run.
  A path that is not a run, or a run without a checkpoint, is refused before anything starts;
  so is a command line that changes what the run measures (only :data:`RESUMABLE` may change),
  and a run that trained on another torchtitan release than this environment's (its
  ``stack.json``: the checkpoints hold that release's model and optimizer state).
* ``training.resume=auto`` does the same with the newest run of the experiment that has a
  checkpoint, or says that it starts a new run.
* Without ``training.resume``, a run dir that already holds a run is refused: launching into it
  would overwrite it.

Everything here runs before Hydra creates the run dir (``launch.preflight.callbacks.PrepareRun``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from launch.config.problems import ConfigError
from launch.config.schema import config_from_yaml
from launch.config.stack import INSTALL, Stack, StackError, installed_torchtitan
from launch.run.run_dir import RUN_CONFIG, STACK, checkpoint_steps, key_under, latest_run_config, override_key

AUTO = "auto"
# Groups whose option a command line may change as a whole (``a2a=mxfp8``).
GROUPS = ("model", "parallelism", "a2a", "launcher", "logging")
# What a resume may change (keys, and the groups and fields under them): how long the run
# trains, how often it saves, profiles and validates, where it runs and how it is logged and
# checked. Anything else (the a2a legs, the parallel layout, the model, batch, data, optimizer,
# seed) would change what the run measures part way through; that is a new run.
RESUMABLE = ("training.steps", "training.lr_schedule_steps", "training.checkpoint_interval",
             "training.checkpoint_keep", "training.val_every", "training.profile_freq",
             "launcher", "logging", "validate")
# What must stay as it was, with the reason its message gives.
FIXED = {
    "training.checkpoint_folder": "its checkpoints are there",
    "logging.run_id": "it continues in its own wandb run",
}
# What a new logging group (logging=none) keeps unless set on the command line: the wandb run.
KEPT = ("logging.run_id", "logging.run_name")


@dataclass
class Resume:
    """What ``training.resume=<asked>`` continues: ``step`` None means a new run."""

    run_dir: str
    asked: str
    step: Optional[int] = None
    # "key=value" of what the command line changed in the saved config.
    changed: list[str] = field(default_factory=list)
    # Which resume of the run this is (1 for the first; launch.run.run_dir.claim_resume), once known.
    number: Optional[int] = None
    # What the resume keeps or changes that the command line does not show (the schedule).
    notes: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        """The one line that says what ``training.resume=<asked>`` does."""
        asked = self.asked
        if self.step is None:
            return (f"[mxfp8ep] training.resume=auto: no run of this experiment has a checkpoint; "
                    f"starting a new run in {self.run_dir}")
        how = "training.resume=auto: resuming" if asked == AUTO else "resuming"
        changed = (f"; changed on the command line: {' '.join(self.changed)}" if self.changed
                   else "; nothing changed on the command line")
        notes = "".join(f"; {note}" for note in self.notes)
        return (f"[mxfp8ep] {how} {self.run_dir} from step {self.step} (its newest checkpoint) "
                f"with its saved config{changed}{notes}")


def _checkpoints(run_dir: Path, checkpoint_folder: str) -> tuple[DictConfig, list[int]]:
    """The run's newest config and the steps of its complete checkpoints."""
    saved = OmegaConf.load(latest_run_config(run_dir))
    folder = OmegaConf.select(saved, "training.checkpoint_folder", default=checkpoint_folder)
    return saved, checkpoint_steps(run_dir, folder)


def check_new_run_dir(run_dir: str, checkpoint_folder: str) -> None:
    """A run without ``training.resume`` must not land in a folder that holds a run."""
    if not (Path(run_dir) / RUN_CONFIG).is_file():
        return
    _, steps = _checkpoints(Path(run_dir), checkpoint_folder)
    instead = (f"Continue it with training.resume={run_dir}, or choose" if steps else
               "It has no complete checkpoint to continue from either: choose")
    raise ConfigError([
        f"hydra.run.dir={run_dir} already holds a run ({RUN_CONFIG}); launching into it would "
        f"overwrite it. {instead} a new hydra.run.dir (or leave it out: each run gets its own "
        f"folder)"])


def check_resumable(asked: str, run_dir: str, checkpoint_folder: str) -> Optional[int]:
    """The step ``run_dir`` resumes from; None when ``training.resume=auto`` found nothing.
    Raises :class:`ConfigError` when the folder cannot be resumed, saying what to do."""
    d = Path(run_dir)
    if asked == AUTO and not d.exists():
        return None
    if not d.exists():
        raise ConfigError([f"training.resume={asked}: no such folder. Give the folder of a run "
                           f"(outputs/<experiment>/<time>_..., printed as 'run dir'), or "
                           f"training.resume=auto for the newest run with a checkpoint"])
    if not d.is_dir() or not (d / RUN_CONFIG).is_file():
        raise ConfigError([f"training.resume={asked}: not a run folder (it has no {RUN_CONFIG}). "
                           f"Give the folder of a run (printed as 'run dir'), or "
                           f"training.resume=auto for the newest run with a checkpoint"])
    saved, steps = _checkpoints(d, checkpoint_folder)
    if steps:
        _check_same_stack(asked, d)
        return steps[-1]
    if asked == AUTO:
        return None
    why = ("it ran with training.checkpoint_enable=false"
           if not OmegaConf.select(saved, "training.checkpoint_enable", default=False)
           else "it stopped before its first checkpoint was complete")
    raise ConfigError([f"training.resume={asked}: the run has no complete checkpoint to resume "
                       f"from ({why}). Start a new run (without training.resume), with "
                       f"training.checkpoint_enable=true to be able to resume it"])


def resumed_config(composed: DictConfig, overrides: list[str], run_dir: str, step: int,
                   compose: Callable[[list[str]], DictConfig]) -> tuple[DictConfig, Resume]:
    """The config of the run's newest launch with the command line's ``overrides`` on top.

    ``composed`` is what Hydra composed from ``conf/`` and ``overrides``: a key override takes
    its value from there, a group override (``a2a=mxfp8``) the whole group, and any other
    (``+recipe=...``) every value it changes from the plain defaults (``compose(overrides)``
    composes ``conf/`` with a list of overrides). The wandb run id and name stay the run's."""
    saved = config_from_yaml(latest_run_config(run_dir).read_text())
    result = copy.deepcopy(saved)
    paths: list[str] = []
    problems: list[str] = []
    plain: Optional[DictConfig] = None
    for o in overrides:
        key = override_key(o)
        if key in ("training.resume", "hydra") or key.startswith("hydra."):
            continue
        if o.startswith("~"):
            problems.append(f"{o}: deleting a key is not possible when resuming a run")
        elif key in GROUPS and _same_option(composed, saved, key):
            continue  # the run's own option (launcher=slurm of a SLURM run): its fields stay the run's
        elif key in GROUPS or OmegaConf.select(composed, key, default=_ABSENT) is not _ABSENT:
            paths.append(key)
        else:  # a group with a global package (+recipe=...): what it changes from the defaults
            plain = plain if plain is not None else compose([])
            paths += _differences(plain, compose([o]))
    changed = []
    for key in dict.fromkeys(paths):
        new = OmegaConf.select(composed, key)
        if _plain(new) != _plain(OmegaConf.select(saved, key, default=None)):
            OmegaConf.update(result, key, copy.deepcopy(new), merge=False, force_add=True)
    for key in KEPT:
        if key not in paths:
            OmegaConf.update(result, key, OmegaConf.select(saved, key), merge=False)
    notes, schedule_problem = _keep_schedule(saved, result, SCHEDULE in paths)
    for key in dict.fromkeys(paths):
        new, old = OmegaConf.select(result, key), OmegaConf.select(saved, key, default=None)
        if _plain(new) != _plain(old):
            changed.append(_shown(key, new, old))
    for key, why in FIXED.items():
        before, after = _plain(OmegaConf.select(saved, key)), _plain(OmegaConf.select(result, key))
        if before != after:
            problems.append(f"{_shown(key, OmegaConf.select(result, key), OmegaConf.select(saved, key))}"
                            f": a resumed run keeps {key} as it was ({why}); to train something "
                            f"else, start a new run")
    measured = _changes_what_it_measures(saved, result)
    if measured:
        problems.append(f"training.resume={run_dir}: a resumed run keeps what it measures, but the "
                        f"command line changes {', '.join(measured)}; start a new run for that "
                        f"(a resume may change {', '.join(RESUMABLE)})")
    steps = result.training.steps
    if steps <= step:
        schedule = result.training.lr_schedule_steps
        also = (f" and {SCHEDULE}=<as many> (its learning-rate schedule ends at step {schedule})"
                if schedule <= step else "")
        problems.append(f"the run in {run_dir} has trained {step} of training.steps={steps}: "
                        f"nothing left to train. Add training.steps=<more than {step}>{also} to train "
                        f"it further")
        schedule_problem = []
    problems += schedule_problem
    if not result.training.checkpoint_enable:
        problems.append("training.checkpoint_enable=false: a resumed run loads its checkpoint; "
                        "leave training.checkpoint_enable as the run had it (true)")
    if problems:
        raise ConfigError(problems)
    result.training.resume = composed.training.resume
    return result, Resume(run_dir, str(composed.training.resume), step, changed, notes=notes)


SCHEDULE = "training.lr_schedule_steps"


def _keep_schedule(saved: DictConfig, result: DictConfig, given: bool) -> tuple[list[str], list[str]]:
    """The resumed run's learning-rate schedule: the length its first launch fixed (a run saved
    without one ran ``training.steps`` of its own), unless the command line gives another.
    Returns the note the resume line adds and the problem when the run would train past it."""
    t = result.training
    if not given:
        t.lr_schedule_steps = saved.training.lr_schedule_steps or saved.training.steps
    if t.steps > t.lr_schedule_steps:
        return [], [f"training.steps={t.steps} goes past the run's learning-rate schedule of "
                    f"{t.lr_schedule_steps} steps ({SCHEDULE}, fixed at its first launch): after step "
                    f"{t.lr_schedule_steps} the learning rate would be 0. To train on, give the schedule "
                    f"that length too: {SCHEDULE}={t.steps} (the learning rate then follows the longer "
                    f"schedule from the step it resumes at)"]
    was = saved.training.lr_schedule_steps or saved.training.steps
    if given and t.lr_schedule_steps != was:
        return [f"the learning-rate schedule spans {t.lr_schedule_steps} steps (was {was})"], []
    if t.steps != saved.training.steps:
        return [f"the learning-rate schedule keeps its {t.lr_schedule_steps} steps ({SCHEDULE}=<n> "
                f"changes it)"], []
    return [], []


_ABSENT = object()


def _same_option(composed: DictConfig, saved: DictConfig, group: str) -> bool:
    return OmegaConf.select(composed, f"{group}.name") == OmegaConf.select(saved, f"{group}.name", default=None)


# Groups whose fields a resume may change: the command line composes them on the run's own option.
RUN_OPTION_GROUPS = ("launcher", "logging")


def with_the_runs_options(args: list[str], conf: Path) -> list[str]:
    """``args`` (a command line) with ``launcher=<the run's>`` (``logging=<the run's>``) added
    when it resumes a run (``training.resume=<run dir>``) and sets a field of that group without
    picking its option: Hydra then composes ``launcher.wait=true`` on the run's launcher (say
    slurm), not on the default (local, which has no such field). :func:`resumed_config` keeps
    the run's fields of an option it already has. ``conf``: the config folder (an option must
    be one of its files)."""
    asked = next((a.split("=", 1)[1].strip("'\"") for a in args if a.split("=", 1)[0] == "training.resume"), None)
    if asked in (None, AUTO, "null") or not (Path(asked) / RUN_CONFIG).is_file():
        return args
    saved = OmegaConf.load(latest_run_config(asked))
    keys = {override_key(a) for a in args if not a.startswith("-")}
    added = []
    for group in RUN_OPTION_GROUPS:
        option = OmegaConf.select(saved, f"{group}.name", default=None)
        sets_a_field = any(k.startswith(f"{group}.") for k in keys)
        if sets_a_field and group not in keys and option and (conf / group / f"{option}.yaml").is_file():
            added.append(f"{group}={option}")
    return args + added


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _shown(key: str, new: Any, old: Any) -> str:
    """``a2a=mxfp8`` for a group whose option changed, else ``key=value``."""
    if key in GROUPS and OmegaConf.is_config(new) and new.get("name") != (old or {}).get("name"):
        return f"{key}={new.name}"
    value = _plain(new)
    return f"{key}={'null' if value is None else str(value).lower() if isinstance(value, bool) else value}"


def _changes_what_it_measures(saved: DictConfig, result: DictConfig) -> list[str]:
    """``key=new (was old)`` for each change outside :data:`RESUMABLE` (a group whose option
    changed as one: ``a2a=mxfp8 (was bf16)``). Keys with a message of their own are left out."""
    own = (*FIXED, "training.checkpoint_enable")
    out: list[str] = []
    for key in _differences(saved, result):
        if key_under(key, RESUMABLE) or key in own:
            continue
        group = key.split(".", 1)[0]
        new, old = OmegaConf.select(result, group), OmegaConf.select(saved, group)
        if group in GROUPS and new.get("name") != old.get("name"):
            shown = f"{group}={new.name} (was {old.name})"
        else:
            old_value = _plain(OmegaConf.select(saved, key, default=None))
            shown = f"{_shown(key, OmegaConf.select(result, key), None)} (was {old_value})"
        if shown not in out:
            out.append(shown)
    return out


def _differences(a: DictConfig, b: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves that differ between ``a`` and ``b``."""
    out = []
    for key in set(a.keys()) | set(b.keys()):
        if key == "hydra" and not prefix:
            continue
        va, vb = a.get(key), b.get(key)
        path = f"{prefix}{key}"
        if isinstance(va, DictConfig) and isinstance(vb, DictConfig):
            out += _differences(va, vb, path + ".")
        elif _plain(va) != _plain(vb):
            out.append(path)
    return sorted(out)


def _check_same_stack(asked: str, run_dir: Path) -> None:
    """A run continues on the torchtitan release it trained on (its ``stack.json``)."""
    recorded = Stack.read(run_dir / STACK)
    try:
        here = installed_torchtitan()
    except StackError:
        return  # the check before launch says what is missing
    if recorded is None or recorded.torchtitan == here:
        return
    raise ConfigError([f"training.resume={asked}: the run trained on torchtitan {recorded.torchtitan} "
                       f"({recorded.label}) and this environment runs torchtitan {here}; its checkpoints hold "
                       f"{recorded.torchtitan}'s model and optimizer state. Continue it where torchtitan "
                       f"{recorded.torchtitan} is installed (`{INSTALL.get(recorded.torchtitan, 'pip install')}`), "
                       f"or start a new run"])
