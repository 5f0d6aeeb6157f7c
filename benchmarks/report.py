"""The results report: the rows in benchmarks/results/ and the claims in benchmarks/claims.yaml,
written as docs/results.md, as the README's results block, its Numerics table (the parity
studies side by side, ``benchmarks.parity_table``) and its elastic-capacity figures
(``benchmarks.capacity_figures``).

    python -m benchmarks.report            # rewrite docs/results.md and the README blocks
    python -m benchmarks.report --check    # exit 1 with a diff when either differs from what it makes

A run measured on a commit older than the last change to the code its bench measures (the bench's
``paths``, and for every bench the pinned dependencies and the script that runs the GPU benches,
``EVERY_BENCH``) is shown as STALE: some commit between the run's commit and HEAD touched those paths
(Markdown under them is prose, not code, and does not count).
Its numbers stay in the report; they describe the commit they were measured on. The output is a
function of the committed rows, the claims and the git history only (no clock), so CI can check it.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks import capacity_figures, parity_table, speed_model
from benchmarks.rows import OPTIONAL_PROVENANCE_KEYS, PROVENANCE_KEYS, read_rows

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CLAIMS = REPO / "benchmarks" / "claims.yaml"
REPORT = REPO / "docs" / "results.md"
README = REPO / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
README_MAX_CLAIMS = 15
LIBRARY = ("mxfp8_ep/",)
RECIPE = LIBRARY + ("launch/", "conf/")
# The measuring code under benchmarks/ of each kind of run (benchmarks/rows.py only records
# provenance and benchmarks/replays.py only reads finished runs' logs, so they are in none).
TIMED = ("benchmarks/harness.py",)
LAYER_CODE = LIBRARY + ("benchmarks/layer.py",) + TIMED
LEG_CODE = LIBRARY + ("benchmarks/legs.py",) + TIMED
TRAIN_CODE = RECIPE + ("benchmarks/train.py",)


# What every bench's figures depend on besides its own code: the pinned dependencies and the
# script that runs the GPU benches.
EVERY_BENCH = ("pyproject.toml", "benchmarks/run.sh")


@dataclass(frozen=True)
class Bench:
    """How one bench's rows read: what it measures, which code its figures depend on (``paths``:
    the library, the benchmark script and what it times with, the recipe for training runs;
    ``EVERY_BENCH`` is added to each), the fields that make rows comparable (``group``), and the
    arms the other arms are set against."""

    title: str
    paths: tuple = LIBRARY
    group: tuple = ()
    baselines: tuple = ()
    key: str = "ms"
    better: str = "lower"
    hide: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(dict.fromkeys(self.paths + EVERY_BENCH)))


LEG_GROUP = ("link", "routing", "rows", "dim", "leg", "pass")
TRAIN = dict(paths=TRAIN_CODE, group=("call",), baselines=("bf16/nccl", "bf16/symm"),
             key="tokens_per_s", better="higher", hide=("losses", "model", "a2a", "transport"))
BENCHES = {
    "layer": Bench("One torchtitan 0.2.2 MoE layer (router, experts, shared expert), ms per call, "
                   "median of the slowest rank", paths=LAYER_CODE, group=("shape", "pass"),
                   baselines=("torchtitan",), hide=("shape_desc",)),
    "legs": Bench("One exchange leg alone (dispatch or combine), ms", paths=LEG_CODE, group=LEG_GROUP,
                  baselines=("torchtitan",)),
    "links": Bench("One exchange leg over NCCL's NVLink, shared-memory and socket transports, ms",
                   paths=LEG_CODE, group=LEG_GROUP, baselines=("torchtitan",)),
    "a2a": Bench("The unfused MXFP8 all-to-all (`all_to_all_v`: quantize, exchange, dequantize) "
                 "against bf16, ms", paths=LEG_CODE),
    "power": Bench("The DeepSeek-V3-like layer back to back with the GPUs sampled: SM clock, power, "
                   "energy per pass", paths=LAYER_CODE, group=("round", "rank"), baselines=("torchtitan",),
                   hide=("shape_desc",)),
    "kernels": Bench("Kernels alone: the exchange kernels, the routed experts, launch-shape sweeps",
                     paths=LIBRARY + ("benchmarks/kernels.py",) + TIMED, hide=("shape_desc",)),
    "profile": Bench("Where a training step's GPU time goes (torch profiler, one step), ms",
                     paths=TRAIN_CODE + ("benchmarks/timeline.py",)),
    "train": Bench("Training `model=dsv3_ep_bench` (two DeepSeek-V3 MoE layers, EP=2), 50 steps, "
                   "tokens/s of all ranks", **TRAIN),
    "train_shm": Bench("Training as in `train`, NCCL forced onto shared memory (`NCCL_P2P_DISABLE=1`)",
                       **TRAIN),
    "numerics_overhead": Bench("Training with the numerics telemetry (`logging.numerics_every`) against "
                               "without it, step time (s) of each run and of each arm's runs together "
                               "(`on_vs_off`)",
                               paths=TRAIN_CODE, baselines=("off",), key="step_time_s",
                               hide=("overrides", "run_dir", "step_times_off", "step_times_on")),
    "parity": Bench("bf16 against MXFP8 training on the debian_docs corpus (`scripts/parity_study.py`): "
                    "final training and validation loss, the validation loss's distance from the bf16 "
                    "reference against the bound (`parity_rule`: with three or more bf16 seeds their mean "
                    "and max(2 × their std, 0.5% of the loss), else bf16 seed 0 and max(seed spread, 0.5% "
                    "of the loss)), the symm capacity replays, the corpus (its sha256 and Debian package "
                    "versions), and the worst layer of each quantization statistic per MXFP8 leg "
                    "(`numerics/`). tokens/s is no speed figure: on the GPU the arms shared one GPU (and "
                    "`gpu_shared` runs their ranks too) and, at EP=1, the MXFP8 arms quantized rows that "
                    "cross no wire; CPU runs say nothing about GPUs",
                    paths=RECIPE + ("recipes/", "scripts/parity_study.py"), key="final_val_loss",
                    hide=("val_steps", "val_losses", "run_name", "verdict", "baseline", "device", "parity_rule",
                          "capacity_replay_steps")),
    "memory_estimate": Bench("The recipe's memory estimate before launch (`launch/config/memory.py`), GiB per GPU: "
                             "the all-to-all (nccl), symm with its activation pool and capacity where they start "
                             "and at their default ceilings, symm with every layer at the worst case "
                             "(`capacity_factor=None`)",
                             paths=("mxfp8_ep/exchange/capacity.py", "mxfp8_ep/config.py", "launch/config/memory.py",
                                    "launch/config/model_facts.py", "benchmarks/memory.py"),
                             group=("model", "activation_checkpoint"), baselines=("nccl",), key="gib"),
    "layer_memory": Bench("The DeepSeek-V3-like layer's peak memory per rank, fwd+bwd (GiB; ranks sharing one "
                          "GPU: EP=W on one device), symm at the default capacity factor and at the worst case, "
                          "torchtitan's ExpertParallel on one rank's share of the experts",
                          paths=LIBRARY + ("benchmarks/memory.py",) + TIMED, group=("shape", "ep"),
                          baselines=("torchtitan",), key="peak_gib"),
    "capacity_replays": Bench("Training runs over the symm transport at the default capacity factor: the steps "
                              "run again after a capacity overflow, and the capacity (expert rows) they started "
                              "and ended at",
                              paths=RECIPE + ("recipes/", "scripts/parity_study.py"),
                              key="capacity_replays", hide=("capacity_replay_steps",)),
    "capacity_study": Bench("The symm transport's activation pool and elastic capacity (`capacity.next_capacity` "
                            "for both) over a measured routing: per EP degree 2, 4, 8 the busiest layer's load and "
                            "the busiest rank's sum over the MoE layers from a CPU run's routing telemetry "
                            "(`recipes/routing_study_full_cpu.yaml`, the counts in `telemetry`; `kind: routing`), "
                            "applied to the DeepSeek-V3 16B recipe's shape on 8 GPUs, per policy (`kind: policy`: "
                            "pool factor and ceiling, capacity factor and ceiling, null: the worst case): steps run "
                            "again (`replays`, `spills`, `reruns_per_1000`, the first steps included), where both "
                            "ended, and the memory estimate per GPU at the start, the ceilings and the end "
                            "(`gib_nccl`: the nccl transport's balanced, `gib_nccl_routed`: at the run's largest "
                            "rank sum)",
                            paths=("mxfp8_ep/exchange/capacity.py", "mxfp8_ep/config.py",
                                   "mxfp8_ep/telemetry/routing_stats.py", "launch/config/memory.py",
                                   "launch/config/model_facts.py", "launch/titan/routing_telemetry.py",
                                   "benchmarks/capacity_study.py",
                                   "recipes/routing_study_full_cpu.yaml", "recipes/dsv3_16b_ep8_bf16_vs_mxfp8.yaml"),
                            group=("kind", "ep"), key="reruns_per_1000",
                            hide=("telemetry_sha256", "start_rows", "end_rows", "peak_rows", "worst_rows",
                                  "pool_start_rows", "pool_end_rows", "pool_peak_rows")),
    "node_hop_capacity": Bench("The two_hop transport's node-hop capacity (`capacity.node_hop_capacity`, grown by "
                               "`capacity.next_capacity`; one capacity for every MoE layer) over a measured routing "
                               "at 2, 4 and 8 nodes of 8 GPUs, EP over all of them: each token's experts sampled from "
                               "the per-expert counts of a CPU run's routing telemetry (`recipes/"
                               "routing_study_full_cpu.yaml`, the counts in `telemetry`; `routing_model`), a rank of "
                               "the DeepSeek-V3 16B recipe's tokens; per node count the need, the most tokens one "
                               "rank sends one other node in any MoE layer, over the balanced rows (`kind: need`), "
                               "and per policy (`kind: policy`: capacity factor and ceiling, null: every token) the "
                               "steps run again (`replays`, `spills`, `reruns_per_1000`, the first steps included), "
                               "where the capacity started and ended, and the node-hop send and receive buffers "
                               "of each a2a preset's widest leg at the ceiling (`ceiling_mib_<preset>`). A model of "
                               "the routing, not a measurement",
                               paths=("mxfp8_ep/exchange/capacity.py", "mxfp8_ep/config.py",
                                      "mxfp8_ep/dispatcher/two_hop.py", "mxfp8_ep/exchange/staging.py",
                                      "mxfp8_ep/format/wire_format.py", "launch/config/model_facts.py",
                                      "launch/titan/routing_telemetry.py", "benchmarks/node_hop_capacity.py",
                                      "benchmarks/capacity_study.py", "benchmarks/internode_bytes.py",
                                      "recipes/routing_study_full_cpu.yaml", "recipes/dsv3_16b_ep8_bf16_vs_mxfp8.yaml"),
                               group=("kind", "nodes"), key="reruns_per_1000",
                               hide=("telemetry_sha256", "peak_rows", "worst_rows")),
    "internode_bytes": Bench("Inter-node bytes per token and MoE layer of the four exchange legs (dispatch and "
                             "combine, forward and backward) on nodes of 8 GPUs, EP over all of them: `flat_*` one "
                             "row per (token, expert) on another node (torchtitan's all-to-all, the `nccl` "
                             "transport), `dedup_*` one row per (token, other node holding its experts), each leg in "
                             "its a2a preset's wire format; `node_limited`: torchtitan's node-limited routing to that "
                             "many of the nodes (null: off). A byte count from a CPU run of torchtitan's router at "
                             "DeepSeek-V3 16B's shape on synthetic tokens (`routing`), not a measurement; "
                             "`modelled_ms`: the speed model's time of the four legs per GPU at 50 GB/s per GPU "
                             "between nodes and NVLink inside (`time_model`), a model",
                             paths=("mxfp8_ep/config.py", "mxfp8_ep/format/wire_format.py", "launch/titan/models.py",
                                    "launch/titan/cpu_compat.py", "launch/config/node_limited.py",
                                    "benchmarks/internode_bytes.py", "benchmarks/speed_model.py",
                                    "benchmarks/capacity_study.py", "recipes/dsv3_16b_2nodes_sweep.yaml"),
                             group=("nodes", "node_limited"), baselines=("flat_bf16",), key="bytes_per_token",
                             hide=("leg_bytes_per_token", "time_model", "routing")),
    "titan030": Bench("torchtitan 0.3.0's MoE layer with its dispatchers and ours, ms",
                      paths=LIBRARY + ("benchmarks/titan030.py",) + TIMED, group=("shape", "pass"),
                      baselines=("alltoall", "minimal_async_ep"),
                      hide=("shape_desc",)),
}
# The command that measures each bench again with the code in front of you, from the repository
# root (OUT: a folder for the rows). A run's recorded command is what ran at its commit: scripts
# have been renamed and merged since, and some ran from another checkout's path.
RERUN = {
    "layer": "bash benchmarks/run.sh layer OUT",
    "legs": "bash benchmarks/run.sh legs OUT",
    "links": "bash benchmarks/run.sh links OUT",
    "a2a": "bash benchmarks/run.sh legs OUT",
    "power": "bash benchmarks/run.sh power OUT",
    "kernels": "bash benchmarks/run.sh kernels OUT",
    "profile": "bash benchmarks/run.sh step_profile OUT",
    "train": "bash benchmarks/run.sh train OUT",
    "train_shm": "bash benchmarks/run.sh train_shm OUT",
    "numerics_overhead": "bash benchmarks/run.sh numerics OUT",
    "parity": "python scripts/parity_study.py --export OUT",
    "memory_estimate": "python -m benchmarks.memory --out OUT",
    "layer_memory": "bash benchmarks/run.sh capacity_1gpu OUT",
    "capacity_replays": "bash benchmarks/run.sh capacity_1gpu OUT",
    "capacity_study": ("python -m benchmarks.capacity_study "
                       "benchmarks/results/telemetry/routing_study_full_cpu.routing.jsonl.gz "
                       "--model routing_study_full_dsv3 --out OUT"),
    "node_hop_capacity": ("python -m benchmarks.node_hop_capacity "
                          "benchmarks/results/telemetry/routing_study_full_cpu.routing.jsonl.gz "
                          "--model routing_study_full_dsv3 --out OUT"),
    "internode_bytes": "bash benchmarks/run.sh internode_bytes OUT",
    "titan030": "bash benchmarks/run.sh titan030 OUT",
}
HIDDEN = set(PROVENANCE_KEYS + OPTIONAL_PROVENANCE_KEYS)
LINKS = {"nvlink": "NVLink", "nccl-shm": "NCCL shm", "nccl-socket": "NCCL sockets", "shm": "NCCL shm",
         "socket": "NCCL sockets", "gloo": "gloo", "pcie": "PCIe", "none": None,
         "shared-gpu": "ranks sharing the GPU"}


# ------------------------------------------------------------------------------ git history
# Git pathspecs left out of the measured paths: a README edit changes no figure.
PROSE = (":(exclude,glob)**/*.md",)
NO_BLOB = "0" * 40  # git's id for "no file" (added or deleted) in `git diff --raw`


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:]
    return tree


def code_of(path: str, text: str) -> str:
    """What of a file can change a measurement: a Python module's syntax tree without docstrings
    (comments and formatting are not in it), a YAML or TOML file's data, any other file's text. A
    file that does not parse counts as its text."""
    try:
        if path.endswith(".py"):
            return ast.dump(_strip_docstrings(ast.parse(text)))
        if path.endswith((".yaml", ".yml")):
            return json.dumps(yaml.safe_load(text), sort_keys=True, default=str)
        if path.endswith(".toml"):
            return json.dumps(tomllib.loads(text), sort_keys=True, default=str)
    except (SyntaxError, ValueError, yaml.YAMLError, tomllib.TOMLDecodeError):
        pass
    return text


class History:
    """Whether the code a run measured changed after its commit, from git: the measured paths'
    files at the run's commit against HEAD, compared by :func:`code_of`."""

    def __init__(self, repo: Path = REPO):
        self.repo = repo
        self.problem = None
        inside = self._git("rev-parse", "--is-inside-work-tree")
        if inside != "true":
            self.problem = "this copy of the repository has no git history: staleness is not judged"
        elif self._git("rev-parse", "--is-shallow-repository") == "true":
            self.problem = ("this clone is shallow (`git fetch --unshallow` gets the history): runs whose "
                            "commit it lacks show `unknown`")
        self._cache: dict = {}
        self._code: dict = {}

    def _git(self, *args) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(self.repo), *args], capture_output=True, text=True)
        except OSError:
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    def _load_code(self, blobs: dict[str, str]) -> None:
        """``code_of`` each blob -> path not yet known, read in one ``git cat-file --batch``."""
        todo = [b for b in blobs if b != NO_BLOB and b not in self._code]
        if not todo:
            return
        out = subprocess.run(["git", "-C", str(self.repo), "cat-file", "--batch"],
                             input=("\n".join(todo) + "\n").encode(), capture_output=True, check=True).stdout
        at = 0
        for blob in todo:
            header_end = out.index(b"\n", at)
            size = int(out[at:header_end].split()[2])
            text = out[header_end + 1:header_end + 1 + size].decode("utf-8", errors="replace")
            self._code[blob] = code_of(blobs[blob], text)
            at = header_end + 1 + size + 1  # the object and its newline

    def changed(self, commit: str, paths: tuple) -> list[str] | None:
        """The files under ``paths`` whose code differs between ``commit`` and HEAD (added and
        deleted ones included); None when that cannot be told (no history, or the commit is not in it)."""
        key = (commit, paths)
        if key not in self._cache:
            raw = None
            if not (self.problem and "no git history" in self.problem) \
                    and self._git("cat-file", "-e", f"{commit}^{{commit}}") is not None:
                raw = self._git("diff", "--raw", "--no-abbrev", "--no-renames", commit, "HEAD", "--", *paths, *PROSE)
            if raw is None:
                self._cache[key] = None
            else:
                diffs = []  # (old blob, new blob, path)
                for line in raw.splitlines():
                    meta, path = line.split("\t", 1)
                    diffs.append((*meta.split()[2:4], path))
                self._load_code({blob: path for old, new, path in diffs for blob in (old, new)})
                code = {NO_BLOB: None, **self._code}
                self._cache[key] = [path for old, new, path in diffs if code[old] != code[new]]
        return self._cache[key]

    def status(self, commit: str, paths: tuple) -> str:
        """``current``, ``STALE`` (the measured code changed since) or ``unknown``."""
        files = self.changed(commit, paths)
        return "unknown" if files is None else "STALE" if files else "current"


