"""Benchmark results as data: one JSON object per line, one file per run.

Every benchmark writes its results through :class:`ResultsFile`. Each row carries where it was
measured (commit, date, machine, versions, the exact command) beside the benchmark's own fields
(shape, arm, pass, ms, ratios, ...). A run's file is named
``<date>_<commit7>_<machine>_<bench>.jsonl`` (``2026-12-02_70c5beb_h200x2_layer.jsonl``), so a
folder of them sorts by date and says at a glance what ran where.

The commit and ``"dirty"`` come from ``launch.run.provenance.git_commit`` (run summaries record
the same): ``$MXFP8EP_COMMIT`` when set, else the checkout's HEAD; ``"dirty": true`` for a tree
whose tracked files differ from it. When that cannot be told, the row says ``"dirty": null`` and
why in ``"dirty_reason"``.

Rows migrated from before this format carry ``"commit_source"``: ``"recorded"`` when the commit
came with the data, ``"inferred"`` when it was read from git history (the parent of the commit
that added the data); their ``host_cpus`` and some versions are null where nothing recorded them.
A run whose exchange crossed several links (NCCL forced onto NVLink, shared memory, sockets) names
the machine's link in ``machine`` and each row's in its own ``link`` field.

``python -m benchmarks.report`` turns the rows into docs/results.md; benchmarks/claims.yaml names
the rows behind each claim.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from launch.run.provenance import COMMIT_ENV, DIRTY_ENV, git_commit  # noqa: F401  (COMMIT_ENV, DIRTY_ENV: the rows' too)

REPO = Path(__file__).resolve().parent.parent
# Keys every row carries; a benchmark's own fields may not reuse them.
PROVENANCE_KEYS = ("bench", "commit", "dirty", "date", "machine", "versions", "command")
# commit_source: migrated rows only; dirty_reason: rows whose dirty is null (see the module docstring)
OPTIONAL_PROVENANCE_KEYS = ("commit_source", "dirty_reason")


@dataclass(frozen=True)
class Machine:
    """What a row was measured on."""

    gpu: str  # device name ("NVIDIA H200"), or "cpu"
    count: int  # GPUs (or CPU processes) the benchmark used
    link: str  # what the exchange crossed: "nvlink", "nccl-shm", "nccl-socket", "gloo", "none"
    host_cpus: int

    @property
    def slug(self) -> str:
        """Short name for file names: ``h200x2``, ``h100x8``, ``cpux2``."""
        if self.gpu == "cpu":
            return f"cpux{self.count}"
        # the model number ("NVIDIA H100 80GB HBM3" -> h100), else the name's last word
        model = re.search(r"\b[A-Za-z]{1,3}\d{2,4}\b", self.gpu.removeprefix("NVIDIA "))
        return f"{(model.group(0) if model else self.gpu.split()[-1]).lower()}x{self.count}"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str | None]:
    """Python, torch, triton, NCCL (where CUDA is there), torchtitan, torchao."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "nccl": nccl,
        "torchtitan": _version("torchtitan"),
        "torchao": _version("torchao"),
    }


def this_machine(count: int | None = None, link: str | None = None) -> Machine:
    """The machine this process runs on. ``count``: the GPUs (or processes) the benchmark used
    (default: every visible GPU, else 1); ``link``: what its exchange crossed (default: ``nvlink``
    where two GPUs reach each other's memory, ``none`` on one GPU, ``gloo`` on CPU)."""
    import torch

    cpus = os.cpu_count() or 1
    if not torch.cuda.is_available():
        return Machine("cpu", count or 1, link or "gloo", cpus)
    visible = torch.cuda.device_count()
    count = count or visible
    if link is None:
        peer = visible > 1 and torch.cuda.can_device_access_peer(0, 1)
        link = "nvlink" if peer else ("none" if count == 1 else "pcie")
    return Machine(torch.cuda.get_device_name(0), count, link, cpus)


def command_line() -> str:
    """The command that started this process, as a user would type it again."""
    launcher = os.environ.get("MXFP8EP_BENCH_COMMAND")
    if launcher:  # set by benchmarks/run.sh: the suite's whole command (torchrun and all)
        return launcher
    return shlex.join([Path(sys.executable).name, *sys.argv])


class ResultsFile:
    """One run of one benchmark: ``write(**fields)`` appends a row with the run's provenance.

    Only the process that calls ``write`` writes; under torchrun let rank 0 call it. ``machine``,
    ``command`` and ``versions`` default to this process's; give them when the rows describe a
    run made elsewhere (a GPU machine's exported summaries turned into rows here).
    """

    def __init__(self, bench: str, out_dir: str | os.PathLike, *, machine: Machine | None = None,
                 command: str | None = None, versions: dict | None = None) -> None:
        commit, dirty, unknown = git_commit(REPO)
        self.machine = machine or this_machine()
        now = _dt.datetime.now(_dt.timezone.utc)
        self.provenance = {
            "bench": bench,
            "commit": commit,
            "dirty": dirty,
            **({"dirty_reason": unknown} if dirty is None else {}),
            "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": asdict(self.machine),
            "versions": versions or package_versions(),
            "command": command or command_line(),
        }
        name = f"{now:%Y-%m-%d}_{commit[:7]}_{self.machine.slug}_{bench}.jsonl"
        self.path = Path(out_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **fields) -> dict:
        clash = sorted(set(fields) & set(PROVENANCE_KEYS + OPTIONAL_PROVENANCE_KEYS))
        if clash:
            raise ValueError(f"row fields {clash} would overwrite the row's provenance")
        row = {**self.provenance, **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(row, sort_keys=False) + "\n")
        return row


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of one results file, or of every ``*.jsonl`` under a folder (sorted by name)."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    rows = []
    for file in files:
        with file.open() as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows
