"""`python launch/train.py launcher=slurm` end to end on the local SLURM cluster.

Real jobs: 2 fake nodes, gloo on CPU, the tiny Llama4 model, a few steps. Faults are injected
through the worker's existing `MXFP8EP_RUNNER` hook with tests/slurm/slurm_fault_runner.py
(this folder on PYTHONPATH, which sbatch passes on to the job). Every wait is bounded; jobs
left behind by a failing test are cancelled.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch.run.run_summary import LOSS, RunSummary
from launch.run.wandb_offline import read_run, read_runs
from tests.slurm.polling import wait_until
from tests.train_cli import TRAIN, train_cmd, train_env

pytestmark = pytest.mark.slurm

HERE = Path(__file__).resolve().parent

# CPU fake nodes: no GPUs to request; one gloo process per task.
SLURM_CPU = [
    "launcher=slurm",
    "launcher.partition=debug",
    "launcher.gpus_per_node=0",
    "launcher.time_min=10",
    "parallelism.nodes=2",
    "parallelism.ep=2",
]
_TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
             "BOOT_FAIL", "DEADLINE", "PREEMPTED")


# ------------------------------------------------------------------------------------ helpers
def _sh(*args: str, timeout: float = 20) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout).stdout


@pytest.fixture
def train(slurm_cluster, tmp_path):
    """Run launch/train.py (cwd: the test's tmp dir) and cancel every job it submitted at the
    end of the test."""
    submitted: list[str] = []

    def run(args: list[str], timeout: float, extra_env: dict[str, str] | None = None):
        env = train_env(**slurm_cluster.env, HYDRA_FULL_ERROR="1", **(extra_env or {}))
        try:
            proc = subprocess.run(
                train_cmd(*args), cwd=tmp_path, env=env, capture_output=True, text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            out = _text(e.stdout) + _text(e.stderr)
            submitted.extend(re.findall(r"submitted SLURM job (\d+)", out))  # cancelled below
            pytest.fail(f"launch/train.py still running after {timeout}s:\n{out[-3000:]}")
        out = proc.stdout + proc.stderr
        submitted.extend(re.findall(r"submitted SLURM job (\d+)", out))
        return proc, out

    run.jobs = submitted  # type: ignore[attr-defined]
    yield run
    live = set(_sh("squeue", "-h", "-o", "%i").split())
    for jid in submitted:
        if jid in live:
            subprocess.run(["scancel", jid], timeout=10, check=False)


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _fault_env(**kv: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(HERE), train_env()["PYTHONPATH"]) if p)
    return {"PYTHONPATH": path, "MXFP8EP_RUNNER": "slurm_fault_runner:run_training", **kv}


def _job_state(jid: str) -> str:
    out = _sh("sacct", "-X", "-n", "-P", "-j", jid, "-o", "State").split("\n")
    return out[0].split()[0] if out and out[0].strip() else "UNKNOWN"


def _wait_terminal(jid: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = _job_state(jid)
        if state.startswith(_TERMINAL):
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"SLURM job {jid} still {state} after {timeout}s")
        time.sleep(1)


def _next_job_id() -> int:
    m = re.search(r"NEXT_JOB_ID\s*=\s*(\d+)", _sh("scontrol", "show", "config"))
    assert m, "scontrol show config has no NEXT_JOB_ID"
    return int(m.group(1))


def _losses(run) -> dict[int, float]:
    return {int(h["_step"]): float(h[LOSS]) for h in run.history if LOSS in h}


# ------------------------------------------------------------------------------------ tests
def test_two_nodes_two_procs_completes_with_metrics(train, tmp_path):
    run_dir = tmp_path / "run"
    proc, out = train(
        [*SLURM_CPU, "parallelism.procs_per_node=2", "training.steps=6", "launcher.wait=true",
         "logging=wandb_offline", f"hydra.run.dir={run_dir}"],
        timeout=240,
    )
    assert proc.returncode == 0, out[-4000:]
    (jid,) = train.jobs
    assert f"SLURM job {jid} COMPLETED" in out
    assert _job_state(jid) == "COMPLETED"
    log = run_dir / "slurm" / f"{jid}_0_log.out"
    assert f"log (task 0): {log}" in out and log.exists()
    assert sorted(p.name for p in (run_dir / "slurm").glob(f"{jid}_*_log.out")) == [
        f"{jid}_{t}_log.out" for t in range(4)
    ]

    summary = RunSummary.read(run_dir)
    assert summary.world_size == 4 and summary.launcher == "slurm" and summary.steps == 6
    losses = summary.losses
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]  # it trains
    assert summary.tokens_per_s_global > 0
    # launcher.wait=true: the job's console lines and its summary on this console
    assert out.count("step ") >= 6 and "==== mxfp8ep run" in out

    (wb,) = read_runs(str(run_dir))
    assert wb.exit_code == 0
    wl = _losses(wb)
    assert sorted(wl) == [1, 2, 3, 4, 5, 6]
    assert [wl[s] for s in range(1, 7)] == pytest.approx(losses, rel=1e-6)


def test_two_hop_across_two_nodes_trains_as_the_flat_all_to_all(train, tmp_path):
    """EP 4 over both nodes (2 ranks each): two_hop, each token once per node across them and
    fanned out inside the node, loses what the flat nccl all-to-all loses at each step, within
    fp32 sums in another order (tests/test_two_hop_e2e.py's ``ORDER_TOL``), and its summary and
    console name it. The fake nodes share one host name, so the nodes are given as
    ``a2a.ranks_per_node=2`` (the ranks SLURM puts on each)."""
    from tests.test_two_hop_e2e import ORDER_TOL

    common = [*(o for o in SLURM_CPU if not o.startswith("parallelism.ep=")), "parallelism.procs_per_node=2",
              "parallelism.ep=4", "model=tiny_dsv3", "training.steps=3", "launcher.wait=true", "logging=none"]
    summaries, consoles = {}, {}
    for transport, extra in (("two_hop", ["a2a.ranks_per_node=2"]), ("nccl", [])):
        run_dir = tmp_path / transport
        proc, out = train([*common, f"a2a.transport={transport}", *extra, f"hydra.run.dir={run_dir}"], timeout=300)
        assert proc.returncode == 0, out[-4000:]
        summaries[transport], consoles[transport] = RunSummary.read(run_dir), out
    s, flat = summaries["two_hop"], summaries["nccl"]
    assert s.launcher == "slurm" and s.world_size == s.ep == 4 and (s.transport, flat.transport) == ("two_hop", "nccl")
    assert len(s.losses) == len(flat.losses) == 3
    for step, (mine, theirs) in enumerate(zip(s.losses, flat.losses, strict=True), start=1):
        assert abs(mine - theirs) <= ORDER_TOL * abs(theirs), f"step {step}: two_hop {mine} vs nccl {theirs}"
    assert s.a2a_bytes_per_step_by_leg["inter_node"] > 0
    assert "a2a bf16 over two_hop" in consoles["two_hop"] and "a2a bf16 over nccl" in consoles["nccl"]


def test_multirun_submits_one_job_per_point(train, tmp_path):
    sweep = tmp_path / "multirun"
    proc, out = train(
        ["--multirun", "a2a=bf16,mxfp8", *SLURM_CPU, "parallelism.procs_per_node=1",
         "training.steps=3", "logging=none", f"hydra.sweep.dir={sweep}"],
        timeout=120,
    )
    assert proc.returncode == 0, out[-4000:]
    jobs = train.jobs
    assert len(jobs) == 2 and len(set(jobs)) == 2, out[-3000:]
    # launcher.wait=false: both are submitted before either is waited for; they run side by side
    states = [_wait_terminal(jid, 180) for jid in jobs]
    assert states == ["COMPLETED", "COMPLETED"]
    summaries = sorted((RunSummary.read(p) for p in sweep.glob("*/summary.json")), key=lambda s: s.a2a)
    assert [s.a2a for s in summaries] == ["bf16", "mxfp8"]
    for s in summaries:
        assert s.steps == 3 and math.isfinite(s.final_loss)
    assert summaries[1].a2a_legs != summaries[0].a2a_legs
    # folder names leave the launcher overrides out
    named = "parallelism.ep=2,parallelism.nodes=2,parallelism.procs_per_node=1,others="
    assert sorted(p.name.split(",others=")[0] + ",others=" for p in sweep.iterdir() if p.is_dir()) == [
        f"0_a2a=bf16,{named}", f"1_a2a=mxfp8,{named}"]
    assert f"python launch/compare_runs.py {sweep}" in out
    assert "locally" not in out  # Hydra's "Launching 2 jobs locally": they went to SLURM


def test_crash_on_one_rank_is_failed_with_log_path(train, tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc, out = train(
        [*SLURM_CPU, "parallelism.procs_per_node=1", "training.steps=6", "launcher.wait=true",
         "logging=none", f"hydra.run.dir={run_dir}"],
        timeout=240,
        extra_env=_fault_env(MXFP8EP_TEST_CRASH_RANK="1", MXFP8EP_TEST_CRASH_STEP="3"),
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, out[-3000:]
    (jid,) = train.jobs
    m = re.search(rf"SLURM job {jid} FAILED; see (\S+)", out)
    assert m, out[-3000:]
    assert Path(m.group(1)).exists()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert _job_state(jid) == "FAILED"
    crashed_log = run_dir / "slurm" / f"{jid}_1_log.out"  # rank 1 = task 1, on n2
    assert "injected crash at step 3" in crashed_log.read_text()
    print(f"crash reported after {elapsed:.1f}s")


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallelism.ep=3", "parallelism.ep=3 must divide"),  # recipe validation
        ("launcher.partitoin=debug", "partitoin"),  # typo: schema rejects at composition
    ],
    ids=["validation", "typo"],
)
def test_invalid_config_is_rejected_before_submission(train, tmp_path, override, message):
    run_dir = tmp_path / "run"
    queued_before = set(_sh("squeue", "-h", "-o", "%i").split())
    next_id = _next_job_id()
    proc, out = train(
        [*SLURM_CPU, "parallelism.procs_per_node=2", "logging=none", override,
         f"hydra.run.dir={run_dir}"],
        timeout=120,
    )
    assert proc.returncode != 0
    assert message in out, out[-3000:]
    assert "submitted SLURM job" not in out
    assert _next_job_id() == next_id  # sbatch was never called
    assert set(_sh("squeue", "-h", "-o", "%i").split()) <= queued_before
    assert not (run_dir / "slurm").exists()


# What a user types first (issue 29): each is one message naming the option to change, exit 2,
# no traceback, nothing submitted, no run folder. The cluster has no GPUs and partitions
# debug (default) and short.
README_TWO_NODES = ["parallelism=2nodes_8gpus", "model=dsv3_16b", "a2a=mxfp8",
                    "launcher.partition=gpu", "launcher.account=myproj"]


@pytest.mark.parametrize("overrides, message", [
    ([], "the job asks for 2 GPUs per node (launcher.gpus_per_node=null: one per process of "
         "parallelism=ep2), but partition debug (SLURM's default) has no GPUs (sinfo lists no "
         "gres/gpu); set launcher.gpus_per_node=0"),
    (README_TWO_NODES, "launcher.partition='gpu': use one of ['debug', 'short'] (the partitions "
                       "sinfo lists)"),
    (["launcher.partition=nosuch"], "launcher.partition='nosuch': use one of ['debug', 'short']"),
    (["launcher.partition=shrt", "launcher.gpus_per_node=0", "launcher.time_min=10"],
     "did you mean launcher.partition=short?"),
    (["launcher.partition=short", "launcher.gpus_per_node=0", "launcher.time_min=10"],
     "launcher.time_min=10 exceeds the time limit of partition short (5 min)"),
], ids=["no_options", "readme_two_nodes", "no_such_partition", "partition_typo", "time_limit"])
def test_what_the_cluster_cannot_run_is_refused_before_sbatch(train, tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    next_id = _next_job_id()
    proc, out = train(["launcher=slurm", "logging=none", *overrides, f"hydra.run.dir={run_dir}"],
                      timeout=120)
    assert proc.returncode == 2, out[-3000:]
    assert proc.stderr.splitlines() == ["[mxfp8ep] 1 problem(s) in the training config:",
                                        proc.stderr.splitlines()[1]]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert _next_job_id() == next_id  # sbatch was never called
    assert not run_dir.exists()


@pytest.fixture
def without_sinfo(tmp_path) -> dict[str, str]:
    """PATH with the SLURM clients but sinfo: what the validator cannot check, sbatch refuses."""
    import shutil
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun", "squeue", "sacct", "scancel", "scontrol"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return {"PATH": f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}"}


@pytest.mark.parametrize("overrides, said, option", [
    ([], "sbatch: error: Invalid generic resource (gres) specification",
     "Change launcher.gpus_per_node: the job asks for 2 GPUs per node"),
    (["launcher.gpus_per_node=0", "launcher.partition=nosuch"],
     "Invalid partition name specified", "Change launcher.partition"),
    (["launcher.gpus_per_node=0", "launcher.partition=short", "launcher.time_min=10"],
     "Requested time limit is invalid", "Change launcher.time_min"),
], ids=["gpus", "partition", "time_limit"])
def test_sbatch_refusals_are_one_message(train, tmp_path, without_sinfo, overrides, said, option):
    run_dir = tmp_path / "run"
    next_id = _next_job_id()
    proc, out = train(["launcher=slurm", "logging=none", "training.checkpoint_enable=true",
                       *overrides, f"hydra.run.dir={run_dir}"], timeout=120, extra_env=without_sinfo)
    assert proc.returncode == 2, out[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("[mxfp8ep] SLURM refused the job: ") and said in line and option in line
    assert _next_job_id() == next_id  # refused: no job id was used


def test_a_controller_that_is_down_is_refused_before_sbatch(slurm_cluster, tmp_path):
    """The SLURM clients pointed at a controller that is not there (ports nothing listens on):
    `scontrol ping` says it is down, and the launch stops there with one line, exit 2, no run
    folder; sinfo would have retried ~10 s and then only warned, sbatch retried and refused."""
    import socket

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ctld, slurmd = a.getsockname()[1], b.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=down\nSlurmctldHost=localhost\nSlurmctldPort={ctld}\n"
                    f"SlurmdPort={slurmd}\nAuthType=auth/munge\nNodeName=n1 CPUs=2 State=UNKNOWN\n"
                    f"PartitionName=debug Nodes=n1 Default=YES MaxTime=INFINITE State=UP\n")
    proc = subprocess.run(train_cmd("launcher=slurm", "launcher.gpus_per_node=0", "logging=none"),
                          cwd=tmp_path, env=train_env(SLURM_CONF=str(conf)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    head, line = proc.stderr.splitlines()
    assert head == "[mxfp8ep] 1 problem(s) in the training config:"
    assert re.fullmatch(r"  - launcher=slurm: SLURM does not answer \(scontrol ping: Slurmctld\(primary\) "
                        r"at \S+ is DOWN\); check that the cluster is up \(`scontrol ping`\), or use "
                        r"launcher=local", line), line
    assert not (tmp_path / "outputs").exists()


def test_preempted_job_requeues_and_resumes_from_checkpoint(train, tmp_path):
    run_dir = tmp_path / "run"
    steps = 10
    proc, out = train(
        [*SLURM_CPU, "parallelism.procs_per_node=1", f"training.steps={steps}",
         "training.checkpoint_enable=true", "training.checkpoint_interval=2",
         "logging=wandb_offline", f"hydra.run.dir={run_dir}"],
        timeout=120,
        extra_env=_fault_env(MXFP8EP_TEST_STEP_SLEEP="0.7"),  # room to preempt mid-run
    )
    assert proc.returncode == 0, out[-3000:]
    (jid,) = train.jobs
    log = run_dir / "slurm" / f"{jid}_0_log.out"

    def past_first_checkpoint() -> bool:
        text = log.read_text() if log.exists() else ""
        return (run_dir / "checkpoint" / "step-4" / ".metadata").exists() and "step:  5/" in text

    wait_until(past_first_checkpoint, 150, "step 5 (after the step-4 checkpoint)")
    # What SLURM sends ahead of a preemption or the time limit (--signal=USR2@90).
    subprocess.run(["scancel", "--signal=USR2", jid], check=True, timeout=10)

    # SLURM 22.05 holds a requeued job for 120 s (Reason=BeginTime): release it at once.
    def restarted() -> bool:
        info = _sh("scontrol", "-o", "show", "job", jid)
        if "Restarts=0" in info:
            return False
        if "JobState=PENDING" in info:
            subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"],
                           timeout=10, check=False)
        # not COMPLETING/REQUEUED/PENDING: the second attempt runs (or already ended)
        return re.search(r"JobState=(RUNNING|COMPLETED|FAILED|CANCELLED|TIMEOUT)", info) is not None

    wait_until(restarted, 90, "the job to be requeued and restarted", interval=0.5)
    assert _wait_terminal(jid, 180) == "COMPLETED", log.read_text()[-3000:]
    history = _sh("sacct", "-D", "-X", "-n", "-P", "-j", jid, "-o", "State").split()
    assert history[0] == "REQUEUED" and history[-1] == "COMPLETED", history

    text = log.read_text()
    assert "Caught signal SIGUSR2" in text and "Calling checkpoint method" in text
    assert "requeued run (attempt 2)" in text
    m = re.search(r"Loading the checkpoint from \S+/step-(\d+)", text)
    assert m, text[-3000:]
    resumed_from = int(m.group(1))
    assert 4 <= resumed_from < steps

    summary = RunSummary.read(run_dir)
    assert summary.start_step == resumed_from and summary.steps == steps
    assert summary.logged_steps == list(range(1, steps + 1))  # both attempts

    # SIGUSR2 stopped attempt 1 at a step boundary with a checkpoint of that very step and a
    # finished wandb run: attempt 2 continues right after it, in the same wandb run.
    (run,) = read_runs(str(run_dir))
    assert len(run.paths) == 2 and run.exit_code == 0  # one offline folder per attempt
    first = read_run(run.paths[0])
    assert first.run_id == run.run_id and first.exit_code == 0
    l1, l2 = _losses(first), _losses(run)
    assert sorted(l1) == list(range(1, resumed_from + 1)), l1  # no logged step lost
    assert sorted(l2) == list(range(1, steps + 1))
    assert [l2[s] for s in sorted(l2)] == pytest.approx(summary.losses, rel=1e-6)
    # The loss continues: same weights and batches.
    assert l2[resumed_from + 1] < l1[1]


# ------------------------------------------------------------------ how a SLURM run ends
# Every way of stopping a run keeps its record whole: summary.json and the offline wandb run hold
# every step up to the last one trained (across resumes), the checkpoint of the stop is whole and
# nothing half-written is left, console.log says how the launch ended, and the launcher (when it
# waits) exits with the code the docs name after one line.
STOPPABLE = [*SLURM_CPU, "parallelism.procs_per_node=1", "training.checkpoint_enable=true",
             "training.checkpoint_interval=4", "logging=wandb_offline"]


def _start_train(tmp_path: Path, slurm_cluster, args: list[str], **env: str) -> subprocess.Popen:
    """train.py in its own process group (a terminal's foreground job), steps slowed down."""
    return subprocess.Popen(
        train_cmd(*args), cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
        env=train_env(**slurm_cluster.env, **_fault_env(MXFP8EP_TEST_STEP_SLEEP="0.7", **env)))


def _steps_logged(run_dir: Path) -> int:
    """The step lines in the run's console.log; a run that ended failed fails the test at once
    (no step comes after it)."""
    console = run_dir / "console.log"
    lines = console.read_text().splitlines() if console.exists() else []
    failed = [line for line in lines if line.startswith("==== ended") and ": failed" in line]
    assert not failed, "\n".join(lines[-20:])
    return sum(line.startswith("step ") for line in lines)


def _job_of(run_dir: Path) -> str:
    return wait_until(lambda: next((p.name.split("_")[0] for p in (run_dir / "slurm").glob("*_0_log.out")), None)
                      if (run_dir / "slurm").is_dir() else None, 120, "the job's log")


def _check_record(run_dir: Path, stopped_by: str | None, steps: int | None = None) -> RunSummary:
    """summary.json, the wandb run (every step once, over every folder) and the checkpoints of a
    run that ended; ``steps``: the last step trained (default: the summary's)."""
    s = RunSummary.read(run_dir)
    assert s.stopped_by == stopped_by
    steps = steps or s.steps
    assert s.steps == steps and s.logged_steps == list(range(1, steps + 1)), s.logged_steps
    (run,) = read_runs(str(run_dir))
    assert [row["_step"] for row in run.history] == s.logged_steps and run.exit_code == 0
    assert run.series(LOSS) == pytest.approx(s.losses)
    assert sorted(row["_step"] for p in run.paths for row in read_run(p).history) == s.logged_steps
    if s.checkpoint:
        assert s.checkpoint == str(run_dir / "checkpoint" / f"step-{steps}")
    checkpoints = list((run_dir / "checkpoint").iterdir())
    assert all((d / ".metadata").is_file() for d in checkpoints), checkpoints  # whole, or not there
    return s


def test_scancel_and_ctrl_c_keep_the_runs_record_across_a_resume(train, slurm_cluster, tmp_path):
    """scancel of a job nobody waits for, then a resume whose waiting launcher gets Ctrl-C."""
    run_dir = tmp_path / "run"
    proc, out = train([*STOPPABLE, "training.steps=40", f"hydra.run.dir={run_dir}"], timeout=120,
                      extra_env=_fault_env(MXFP8EP_TEST_STEP_SLEEP="0.7"))
    assert proc.returncode == 0, out[-3000:]
    (jid,) = train.jobs
    wait_until(lambda: _steps_logged(run_dir) >= 6, 180, "step 6")
    subprocess.run(["scancel", jid], check=True, timeout=10)
    assert _wait_terminal(jid, 120) == "CANCELLED"
    wait_until(lambda: not _sh("squeue", "-h", "-j", jid).strip(), 60, "the job's processes to end")
    first = _check_record(run_dir, "SIGTERM")
    assert 6 <= first.steps < 40 and first.checkpoint
    assert (run_dir / "console.log").read_text().splitlines()[-1].endswith(
        f": stopped by SIGTERM at step {first.steps}/40 (checkpoint step-{first.steps}) ====")

    # Resume, wait for it, Ctrl-C: the tasks stop at a step boundary, the launcher says so.
    proc = _start_train(tmp_path, slurm_cluster, [f"training.resume={run_dir}", "launcher.wait=true"])
    try:
        wait_until(lambda: _steps_logged(run_dir) >= first.steps + 3, 180, "3 steps of the resume")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    train.jobs.extend(re.findall(r"submitted SLURM job (\d+)", out))
    assert proc.returncode == 130, (out[-3000:], err[-3000:])
    s = _check_record(run_dir, "SIGINT")
    assert s.start_step == first.steps and s.steps > first.steps + 2 and s.checkpoint
    assert err.splitlines() == [
        f"[mxfp8ep] stopping SLURM job {train.jobs[-1]} at the next step boundary (Ctrl-C again cancels it at once)",
        f"[mxfp8ep] stopped by SIGINT at step {s.steps}/40: checkpoint {s.checkpoint}, wandb run {s.wandb_run_id} "
        f"finished; continue with: python {TRAIN} training.resume={run_dir}"]
    assert _job_state(train.jobs[-1]) == "COMPLETED"  # the tasks stopped themselves
    assert (run_dir / "console.log").read_text().splitlines()[-1].endswith(
        f": stopped by SIGINT at step {s.steps}/40 (checkpoint step-{s.steps}) ====")


def test_scancel_of_a_job_nobody_waits_for_says_how_to_continue(train, tmp_path):
    """The job's log and console.log end with the stop line and its continue command, and the
    cancelled job's log does not say it completed."""
    run_dir = tmp_path / "run"
    proc, out = train([*STOPPABLE, "training.steps=40", "logging=none", f"hydra.run.dir={run_dir}"], timeout=120,
                      extra_env=_fault_env(MXFP8EP_TEST_STEP_SLEEP="0.7"))
    assert proc.returncode == 0, out[-3000:]
    (jid,) = train.jobs
    wait_until(lambda: _steps_logged(run_dir) >= 5, 180, "step 5")
    subprocess.run(["scancel", jid], check=True, timeout=10)
    assert _wait_terminal(jid, 120) == "CANCELLED"
    wait_until(lambda: not _sh("squeue", "-h", "-j", jid).strip(), 60, "the job's processes to end")
    s = RunSummary.read(run_dir)
    assert s.stopped_by == "SIGTERM" and s.checkpoint
    line = (f"[mxfp8ep] stopped by SIGTERM at step {s.steps}/40: checkpoint {s.checkpoint}; continue with: "
            f"python {TRAIN} training.resume={run_dir}")
    log = (run_dir / "slurm" / f"{jid}_0_log.out").read_text()
    assert line in log.splitlines() and "Job completed successfully" not in log, log[-3000:]
    console = (run_dir / "console.log").read_text().splitlines()
    assert console[-2] == line and console[-1].endswith(f": stopped by SIGTERM at step {s.steps}/40 "
                                                         f"(checkpoint step-{s.steps}) ====")
    assert f"  steps           {s.steps}/40 (stopped by SIGTERM)" in console  # the summary block


def test_scancel_of_a_waited_job_is_a_stop(train, slurm_cluster, tmp_path):
    """scancel while the launcher waits: exit 143 after the stop line, nothing lost."""
    run_dir = tmp_path / "run"
    proc = _start_train(tmp_path, slurm_cluster, [*STOPPABLE, "training.steps=40", "launcher.wait=true",
                                                   f"hydra.run.dir={run_dir}"])
    try:
        jid = _job_of(run_dir)
        train.jobs.append(jid)
        wait_until(lambda: _steps_logged(run_dir) >= 6, 180, "step 6")
        subprocess.run(["scancel", jid], check=True, timeout=10)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, (out[-3000:], err[-3000:])
    s = _check_record(run_dir, "SIGTERM")
    assert err.splitlines() == [
        f"[mxfp8ep] stopped by SIGTERM at step {s.steps}/40: checkpoint {s.checkpoint}, wandb run {s.wandb_run_id} "
        f"finished; continue with: python {TRAIN} training.resume={run_dir}"]
    assert "Traceback" not in out + err


def test_the_time_limit_with_no_requeue_left_stops_the_run(train, slurm_cluster, tmp_path):
    """SLURM's notice 90 s before the time limit (launcher.time_min=3) with no requeue left: the
    run stops with a checkpoint and the waiting launcher exits 140 (128 + SIGUSR2)."""
    run_dir = tmp_path / "run"
    proc = _start_train(tmp_path, slurm_cluster, [*STOPPABLE, "training.steps=400", "launcher.wait=true",
                                                   "launcher.time_min=3", "launcher.max_num_timeout=0",
                                                   "logging=none", f"hydra.run.dir={run_dir}"])
    try:
        train.jobs.append(_job_of(run_dir))
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 140, (out[-3000:], err[-3000:])
    s = RunSummary.read(run_dir)
    assert s.stopped_by == "SIGUSR2" and 0 < s.steps < 400 and s.logged_steps == list(range(1, s.steps + 1))
    assert (run_dir / "checkpoint" / f"step-{s.steps}" / ".metadata").is_file()
    assert err.splitlines() == [
        f"[mxfp8ep] stopped by SIGUSR2 (SLURM's notice of the time limit or a preemption; no requeue left) at "
        f"step {s.steps}/400: checkpoint {s.checkpoint}; continue with: python {TRAIN} training.resume={run_dir}"]
    assert _job_state(train.jobs[-1]) == "COMPLETED"


def test_ctrl_c_while_submitting_leaves_no_job_and_no_run(slurm_cluster, tmp_path):
    """launcher.wait=false returns at submission: a Ctrl-C can only come while sbatch runs. The
    job is submitted whole, then cancelled, and the launch leaves nothing (sbatch slowed down
    here so the Ctrl-C lands in it)."""
    import shutil
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    slow = bin_dir / "sbatch"
    slow.write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch-started\nsleep 3\nexec {shutil.which('sbatch')} \"$@\"\n")
    slow.chmod(0o755)
    env = train_env(**slurm_cluster.env, PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}"
                                             f"{os.pathsep}{os.environ['PATH']}")
    next_id = _next_job_id()
    proc = subprocess.Popen(train_cmd(*SLURM_CPU, "parallelism.procs_per_node=1", "logging=none",
                                      "training.checkpoint_enable=true",
                                      f"hydra.run.dir={tmp_path / 'run'}"),
                            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: (tmp_path / "sbatch-started").exists(), 120, "sbatch to start")
        proc.send_signal(signal.SIGINT)  # the launcher alone: sbatch carries on
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (out[-3000:], err[-3000:])
    assert err.splitlines() == ["[mxfp8ep] interrupted (SIGINT) before anything was started"]
    assert _next_job_id() == next_id + 1  # the job was submitted ...
    assert _wait_terminal(str(next_id), 60) == "CANCELLED"  # ... and cancelled before it ran
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------ one launch per run folder
def test_finishing_a_sweep_and_resuming_leave_running_and_queued_jobs_alone(train, slurm_cluster, tmp_path):
    """A two-point sweep whose first job runs and whose second is queued behind it (each job
    takes every CPU of both nodes): finishing the sweep leaves both points alone (no folder
    moved, nothing submitted), compare_runs says where they stand and writes nothing, and a
    second resume of either point is refused naming its job. The job stopped by scancel writes
    how it ended into summary.json itself (no launcher waits for it) and gives up its hold."""
    sweep = tmp_path / "sweep"
    args = ["--multirun", "a2a=bf16,mxfp8", *STOPPABLE, "logging=none", "training.steps=200",
            "launcher.cpus_per_task=2", f"hydra.sweep.dir={sweep}"]
    slow = _fault_env(MXFP8EP_TEST_STEP_SLEEP="0.7")
    proc, out = train(args, timeout=180, extra_env=slow)
    assert proc.returncode == 0, out[-3000:]
    running, queued = train.jobs
    points = sorted(p for p in sweep.iterdir() if p.is_dir())
    wait_until(lambda: _steps_logged(points[0]) >= 2, 180, "step 2 of the first point")
    assert _sh("squeue", "-h", "-j", queued, "-o", "%T").split() == ["PENDING"]
    listing = sorted(str(p.relative_to(sweep)) for p in sweep.rglob("*") if "slurm" not in p.parts)
    next_id = _next_job_id()

    proc, out = train(args, timeout=180, extra_env=slow)  # the printed "finish the sweep" command
    assert proc.returncode == 0, out[-3000:]
    assert (f"#0 (a2a=bf16) being trained by SLURM job {running} (running): left alone; #1 (a2a=mxfp8) being "
            f"trained by SLURM job {queued} (queued): left alone") in out, out[-3000:]
    assert "submitted SLURM job" not in out and _next_job_id() == next_id
    assert not Path(f"{sweep}.cut").exists()

    compared = subprocess.run(train_cmd()[:1] + [str(TRAIN.parent / "compare_runs.py"), str(sweep)], cwd=tmp_path,
                              env=train_env(**slurm_cluster.env), capture_output=True, text=True, timeout=120)
    assert compared.returncode == 1, compared.stderr[-3000:]
    assert "2 runs: 1 queued, 1 running, 0 done, 0 stopped, 0 failed" in compared.stderr
    assert not (sweep / "comparison.json").exists()

    for point, job, how in ((points[0], running, "running"), (points[1], queued, "queued")):
        proc, out = train([f"training.resume={point}", "training.steps=300", "training.lr_schedule_steps=300"],
                          timeout=120, extra_env=slow)
        assert proc.returncode == 2, out[-3000:]
        assert f"{point} is being trained by SLURM job {job} ({how}); nothing was started" in proc.stderr
    assert _next_job_id() == next_id  # nothing was submitted: no run is trained twice
    assert sorted(str(p.relative_to(sweep)) for p in sweep.rglob("*") if "slurm" not in p.parts
                  and "checkpoint" not in p.parts and p.name not in ("console.log",)) == [
        p for p in listing if "checkpoint" not in p and not p.endswith("console.log")]

    subprocess.run(["scancel", queued], check=True, timeout=10)
    subprocess.run(["scancel", running], check=True, timeout=10)
    assert _wait_terminal(running, 120) == "CANCELLED"
    wait_until(lambda: not _sh("squeue", "-h", "-j", running).strip(), 60, "the job's processes to end")
    s = RunSummary.read(points[0])
    assert s.stopped_by == "SIGTERM" and s.ended == f"stopped by SIGTERM at step {s.steps}/200 (checkpoint " \
                                                    f"step-{s.steps})" and s.ended_at
    assert not (points[0] / ".training").exists()  # the job gave up its hold as it ended
    assert {p.name.split("_")[0] for p in sweep.glob("*/slurm/*_0_log.out")} == {running}