# ------------------------------------------------------------------------------ runs and rows
@dataclass
class Run:
    name: str
    rows: list

    @property
    def first(self) -> dict:
        return self.rows[0]

    @property
    def bench(self) -> Bench:
        return BENCHES.get(self.first["bench"], Bench(self.first["bench"]))

    def hardware(self, row: dict | None = None) -> str:
        m = self.first["machine"]
        gpu = "CPU" if m["gpu"] == "cpu" else m["gpu"].replace("NVIDIA ", "")
        link = LINKS.get((row or {}).get("link") or m["link"], (row or {}).get("link") or m["link"])
        return f"{m['count']}× {gpu}" + (f", {link}" if link else "")


def load_runs(results: Path = RESULTS) -> dict[str, Run]:
    runs = {}
    for path in sorted(results.glob("*.jsonl")):
        rows = read_rows(path)
        if rows:
            runs[path.name] = Run(path.name, rows)
    return runs


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.1f}" if abs(v) >= 100 else f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, list):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return str(v).replace("|", "\\|")


def _table(headers: list, body: list) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + \
        ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c.replace("|", "\\|") for c in row) + " |"
         for row in body]


def _matches(row: dict, sel: dict) -> bool:
    return all(row.get(k) == v for k, v in (sel or {}).items())


