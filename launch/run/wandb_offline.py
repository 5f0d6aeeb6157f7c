"""Read an offline wandb run (``wandb/offline-run-*/run-*.wandb``) without a wandb server.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks of chunks, each ``crc32c:u32 | length:u16 | type:u8 | payload`` where type
FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4 reassembles one serialized
``wandb.proto.wandb_internal_pb2.Record``. (wandb 0.31 no longer ships a reader.)

A resumed run (same run dir, or a requeued SLURM job) logs each launch into its own
``offline-run-*`` folder with the same run id; :func:`read_runs` merges them the way
``wandb sync`` uploads them: one run, history appended in start order, whether the folders
are found under one root or named one by one.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

HEADER = struct.Struct("<4sHB")
HEADER_IDENT = b":W&B"
HEADER_MAGIC = 0xBEE1
BLOCK = 32768
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_records(path: str) -> Iterator[Any]:
    """Yield every ``Record`` protobuf in a ``.wandb`` file, in write order. A torn final
    chunk (a run still writing, or killed) ends the iteration quietly."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER.size:
        return
    ident, magic, _version = HEADER.unpack_from(data, 0)
    if ident != HEADER_IDENT or magic != HEADER_MAGIC:
        raise ValueError(f"{path}: not a wandb run file (header {data[:7]!r})")
    pos, pending = HEADER.size, bytearray()
    while pos + CHUNK.size <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK.size:  # block trailer: zero padding
            pos += left_in_block
            continue
        _crc, length, kind = CHUNK.unpack_from(data, pos)
        pos += CHUNK.size
        if kind == 0 and length == 0:  # zero-filled tail
            pos += left_in_block - CHUNK.size
            continue
        payload = data[pos : pos + length]
        if len(payload) < length:
            return
        pos += length
        if kind == FULL:
            pending = bytearray(payload)
        elif kind == FIRST:
            pending = bytearray(payload)
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        elif kind == LAST:
            pending += payload
        else:
            raise ValueError(f"{path}: bad chunk type {kind} at byte {pos - length - CHUNK.size}")
        record = pb.Record()
        record.ParseFromString(bytes(pending))
        yield record
        pending = bytearray()


def _items(items: Any) -> dict[str, Any]:
    out = {}
    for item in items:
        key = item.key if item.key else "/".join(item.nested_key)
        try:
            out[key] = json.loads(item.value_json)
        except (ValueError, TypeError):
            out[key] = item.value_json
    return out


@dataclass
class OfflineRun:
    path: str
    run_id: str = ""
    name: str = ""
    group: str = ""
    project: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: Optional[int] = None
    started: float = 0.0  # the launch's start time (seconds since the epoch; 0 if not recorded)
    # The offline-run folder(s) this run was read from (several: a resumed run's launches).
    paths: list[str] = field(default_factory=list)

    def series(self, key: str) -> list[Any]:
        """Values of ``key`` over the history rows that have it, in step order."""
        return [row[key] for row in self.history if key in row]

    def last(self, key: str) -> Any:
        """Summary value if present, else the last logged value, else None."""
        if key in self.summary:
            return self.summary[key]
        values = self.series(key)
        return values[-1] if values else None


def read_run(path: str) -> OfflineRun:
    """Parse one ``.wandb`` file (or an ``offline-run-*`` directory holding one)."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.wandb")))
        if not files:
            raise FileNotFoundError(f"no .wandb file in {path}")
        path = files[0]
    run = OfflineRun(path=path, paths=[os.path.dirname(path)])
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.run_id, run.name, run.group, run.project = r.run_id, r.display_name, r.run_group, r.project
            run.tags = list(r.tags)
            run.started = r.start_time.ToMicroseconds() / 1e6
            run.config.update(_config_items(r.config.update))
        elif kind == "config":
            run.config.update(_config_items(rec.config.update))
        elif kind == "history":
            run.history.append(_items(rec.history.item))
        elif kind == "summary":
            run.summary.update(_items(rec.summary.update))
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    run.config.pop("_wandb", None)
    return run


def _config_items(items: Any) -> dict[str, Any]:
    out = {}
    for key, value in _items(items).items():
        # wandb stores config entries as {"value": ..., "desc": ...}
        out[key] = value.get("value", value) if isinstance(value, dict) else value
    return out


def find_runs(root: str) -> list[str]:
    """Every ``offline-run-*`` / ``run-*`` directory holding a ``.wandb`` file under ``root``
    (``root`` itself included), oldest first."""
    found = glob.glob(os.path.join(root, "**", "*.wandb"), recursive=True)
    # realpath: wandb's "latest-run" symlink points at one of the real run directories.
    return _oldest_first({os.path.realpath(os.path.dirname(p)) for p in found})


def _oldest_first(dirs: set[str]) -> list[str]:
    return sorted(dirs, key=lambda d: (os.path.getmtime(d), d))


def read_runs(*roots: str) -> list[OfflineRun]:
    """Every wandb run under ``roots`` (each a folder to search, or one ``offline-run-*``
    folder), each run id once: its launches merged in start order. A later launch's rows
    replace an earlier one's for the steps both logged (a run resumed from a checkpoint
    before its last logged step repeats those steps); its summary and exit code win."""
    dirs = _oldest_first({d for root in roots for d in find_runs(root)})
    # A folder without a run record (its service killed before it wrote one) holds nothing;
    # the sort is stable: ties keep mtime order.
    launches = sorted((r for r in map(read_run, dirs) if r.run_id), key=lambda r: r.started)
    runs: dict[str, OfflineRun] = {}
    for run in launches:
        first = runs.setdefault(run.run_id, run)
        if first is run:
            continue
        by_step = {row.get("_step"): row for row in first.history + run.history}
        first.history = [by_step[s] for s in sorted(by_step, key=lambda s: (s is None, s or 0))]
        first.summary.update(run.summary)
        first.config.update(run.config)
        first.exit_code = run.exit_code
        first.paths += run.paths
    return list(runs.values())
