"""What SLURM itself says, in ``launcher.*`` terms: whether its controller is up and the
partitions ``sinfo`` lists (checked before submitting), and what an sbatch refusal means (after).

Both answer the same question for the user: which option to change. Nothing here imports
submitit or torch; ``scontrol`` and ``sinfo`` are asked only when they are on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Optional

from launch.config.problems import Report, choice_problem

# sinfo against a controller that is down retries for ~10 s (`scontrol ping` says so at once);
# the checks before launch must stay fast.
SINFO_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    nodes: int
    # Most GPUs (gres/gpu) any of its nodes has; 0 without GPUs.
    gpus_per_node: int
    # MaxTime in minutes; None = no limit.
    time_limit_min: Optional[int]


@dataclass(frozen=True)
class ClusterView:
    """The partitions sinfo listed, or why it could not list them."""

    partitions: dict[str, Partition]
    error: Optional[str] = None
    # sinfo gave no answer in time, though `scontrol ping` did not say the controller is down (a
    # slow controller): the checks are left to sbatch.
    timed_out: bool = False

    @property
    def default(self) -> Optional[Partition]:
        return next((p for p in self.partitions.values() if p.default), None)


def controller_down() -> Optional[str]:
    """``scontrol ping``'s line when it says every controller (primary, backups) is down; None
    when one is up, or when that cannot be known (no scontrol on PATH, no answer in time, an
    answer without controller lines: then sinfo says what is wrong)."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "ping"], capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError):
        return None
    controllers = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("Slurmctld(")]
    if controllers and all(line.endswith("DOWN") for line in controllers):
        return f"scontrol ping: {'; '.join(controllers)}"
    return None