def _ratio(value: float, base: float, better: str) -> float:
    return base / value if better == "lower" else value / base


def run_table(run: Run) -> list[str]:
    bench = run.bench
    if run.first["bench"] == "profile":
        return profile_table(run)
    hide = HIDDEN | set(bench.hide)
    cols: list = []
    for r in run.rows:
        cols += [k for k in r if k not in hide and k not in cols]
    same = [c for c in cols if len(run.rows) > 1 and all(r.get(c) == run.first.get(c) for r in run.rows)
            and c not in ("arm", bench.key)]
    cols = [c for c in cols if c not in same]
    ratio_cols = []
    groups: dict = {}
    for r in run.rows:
        if "arm" in r:
            groups.setdefault(tuple(r.get(k) for k in bench.group), {}).setdefault(r["arm"], r)  # first wins
    for base in bench.baselines:
        if any(base in g for g in groups.values()):
            ratio_cols.append(base)
    loss_cols = [b for b in ratio_cols if "losses" in run.first]
    body = []
    for r in run.rows:
        cells = [r.get(c) for c in cols]
        arms = groups.get(tuple(r.get(k) for k in bench.group), {})
        for base in ratio_cols:
            b = arms.get(base)
            ok = b is not None and isinstance(r.get(bench.key), (int, float)) and b.get(bench.key)
            cells.append(f"{_ratio(r[bench.key], b[bench.key], bench.better):.3f}×" if ok else "")
        for base in loss_cols:
            b = arms.get(base)
            cells.append(f"{mean_abs_loss_delta(r['losses'], b['losses']):.3f}" if b and b is not r else "")
        body.append(cells)
    lead = [f"Every row: {'; '.join(f'{c} {_fmt(run.first[c])}' for c in same)}.", ""] if same else []
    if loss_cols:
        lead += [f"`Δloss vs <arm>`: mean absolute loss difference from that arm over steps {LOSS_FROM}-"
                 f"{len(run.first['losses'])} (same seed and data).", ""]
    return lead + _table(cols + [f"vs {b}" for b in ratio_cols] + [f"Δloss vs {b}" for b in loss_cols], body)


