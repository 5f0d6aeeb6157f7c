"""How a config mistake is reported: every check adds lines to a :class:`Report`, the lines come
back together as one :class:`ConfigError`, and :func:`reject` prints it and exits with
:data:`EXIT_CONFIG` before anything starts.

The validator, the launchers, the resume checks and the translation of Hydra's composition
errors all go through this module, so every mistake reads the same way ("did you mean ...?"
where a choice is close, the valid choices) and ends with the same exit code.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from typing import Iterable, NoReturn, Optional

# Exit code of a command rejected before anything started (argparse's, too).
EXIT_CONFIG = 2


class ConfigError(ValueError):
    """One or more problems in a training config; ``problems`` lists them, ``note`` (a line
    after them, not a problem itself) says what follows from them."""

    def __init__(self, problems: list[str], note: Optional[str] = None):
        self.problems = list(problems)
        self.note = note
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the training config:\n{lines}"
                         + (f"\n{note}" if note else ""))


@dataclass
class Report:
    """What the checks found: errors stop the launch, warnings are printed."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def error(self, msg: str) -> None:
        self.errors.append(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)


def closest(word: str, choices: Iterable[str]) -> Optional[str]:
    """The choice ``word`` is most likely a typo of, or None when none is close."""
    choices = [str(c) for c in choices]
    by_lower = {c.lower(): c for c in choices}
    if str(word).lower() in by_lower:
        return by_lower[str(word).lower()]
    found = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[found[0]] if found else None


def closest_all(word: str, choices: Iterable[str]) -> list[str]:
    """Every choice as close to ``word`` as the closest (``ep3``: ``ep2`` and ``ep8`` alike),
    in the order given; empty when none is close."""
    choices = [str(c) for c in choices]
    match = closest(word, choices)
    if match is None or match.lower() == str(word).lower():
        return [] if match is None else [match]

    def ratio(c: str) -> float:
        return difflib.SequenceMatcher(None, str(word).lower(), c.lower()).ratio()

    best = ratio(match)
    return [c for c in choices if ratio(c) == best]


def did_you_mean(word: str, choices: Iterable[str], shown: str = "{}") -> str:
    """``"did you mean <shown>? "`` for the closest choice (``"<a>, <b> or <c>"`` when several
    are as close), or ``""``. ``shown`` formats a choice as the user would type it (e.g.
    ``"training.{}"``)."""
    matches = [shown.format(m) for m in closest_all(word, choices)]
    if not matches:
        return ""
    listed = matches[0] if len(matches) == 1 else f"{', '.join(matches[:-1])} or {matches[-1]}"
    return f"did you mean {listed}? "


def choice_problem(key: str, value: object, choices: Iterable[str]) -> str:
    """The message for ``key=value`` when ``value`` is not one of ``choices``."""
    choices = list(choices)
    return f"{key}={value!r}: {did_you_mean(str(value), choices, f'{key}={{}}')}use one of {choices}"


def unknown_key_problem(key: str, known: Iterable[str], owner: Optional[str] = None) -> str:
    """The message for a key that does not exist: ``key`` is dotted (``training.stepz``),
    ``known`` the keys its parent has, ``owner`` how to name the parent (default: its key)."""
    parent, _, leaf = key.rpartition(".")
    names = sorted(str(k) for k in known if not str(k).startswith("_"))
    prefix = f"{parent}." if parent else ""
    return (f"unknown key {key}: {did_you_mean(leaf, names, prefix + '{}')}"
            f"{owner or parent or 'the config'} has {', '.join(names)}")


# How omegaconf names the types a value could not be converted to.
_TYPE_WORDS = {"Integer": "a whole number", "Float": "a number", "bool": "true or false"}


def type_problem(key: str, value: object, omegaconf_message: str) -> str:
    """The message for ``key=value`` when the value has the wrong type (omegaconf's message)."""
    first = omegaconf_message.splitlines()[0]
    want = next((words for name, words in _TYPE_WORDS.items()
                 if f"to {name}" in first or f"valid {name}" in first), None)
    return f"{key}={value}: expected {want}" if want else f"{key}={value}: {first}"


def reject(error: ConfigError | str) -> NoReturn:
    """Print the problem(s) and exit with :data:`EXIT_CONFIG`: nothing has been started."""
    print(f"[mxfp8ep] {error}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG)