def partitions() -> Optional[ClusterView]:
    """Ask ``sinfo`` (after ``scontrol ping``: a controller that is down is said at once);
    None when sinfo is not on PATH (not a SLURM login node)."""
    exe = shutil.which("sinfo")
    if exe is None:
        return None
    down = controller_down()
    if down is not None:
        return ClusterView({}, down)
    try:
        out = subprocess.run([exe, "-h", "-o", "%P|%D|%G|%l"], capture_output=True, text=True,
                             timeout=SINFO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ClusterView({}, f"sinfo did not answer within {SINFO_TIMEOUT_S:.0f} s", timed_out=True)
    except OSError as e:
        return ClusterView({}, f"sinfo could not run: {e}")
    if out.returncode != 0:
        return ClusterView({}, (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1])
    return ClusterView(parse_sinfo(out.stdout))


def parse_sinfo(text: str) -> dict[str, Partition]:
    """Partitions from ``sinfo -h -o '%P|%D|%G|%l'`` (a line per partition and node group)."""
    found: dict[str, Partition] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4:
            continue
        name, nodes, gres, limit = fields
        default = name.endswith("*")
        name = name.rstrip("*")
        p = found.get(name)
        nodes_n = int(nodes) if nodes.isdigit() else 0
        gpus = gpus_in_gres(gres)
        if p is None:
            found[name] = Partition(name, default, nodes_n, gpus, parse_time_min(limit))
        else:
            found[name] = Partition(name, p.default or default, p.nodes + nodes_n,
                                    max(p.gpus_per_node, gpus), p.time_limit_min)
    return found


def gpus_in_gres(gres: str) -> int:
    """GPUs in a node's GRES string: ``gpu:8``, ``gpu:h100:8(S:0-1)``, ``(null)`` -> 8, 8, 0."""
    total = 0
    for item in gres.split(","):
        item = item.split("(")[0].strip()
        if item.startswith("gpu"):
            count = item.rsplit(":", 1)[-1]
            total += int(count) if count.isdigit() else 1
    return total


def parse_time_min(limit: str) -> Optional[int]:
    """SLURM's time format (``infinite``, ``MM:SS``, ``HH:MM:SS``, ``D-HH:MM:SS``, minutes) in
    whole minutes; None = no limit."""
    limit = limit.strip().lower()
    if not limit or limit in ("infinite", "unlimited", "n/a"):
        return None
    days, _, rest = limit.rpartition("-")
    parts = [int(x) for x in rest.split(":") if x.isdigit()]
    if len(parts) == 1:
        minutes = parts[0]
    elif len(parts) == 2:
        minutes = parts[0] + (parts[1] > 0)  # MM:SS
    elif len(parts) == 3:
        minutes = parts[0] * 60 + parts[1] + (parts[2] > 0)
    else:
        return None
    return minutes + (int(days) * 24 * 60 if days.isdigit() else 0)


def _gpu_request(cfg: Any, gpus: int) -> str:
    lc = cfg.launcher
    if lc.gpus_per_node is None:
        return (f"{gpus} GPUs per node (launcher.gpus_per_node=null: one per process of "
                f"parallelism={cfg.parallelism.name})")
    return f"{gpus} GPUs per node (launcher.gpus_per_node={gpus})"


def _cpu_fix(view: ClusterView) -> str:
    with_gpus = sorted(p.name for p in view.partitions.values() if p.gpus_per_node)
    fix = "set launcher.gpus_per_node=0 to run CPU processes (gloo) on a cluster without GPUs"
    if with_gpus:
        fix += f", or launcher.partition=<one with GPUs: {', '.join(with_gpus)}>"
    return fix


def check_request(cfg: Any, gpus: int, report: Report, view: Optional[ClusterView] = None) -> None:
    """What the job asks for against what sinfo lists: the partition, GPUs per node, nodes
    and the time limit. Nothing is checked without sinfo."""
    view = view if view is not None else partitions()
    if view is None:
        return
    if view.error is not None:
        if view.timed_out:
            report.warn(f"launcher=slurm: {view.error}; the partition and GPUs are checked only "
                        f"when sbatch submits")
        else:
            report.error(f"launcher=slurm: SLURM does not answer ({view.error}); check that the "
                         f"cluster is up (`scontrol ping`), or use launcher=local")
        return
    lc, p = cfg.launcher, cfg.parallelism
    names = sorted(view.partitions)
    if lc.partition:
        part = view.partitions.get(lc.partition)
        if part is None:
            report.error(f"{choice_problem('launcher.partition', lc.partition, names)} "
                         f"(the partitions sinfo lists)")
            return
    else:
        part = view.default
        if part is None:
            report.error(f"SLURM has no default partition: set launcher.partition=<one of {names}>")
            return
    which = f"partition {part.name}" + ("" if lc.partition else " (SLURM's default)")
    if gpus > 0 and part.gpus_per_node == 0:
        report.error(f"the job asks for {_gpu_request(cfg, gpus)}, but {which} has no GPUs "
                     f"(sinfo lists no gres/gpu); {_cpu_fix(view)}")
    elif gpus > part.gpus_per_node:
        report.error(f"the job asks for {_gpu_request(cfg, gpus)}, but the nodes of {which} have at "
                     f"most {part.gpus_per_node}; use a parallelism with parallelism.procs_per_node"
                     f" <= {part.gpus_per_node}, or another launcher.partition")
    if p.nodes > part.nodes:
        report.error(f"parallelism.nodes={p.nodes}, but {which} has {part.nodes} node(s); use "
                     f"parallelism.nodes <= {part.nodes} or another launcher.partition")
    if part.time_limit_min is not None and lc.time_min > part.time_limit_min:
        report.error(f"launcher.time_min={lc.time_min} exceeds the time limit of {which} "
                     f"({part.time_limit_min} min); use launcher.time_min<={part.time_limit_min} "
                     f"(a timed-out job requeues and resumes from its checkpoint)")


# sbatch's messages (SLURM 22.05-24.x, lower case) and the option each one is about.
_REFUSALS: list[tuple[str, str]] = [
    ("invalid partition", "launcher.partition (`sinfo` lists the partitions)"),
    ("invalid generic resource", "launcher.gpus_per_node"),
    ("gres", "launcher.gpus_per_node"),
    ("invalid account", "launcher.account (with launcher.partition; `sacctmgr show assoc user=$USER` "
                        "lists yours)"),
    ("invalid qos", "launcher.qos (`sacctmgr show qos` lists them)"),
    ("qos", "launcher.qos"),
    ("time limit", "launcher.time_min (`sinfo -o '%P %l'` shows each partition's limit)"),
    ("invalid feature", "launcher.constraint (`sinfo -o '%P %f'` lists the node features)"),
    ("node count", "parallelism.nodes"),
    ("memory", "launcher.mem_gb"),
    ("more processors requested", "launcher.cpus_per_task or parallelism.procs_per_node"),
    ("node configuration is not available",
     "parallelism.nodes / procs_per_node, launcher.gpus_per_node, cpus_per_task, mem_gb or "
     "constraint (more than any node of the partition has)"),
    ("reservation", "launcher.additional_parameters.reservation"),
    ("unable to contact slurm controller", "nothing in the config: SLURM's controller is not up "
                                           "(`scontrol ping`)"),
]


def explain_refusal(stderr: str, cfg: Any, gpus: int) -> str:
    """One message for sbatch's refusal: sbatch's own error line and the option to change."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()] or lines or ["(no message)"]
    said = errors[-1]
    text = " ".join(errors).lower()
    option = next((opt for key, opt in _REFUSALS if key in text), None)
    msg = f"SLURM refused the job: {said}"
    if option is None:
        return f"{msg}. Check the launcher.* options (partition, account, qos, gpus_per_node, time_min)"
    if option == "launcher.gpus_per_node" and gpus:
        option = (f"launcher.gpus_per_node: the job asks for {_gpu_request(cfg, gpus)}; set "
                  f"launcher.gpus_per_node=0 on a cluster without GPUs, or pick a partition with "
                  f"GPUs (launcher.partition)")
    return f"{msg}. Change {option}"