LOSS_FROM = 11  # the first steps of a 50-step run are warm-up; their losses swing by whole units


def mean_abs_loss_delta(losses: list, base: list) -> float:
    pairs = list(zip(losses, base))[LOSS_FROM - 1:]
    return sum(abs(a - b) for a, b in pairs) / len(pairs)


def profile_table(run: Run) -> list[str]:
    """Categories down, (arm, rank) across."""
    heads = [f"{r['arm']} rank {r['rank']}" for r in run.rows]
    cats: list = []
    for r in run.rows:
        cats += [c for c in r["categories_ms"] if c not in cats]
    body = [["step span", *[r["span_ms"] for r in run.rows]], ["idle in the span", *[r["idle_ms"] for r in run.rows]]]
    body += [[c, *[r["categories_ms"].get(c) for r in run.rows]] for c in cats]
    return _table(["ms of the step", *heads], body)


def run_header(run: Run, history: History) -> list[str]:
    f = run.first
    v = f.get("versions") or {}
    soft = ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "triton", "nccl", "torchtitan", "torchao") if v.get(k))
    source = " (inferred from git history)" if f.get("commit_source") == "inferred" else ""
    changed = history.changed(f["commit"], run.bench.paths)
    if changed is None:
        mark = "status unknown"
    elif changed:
        where = [p for p in run.bench.paths if any(f == p or f.startswith(p) for f in changed)]
        mark = "**STALE**: the code changed since in " + ", ".join(f"`{p}`" for p in where)
    else:
        mark = "current"
    dirty = {True: " (dirty tree)", False: "",
             None: f" (dirty: unknown, {f.get('dirty_reason') or 'no reason recorded'})"}[f.get("dirty", False)]
    commands = []
    for r in run.rows:
        if r["command"] not in commands:
            commands.append(r["command"])
    rerun = RERUN.get(f["bench"])
    return [f"### `{run.name}`", "",
            f"- commit `{f['commit'][:7]}`{source}{dirty}, {f['date'][:10]}: {mark}",
            f"- {run.hardware()}; {soft}", f"- command, as run at `{f['commit'][:7]}`:", "",
            *[f"      {c}" for c in commands], "",
            *([f"- to run it now (from the repository root): `{rerun}`", ""] if rerun else [])]


