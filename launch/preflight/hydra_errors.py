"""Hydra's composition errors, said the way ``launch.preflight.validate`` says config mistakes.

Hydra rejects a misspelled key (``training.stepz=5``) with "To append to your config use
+training.stepz=5", which adds the typo instead of fixing it; a bad group option, a value of the
wrong type and an unreadable override each have their own wording and exit 1. :func:`explain`
turns each into a :class:`launch.config.problems.ConfigError` line with "did you mean ...?" where a
choice is close and the valid choices, so ``launch/train.py`` reports every config mistake the
same way, with exit code 2.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional

from launch.config.problems import ConfigError, did_you_mean, type_problem, unknown_key_problem

def _chain(exc: BaseException) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _override_for(key: str, overrides: list[str]) -> Optional[str]:
    for o in overrides:
        if o.lstrip("+~").split("=", 1)[0] == key:
            return o
    return None


def explain(exc: BaseException, overrides: list[str],
            launcher_fields: Optional[Callable[[], dict[str, list[str]]]] = None) -> Optional[ConfigError]:
    """The config mistake behind ``exc`` (raised while Hydra composed), or None when ``exc`` is
    something else. ``overrides``: the command line's; ``launcher_fields``: every launcher
    option's field names (for "launcher.partition is a field of launcher=slurm")."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    chain = _chain(exc)
    for e in chain:
        if isinstance(e, ConfigError):
            return e
    top = chain[0]
    if isinstance(top, MissingConfigException) and top.missing_cfg_file:
        return ConfigError([_missing_option(top.missing_cfg_file, top.options or [])])
    if isinstance(top, OverrideParseException):
        return ConfigError([_unreadable(str(top))])
    m = re.search(r"Ambiguous value for argument '([^']+)'", str(top))
    if m:  # a sweep's comma list in a single run
        return ConfigError([_comma_list(m.group(1), overrides)])
    if not isinstance(top, ConfigCompositionException):
        return None
    text = str(top)
    m = re.search(r"Could not override '([^']+)'\. No match in the defaults list", text)
    if m:  # a group the defaults list does not hold (recipe): added with +
        given = _override_for(m.group(1), overrides) or f"{m.group(1)}=..."
        what = "a recipe is added to the config" if m.group(1) == "recipe" else f"{m.group(1)} is added to the config"
        return ConfigError([f"{given}: {what}, not swapped in the defaults list: write +{given.lstrip('+')} "
                            f"(python launch/train.py +{given.lstrip('+')} ...)"])
    m = re.search(r"An item is already at '([^']+)'", text)
    if m:
        key = m.group(1)
        given = _override_for(key, overrides) or f"+{key}=..."
        return ConfigError([f"{given}: {key} already exists, so drop the + ({given.lstrip('+')})"])
    for cause in chain[1:]:
        if isinstance(cause, ValidationError) and cause.full_key:
            return ConfigError([_bad_value(cause, overrides)])
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
            known = list(cause.parent_node.keys()) if cause.parent_node is not None else []
            known = [k for k in known if k != "hydra"]
            if cause.full_key.startswith("launcher.") and cause.parent_node is not None:
                msg = unknown_key_problem(cause.full_key, known,
                                          f"launcher={cause.parent_node.get('name')}")
                if launcher_fields is not None:
                    msg += _other_launchers(cause.full_key.split(".")[1], launcher_fields)
            else:
                msg = unknown_key_problem(cause.full_key, known)
            return ConfigError([msg])
    return ConfigError([text.splitlines()[0]])


def _missing_option(missing: str, options: list[str]) -> str:
    group, _, option = missing.rpartition("/")
    if not options:
        return f"unknown group {group}: no conf/{group}/ options exist"
    return (f"{group}={option}: no such option; {did_you_mean(option, options, group + '={}')}"
            f"{group} has {', '.join(options)}")


def _unreadable(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("See https")]
    m = re.search(r"Error parsing override '([^']*)'", text)
    said = lines[-1] if lines else text
    if m and "missing EQUAL" in text:
        return (f"{m.group(1)}: an override is key=value or group=option (e.g. "
                f"{m.group(1)}=<value>)")
    tilde = re.search(r"Exception: ([^\s=]+)=(\S*~\S*)", text)
    if tilde:  # ~ is Hydra's delete prefix; the shell expands ~ only at a word's start
        key, value = tilde.groups()
        return (f"{key}={value}: Hydra's override grammar cannot read ~ in a value, and the shell expands it only "
                f"at the start of a word; write the path out: {key}={os.path.expanduser(value)} "
                f"(or {key}=$HOME{value.removeprefix('~')}, which the shell expands)")
    return f"could not read an override ({said}): overrides are key=value or group=option"


def _comma_list(override: str, overrides: list[str]) -> str:
    key, _, value = override.partition("=")
    given = [o for o in overrides if not o.startswith("hydra.")] or [override]
    return (f"{override}: a comma list is a sweep, one run per value: add --multirun before the "
            f"overrides (python launch/train.py --multirun {' '.join(given)}); for one value holding "
            f"commas, quote it ({key}='{value}')")


def _bad_value(cause: Any, overrides: list[str]) -> str:
    given = _override_for(cause.full_key, overrides)
    value = given.split("=", 1)[1] if given and "=" in given else "?"
    return type_problem(cause.full_key, value, str(cause))


def _other_launchers(field: str, launcher_fields: Callable[[], dict[str, list[str]]]) -> str:
    owners = sorted(name for name, fields in launcher_fields().items() if field in fields)
    if not owners:
        return ""
    return f" (launcher.{field} is a field of {' and '.join(f'launcher={o}' for o in owners)})"


# Hydra's flags that take a value (the next word); ``--info`` takes one only when one follows.
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp", "--config-dir",
                "-cd", "--experimental-rerun"}


def split_overrides(args: list[str]) -> Optional[str]:
    """The problem, naming the command that works, where overrides stand on both sides of a
    flag (``a2a=bf16,mxfp8 --multirun training.steps=50``): Hydra's argument parser reads the
    overrides as one list and stops at "unrecognized arguments". None where they are together."""
    flags, overrides, where, skip = [], [], [], False
    for i, a in enumerate(args):
        if skip:
            flags.append(a)
            skip = False
        elif a.startswith("-"):
            flags.append(a)
            skip = a in _VALUE_FLAGS
        else:
            overrides.append(a)
            where.append(i)
    if not where or where[-1] - where[0] + 1 == len(where):
        return None
    command = " ".join(["python launch/train.py", *flags, *overrides])
    between = ", ".join(f for f in flags if f.startswith("-"))
    return (f"{' '.join(args)}: the overrides stand on both sides of {between}, and Hydra reads them as one "
            f"list: put the flags first ({command})")

