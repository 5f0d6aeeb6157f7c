"""launch/validate.py: every check, its message, and that all problems come back at once."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from tests.hydra_compose import REPO, compose_cfg

from launch.validate import ConfigError, resolve_model_args, validate


def fake_args(dim=128, num_experts=8, n_heads=4, n_kv_heads=2):
    return SimpleNamespace(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                           moe_args=SimpleNamespace(num_experts=num_experts))


def check(*overrides, args=None, cuda=0):
    """validate() on the composed config; returns warnings, raises ConfigError."""
    kwargs = {"cuda_device_count": cuda}
    if args is not None:
        kwargs["model_args_fn"] = lambda family, flavor: args
    return validate(compose_cfg(*overrides), **kwargs)


def problems(*overrides, **kw) -> list[str]:
    with pytest.raises(ConfigError) as e:
        check(*overrides, **kw)
    return e.value.problems


def one_problem(*overrides, **kw) -> str:
    found = problems(*overrides, **kw)
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------- valid configs
@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("a2a=mxfp8",),
        ("a2a=mxfp8_all", "model=tiny_dsv3"),
        ("parallelism=single",),
        ("model=dsv3_16b", "parallelism=2nodes_8gpus", "launcher=slurm", "parallelism.ep=16"),
        ("model=llama4_17bx128e", "parallelism=2nodes_8gpus", "launcher=slurm", "a2a=mxfp8"),
        ("model=dsv3_671b", "parallelism=ep8", "a2a=mxfp8"),
        ("parallelism.procs_per_node=4", "parallelism.tp=2", "parallelism.ep=2"),
        ("parallelism.procs_per_node=4", "parallelism.fsdp=2", "parallelism.tp=2", "parallelism.ep=4"),
    ],
    ids=lambda o: " ".join(o) or "defaults",
)
def test_valid(overrides):
    check(*overrides, cuda=8)


# ------------------------------------------------------------------ parallelism
def test_ep_must_divide_number_of_experts():
    # tiny_llama4 has 4 experts; 3 processes, EP 3 divides the world but not the experts
    msg = one_problem("parallelism.procs_per_node=3", "parallelism.ep=3")
    assert "parallelism.ep=3 must divide the number of experts" in msg
    assert "(4)" in msg and "[1, 2, 4]" in msg


def test_ep_must_divide_world_size():
    msg = one_problem("parallelism.ep=4")
    assert "parallelism.ep=4 must divide the world size" in msg
    assert "1 × 2 = 2" in msg


def test_fsdp_times_tp_must_equal_world_size():
    msg = one_problem("parallelism.fsdp=4")
    assert "parallelism.fsdp × parallelism.tp = 4 × 1 = 4 must equal the world size" in msg
    assert "parallelism.fsdp=-1" in msg


def test_tp_must_divide_world_size():
    found = problems("parallelism.tp=3")
    assert "parallelism.tp=3 does not divide the world size" in found[0]


def test_tp_must_divide_heads():
    # tiny_llama4: 4 heads, 2 kv heads
    msg = one_problem("parallelism.procs_per_node=4", "parallelism.tp=4", "parallelism.ep=4")
    assert "parallelism.tp=4 must divide n_kv_heads=2" in msg


@pytest.mark.parametrize("key", ["nodes", "procs_per_node", "ep", "tp"])
def test_degrees_at_least_one(key):
    assert f"parallelism.{key}=0 must be >= 1" in problems(f"parallelism.{key}=0")[0]


def test_fsdp_zero():
    assert "parallelism.fsdp=0" in one_problem("parallelism.fsdp=0")


# ------------------------------------------------------------------------- a2a
def test_mxfp8_needs_hidden_dim_multiple_of_32():
    msg = one_problem("a2a=mxfp8", args=fake_args(dim=100))
    assert "hidden dim 100, not a multiple of 32" in msg and "a2a=bf16" in msg
    check("a2a=bf16", args=fake_args(dim=100))  # bf16 does not care


def test_quantized_a2a_with_ep1_warns():
    warnings = check("a2a=mxfp8", "parallelism=single")
    assert any("nothing crosses a wire" in w for w in warnings)
    assert not any("wire" in w for w in check("a2a=bf16", "parallelism=single"))


def test_unknown_preset_name():
    msg = one_problem("a2a.name=fp4")
    assert "a2a.name='fp4' is not a preset" in msg and "a2a.name=custom" in msg


def test_custom_legs_accepted_with_name_custom():
    check("a2a.name=custom", "a2a.dispatch_fwd=mxfp8")


def test_preset_with_changed_leg_warns():
    warnings = check("a2a=mxfp8", "a2a.combine_bwd=bf16")
    assert any("differ from preset 'mxfp8'" in w and "combine_bwd=bf16" in w for w in warnings)


@pytest.mark.parametrize("leg", ["dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd"])
def test_unknown_leg_value(leg):
    assert f"a2a.{leg}='fp8': use one of ['bf16', 'mxfp8']" in one_problem(
        "a2a.name=custom", f"a2a.{leg}=fp8"
    )


def test_unknown_scale_rounding_and_kernel():
    found = problems("a2a.scale_rounding=nearest", "a2a.kernel=cuda")
    assert any("a2a.scale_rounding='nearest'" in p for p in found)
    assert any("a2a.kernel='cuda'" in p for p in found)


# ----------------------------------------------------------------------- model
def test_unknown_flavor_lists_known_ones():
    msg = one_problem("model.flavor=huge")
    assert "huge" in msg and "17bx16e" in msg


def test_unknown_family():
    assert "model.family='gpt'" in one_problem("model.family=gpt")


def test_resolve_model_args_reads_experts():
    assert resolve_model_args("deepseek_v3", "671B").moe_args.num_experts == 256
    assert resolve_model_args("llama4", "17bx128e").moe_args.num_experts == 128


# -------------------------------------------------------------------- training
@pytest.mark.parametrize(
    "override,text",
    [
        ("training.steps=0", "training.steps=0 must be > 0"),
        ("training.seq_len=-1", "training.seq_len=-1 must be > 0"),
        ("training.local_batch_size=0", "training.local_batch_size=0 must be > 0"),
        ("training.lr=0", "training.lr=0.0 must be > 0"),
        ("training.warmup_steps=-1", "training.warmup_steps=-1 must be >= 0"),
        ("training.max_norm=0", "training.max_norm=0.0 must be > 0"),
        ("training.activation_checkpoint=some", "training.activation_checkpoint='some'"),
        ("logging.log_freq=0", "logging.log_freq=0 must be >= 1"),
        ("logging.wandb_mode=cloud", "logging.wandb_mode='cloud'"),
    ],
)
def test_training_and_logging_values(override, text):
    assert text in one_problem(override)


def test_checkpoint_interval_only_checked_when_enabled():
    check("training.checkpoint_interval=0")
    assert "checkpoint_interval" in one_problem("training.checkpoint_enable=true",
                                                "training.checkpoint_interval=0")


def test_warmup_longer_than_training_warns():
    assert any("never leaves warmup" in w for w in check("training.steps=2", "training.warmup_steps=5"))


# -------------------------------------------------------------------- launcher
def test_local_launcher_is_one_node():
    msg = one_problem("parallelism=2nodes_8gpus", "model=llama4_debugmodel", cuda=8)
    assert "launcher=local" in msg and "launcher=slurm" in msg


def test_local_launcher_needs_a_gpu_per_process():
    msg = one_problem("parallelism=ep8", "model=llama4_debugmodel", cuda=2)
    assert "procs_per_node=8 but this machine has 2 GPU(s)" in msg


def test_local_cpu_oversubscription_only_warns():
    assert any("CPU worker processes" in w for w in check("parallelism.procs_per_node=64",
                                                          "parallelism.ep=4", cuda=0))


def test_slurm_launcher_checks():
    found = problems("launcher=slurm", "launcher.container_mounts=/a:/a", "launcher.time_min=0",
                     "launcher.gpus_per_node=1")
    assert any("container_mounts is set but launcher.container_image is not" in p for p in found)
    assert any("launcher.time_min=0" in p for p in found)
    assert any("launcher.gpus_per_node=1 < parallelism.procs_per_node=2" in p for p in found)
    check("launcher=slurm", "launcher.gpus_per_node=0")  # CPU cluster


def test_slurm_requeue_without_checkpoint_warns():
    assert any("starts again from step 0" in w for w in check("launcher=slurm"))
    assert not any("step 0" in w for w in check("launcher=slurm", "training.checkpoint_enable=true"))


# ------------------------------------------------------------------ all at once
def test_all_problems_in_one_error():
    with pytest.raises(ConfigError) as e:
        check("training.steps=0", "a2a.name=bogus", "parallelism.ep=4", "logging.log_freq=0")
    assert len(e.value.problems) == 4
    text = str(e.value)
    assert text.startswith("4 problem(s) in the training config:")
    for p in e.value.problems:
        assert f"  - {p}" in text


def test_cli_reports_problems_and_exits_2(tmp_path):
    """`python launch/train.py` validates before starting anything."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), "parallelism.ep=4", "training.steps=0",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "2 problem(s) in the training config" in proc.stderr
    assert "parallelism.ep=4 must divide the world size" in proc.stderr
    assert not (tmp_path / "run" / "worker_logs").exists()


# ------------------------------------------------------------------------ sweeps
def test_sweep_points_like_the_basic_sweeper():
    from launch.sweep_check import sweep_points

    cfg = compose_cfg("+recipe=dsv3_16b_2nodes_sweep", "training.steps=5", hydra_node=True)
    points = sweep_points(cfg)
    assert len(points) == 6  # a2a × parallelism.ep from the recipe
    assert {(p[0], p[1]) for p in points} == {
        (f"a2a={a}", f"parallelism.ep={e}") for a in ("bf16", "mxfp8", "mxfp8_all") for e in (8, 16)
    }
    assert all("training.steps=5" in p and "+recipe=dsv3_16b_2nodes_sweep" in p for p in points)


def test_cli_sweep_with_a_bad_point_starts_nothing(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), "--multirun", "parallelism.ep=2,4",
         "training.steps=2", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "sweep job #1 (parallelism.ep=4 training.steps=2): parallelism.ep=4 must divide" in proc.stderr
    assert "nothing was started" in proc.stderr
    assert not list((tmp_path / "sweep").rglob("worker_logs"))