# ------------------------------------------------------------------------------ claims
@dataclass
class Claim:
    spec: dict
    value: float | None = None
    run: Run | None = None
    row: dict = field(default_factory=dict)
    error: str | None = None
    inputs: list = field(default_factory=list)  # the runs a model claim is computed from

    @property
    def id(self) -> str:
        return self.spec["id"]

    def figure(self) -> str:
        if self.value is None:
            return f"n/a ({self.error})"
        if self.spec.get("compare") == "value":
            return f"{self.value:+.4f}"
        if self.spec.get("compare") == "difference":
            unit = {"peak_gib": " GiB", "ms": " ms", "energy_j": " J"}.get(self.spec["key"], "")
            return f"{self.value:+.2f}{unit}"
        return f"{self.value:.3f}×"

    @property
    def limit(self) -> float | None:
        """``limit_key``: the row's own bound on the figure's size (``|figure| <= limit``)."""
        key = self.spec.get("limit_key")
        return None if key is None or not self.row else self.row.get(key)

    def target(self) -> str:
        if "target" in self.spec:
            return f"≥{self.spec['target']}×"
        if "target_max" in self.spec:
            return f"≤{self.spec['target_max']}×"
        return "" if self.limit is None else f"|Δ| ≤ {self.limit:.4f}"

    def met(self) -> str:
        if self.value is None:
            return ""
        if self.limit is not None:
            return "yes" if abs(self.value) <= self.limit else "no"
        if "target_max" in self.spec:
            return "yes" if self.value <= self.spec["target_max"] else "no"
        t = self.spec.get("target")
        return "" if t is None else ("yes" if self.value >= t else "no")


def _one(rows: list, sel: dict, what: str) -> dict:
    found = [r for r in rows if _matches(r, sel)]
    if len(found) != 1:
        raise LookupError(f"{len(found)} rows match {what} {sel}")
    return found[0]


def evaluate(spec: dict, runs: dict[str, Run]) -> Claim:
    claim = Claim(spec)
    try:
        if spec.get("model") == "layer":
            row = _one(speed_model.layer_model_rows(), spec["row"], "row")
            claim.row, claim.value = row, row[spec["key"]]
            claim.inputs = [runs[n] for n in (speed_model.FLOOR_RUN, speed_model.LAYER_RUN, speed_model.KERNELS_RUN)
                            if n in runs]
            return claim
        run = runs.get(spec["run"])
        if run is None:
            raise LookupError(f"no run file {spec['run']}")
        claim.run = run
        rows = [r for r in run.rows if _matches(r, spec.get("where"))]
        row = _one(rows, spec["row"], "row")
        base = _one(rows, spec["baseline"], "baseline") if "baseline" in spec else row
        v, b = row[spec["key"]], base[spec.get("baseline_key", spec["key"])]
        claim.row = row
        if spec.get("compare") == "value":
            claim.value = v
        elif spec.get("compare") == "quotient":
            claim.value = v / b
        else:
            claim.value = v - b if spec.get("compare") == "difference" else _ratio(v, b, spec.get("better", "lower"))
    except (LookupError, KeyError) as e:
        claim.error = str(e).strip("'\"")
    return claim


def load_claims(path: Path = CLAIMS) -> list[dict]:
    claims = yaml.safe_load(path.read_text())["claims"]
    ids = [c["id"] for c in claims]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"{path}: claim ids used twice: {dupes}")
    if sum(bool(c.get("readme")) for c in claims) > README_MAX_CLAIMS:
        raise ValueError(f"{path}: at most {README_MAX_CLAIMS} claims may have readme: true")
    return claims


def claim_status(claim: Claim, history: History) -> str:
    """A measured claim has its run's status; a model claim is STALE when any run it reads is."""
    runs = [claim.run] if claim.run else claim.inputs
    states = {history.status(r.first["commit"], r.bench.paths) for r in runs}
    return next((s for s in ("STALE", "unknown") if s in states), "current")


# The marks on a claim's figure (claim_status) and on its commit (the run's `dirty`).
MARKS = {"STALE": "†", "unknown": "?"}
DIRTY = {True: "(dirty)", None: "(dirty?)"}


def dirty_mark(run: Run | None) -> str:
    return "" if run is None or run.first.get("dirty", False) is False else " " + DIRTY[run.first["dirty"]]


def claim_cells(c: Claim, history: History) -> list[str]:
    """measured (with its mark), target, met, hardware, commit and date."""
    mark = MARKS.get(claim_status(c, history))
    figure = c.figure() + (f" {mark}" if mark else "")
    if c.run is None:
        return [figure, c.target(), c.met(), "model of H200 rows", ""]
    when = f"`{c.run.first['commit'][:7]}`{dirty_mark(c.run)} {c.run.first['date'][:10]}"
    return [figure, c.target(), c.met(), c.run.hardware(c.row), when]


def legend(claims: list[Claim], history: History) -> str:
    """The lead of a claims table: what its columns and marks say (the marks it uses)."""
    states = {claim_status(c, history) for c in claims}
    dirty = {c.run.first.get("dirty", False) for c in claims if c.run}
    text = ("Each figure against its target (met: figure ≥ target, figure ≤ a target written ≤, or "
            f"|figure| ≤ its bound), measured on the hardware, commit and date shown. {MARKS['STALE']} "
            "marks a figure whose measured code (the library, the recipe or the benchmark script) has "
            "changed since that commit: it holds for that commit, not necessarily for the code in front "
            "of you, until it is measured again (changes to comments, docstrings or formatting do not "
            "count).")
    if "unknown" in states:
        text += f" {MARKS['unknown']}: whether that code changed cannot be told here (see the note above)."
    if True in dirty:
        text += f" {DIRTY[True]}: measured with changes not yet committed."
    if None in dirty:
        text += (f" {DIRTY[None]}: measured from a copy of the tree that could not be compared with the "
                 "commit, so it may have had changes.")
    return text


def claims_table(claims: list[Claim], history: History, link_prefix: str) -> list[str]:
    body = []
    for c in claims:
        bench = c.run.first["bench"] if c.run else "layer-model"
        where = f"[{bench if c.run else 'model'}]({link_prefix}#{bench})"
        body.append([c.spec["claim"], *claim_cells(c, history), where])
    return _table(["claim", "measured", "target", "met", "hardware", "commit, date", "data"], body)


# ------------------------------------------------------------------------------ the documents
def render_report(runs: dict[str, Run], claims: list[Claim], history: History) -> str:
    out = ["# Results", "",
           "Generated by `python -m benchmarks.report` from the rows in `benchmarks/results/` and the claims",
           "in `benchmarks/claims.yaml`; edit those, not this file. A run is **STALE** when the code its bench",
           "measures (the paths under its title; Python compared by syntax tree, so comments, docstrings and",
           "formatting do not count) differs between the run's commit and HEAD: its figures hold for that",
           "commit, not for the code in front of you. Ratios are speed-ups (> 1: faster than the baseline).",
           "Each benchmark run writes one `<date>_<commit7>_<machine>_<bench>.jsonl` file through",
           "`benchmarks/rows.py`; after adding rows, or merging code they measure, rerun the report.", ""]
    if history.problem:
        out += [f"> Note: {history.problem}.", ""]
    out += ["## Claims", "", legend(claims, history), ""] + claims_table(claims, history, "") + [""]
    out += ["## Runs", ""]
    body = [[f"`{r.name}`", r.first["bench"], f"`{r.first['commit'][:7]}`", r.first["date"][:10], r.hardware(),
             history.status(r.first["commit"], r.bench.paths)] for r in runs.values()]
    out += _table(["run", "bench", "commit", "date", "machine", "status"], body) + [""]
    by_bench: dict[str, list[Run]] = {}
    for r in runs.values():
        by_bench.setdefault(r.first["bench"], []).append(r)
    order = [b for b in BENCHES if b in by_bench] + sorted(b for b in by_bench if b not in BENCHES)
    for name in order:
        bench = by_bench[name][0].bench
        out += [f"## {name}", "", f"{bench.title}. Measures: {', '.join(f'`{p}`' for p in bench.paths)}.", ""]
        if bench.baselines:
            ratio = f"its {bench.key} / this {bench.key}" if bench.better == "lower" else \
                f"this {bench.key} / its {bench.key}"
            out += [f"`vs <arm>`: speed-up over that arm ({ratio}) among rows with the same "
                    f"{', '.join(bench.group)}.", ""]
        for run in reversed(by_bench[name]):  # newest first
            out += run_header(run, history) + run_table(run) + [""]
    out += model_sections()
    return "\n".join(out).rstrip() + "\n"


def model_sections() -> list[str]:
    sm = speed_model
    out = ["## layer model", "",
           "`benchmarks/speed_model.py`: the DeepSeek-V3-like layer priced as its no-wire floor (one rank's",
           f"share on one GPU, `{sm.FLOOR_RUN}`) plus its four legs' bytes at the SM-store ceiling",
           f"({sm.NVLINK_SYMM.gbps:g} GB/s, `{sm.KERNELS_RUN}`), every leg once per token and rank;",
           f"torchtitan's EP=2 time from `{sm.LAYER_RUN}`. A model, not a measurement (docs/performance.md).", ""]
    out += sm.format_layer_model(sm.layer_model_rows()).splitlines()
    out += ["", f"Checked against `{sm.LAYER_RUN}` in the layout its code sent (dispatch's forward once per",
            "token and rank, the other legs row by row):", ""]
    out += sm.format_layer_model(sm.layer_model_checks()).splitlines()
    out += ["", "## leg model", "",
            "The exchange-leg model of `benchmarks/speed_model.py`. Its constants, each read from the rows",
            "named in `speed_model.FITS` or assumed:", ""]
    body = [[link.name, link.gbps, link.latency_ms, link.source] for link in sm.links().values()]
    out += _table(["link", "GB/s", "latency ms", "from"], body) + [""]
    h, n = sm.default_hbm(), sm.default_nccl()
    out += _table(["fitted", "value"], [
        ["HBM passes (gather, permute, push, receive)", f"{h.pass_gbps:,.0f} GB/s"],
        ["HBM, the unfused MXFP8 extra passes", f"{h.unfused_gbps:,.0f} GB/s"],
        ["fused nccl dispatch, fixed", f"{n.fused_dispatch_ms:.2f} ms"],
        ["torchtitan dispatch, fixed", f"{n.titan_dispatch_ms:.2f} ms"],
        ["torchtitan combine, extra HBM passes", f"{n.titan_combine_bytes:.1f} B/element"]]) + [""]
    out += ["Predicted against the runs its constants are fit to (role `fit`: one of the row's two times was",
            "fit; the other is still a prediction):", ""]
    out += sm.format_checks(sm.check_runs(sm.FIT_RUNS)).splitlines()
    out += ["", "Predicted MXFP8 speed-up over bf16, one leg, EP=2, even routing:", ""]
    out += sm.format_predictions(sm.prediction_rows(2)).splitlines()
    out += ["", "One DeepSeek-V3-like leg (65536 rows x 7168 per GPU) on 8-GPU nodes:", ""]
    out += sm.format_multinode(sm.multinode_rows()).splitlines()
    return out + [""]


def render_readme_block(claims: list[Claim], history: History) -> str:
    shown = [c for c in claims if c.spec.get("readme")]
    body, refs = [], {}
    for c in shown:
        bench = c.run.first["bench"] if c.run else "layer-model"
        refs[bench] = f"docs/results.md#{bench}"
        figure, target, met, hardware, when = claim_cells(c, history)
        hardware = hardware.replace("× ", "×").replace(", ", " ")
        body.append([c.spec.get("short", c.spec["claim"]), figure, target, met, hardware, when, f"[{bench}]"])
    lines = _table(["result", "measured", "target", "met", "hardware", "commit, date", "data"], body)
    note = ["", "[docs/results.md](docs/results.md) has every run with its commit, date, versions and command.", ""]
    lead = [legend(shown, history), ""]
    if history.problem:
        lead = [f"Note: {history.problem}.", ""] + lead
    return "\n".join([BEGIN, *lead, *lines, *note, *(f"[{k}]: {v}" for k, v in refs.items()), END])


def splice_readme(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with what lies from ``begin`` to ``end`` replaced by ``block`` (which holds them)."""
    if begin not in text or end not in text:
        raise ValueError(f"README.md has no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + block + tail


def render_numerics_block(runs: dict[str, Run], history: History) -> str:
    """The README's Numerics table (``benchmarks.parity_table``) with the runs' marks."""
    return parity_table.render(runs, lambda run: history.status(run.first["commit"], run.bench.paths), MARKS, REPO)


def render_capacity_block(runs: dict[str, Run], history: History) -> str:
    """The README's elastic-capacity figures (``benchmarks.capacity_figures``) with the runs' marks."""
    return capacity_figures.render(runs, lambda run: history.status(run.first["commit"], run.bench.paths), MARKS)


def build(history: History | None = None) -> tuple[str, str]:
    """(docs/results.md, the README with its block rewritten)."""
    history = history or History()
    runs = load_runs()
    claims = [evaluate(spec, runs) for spec in load_claims()]
    broken = [f"{c.id}: {c.error}" for c in claims if c.error]
    if broken:
        raise ValueError("claims that no row backs:\n  " + "\n  ".join(broken))
    readme = splice_readme(README.read_text(), render_readme_block(claims, history))
    readme = splice_readme(readme, render_numerics_block(runs, history), parity_table.BEGIN, parity_table.END)
    readme = splice_readme(readme, render_capacity_block(runs, history), capacity_figures.BEGIN, capacity_figures.END)
    return render_report(runs, claims, history), readme


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = p.parse_args(argv)
    history = History()
    if history.problem:
        print(f"note: {history.problem}", file=sys.stderr)
    try:
        report, readme = build(history)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    targets = ((REPORT, report), (README, readme))
    if not args.check:
        for path, text in targets:
            path.write_text(text)
        print(f"wrote {REPORT.relative_to(REPO)} and the results block and Numerics table of "
              f"{README.relative_to(REPO)}")
        return 0
    differ = False
    for path, text in targets:
        old = path.read_text() if path.exists() else ""
        if old != text:
            differ = True
            rel = str(path.relative_to(REPO))
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       f"{rel} (committed)", f"{rel} (generated)"))
    if differ:
        if history.problem:
            print(f"\nThe report differs, but {history.problem}; the STALE marks cannot be judged without"
                  " the history.", file=sys.stderr)
        else:
            print("\nThe committed report is not what `python -m benchmarks.report` makes of the committed rows"
                  " and history: run it and commit the result.", file=sys.stderr)
        return 1
    print("docs/results.md and the README's results block and Numerics table are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
