"""launch/preflight/validate.py: every check, its message, that all problems come back at once, and that
the checks before launch take well under two seconds without importing torch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from tests.corpus_files import sample_texts, write_corpus
from tests.hydra_compose import REPO, compose_cfg, no_slurm_cluster  # noqa: F401 (autouse)
from tests.train_cli import run_train, train_env

from launch.launchers.machine import GIB, Machine
from launch.config.model_facts import MODELS, ModelFacts
from launch.preflight.validate import ConfigError, validate

CPU_BOX = Machine(ram_bytes=24 * GIB, cpu_count=2)
GPU_BOX = Machine(ram_bytes=2048 * GIB, cpu_count=128, gpu_memory_bytes=(141 * GIB,) * 8)
H100_BOX = Machine(ram_bytes=2048 * GIB, cpu_count=128, gpu_memory_bytes=(80 * 10**9,) * 8)  # 8 x 80 GB
SMALL_GPU_BOX = Machine(ram_bytes=2048 * GIB, cpu_count=128, gpu_memory_bytes=(int(66.5 * GIB),) * 8)


def check(*overrides, machine=CPU_BOX):
    """validate() on the composed config; returns warnings, raises ConfigError."""
    return validate(compose_cfg(*overrides), machine=machine)


def problems(*overrides, **kw) -> list[str]:
    with pytest.raises(ConfigError) as e:
        check(*overrides, **kw)
    return e.value.problems


def one_problem(*overrides, **kw) -> str:
    found = problems(*overrides, **kw)
    assert len(found) == 1, found
    return found[0]


@pytest.fixture
def odd_model(monkeypatch):
    """A model whose hidden dim (100) is no multiple of the MXFP8 block."""
    tiny = MODELS[("llama4", "tiny")]
    monkeypatch.setitem(MODELS, ("llama4", "odd"), ModelFacts(**{**tiny.__dict__, "dim": 100}))
    return "model.flavor=odd"


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
        ("model=llama4_debugmodel", "parallelism=ep8", "a2a=mxfp8", "a2a.transport=symm",
         "a2a.kernel=triton"),
        ("parallelism.procs_per_node=4", "parallelism.tp=2", "parallelism.ep=2"),
        ("parallelism.procs_per_node=4", "parallelism.fsdp=2", "parallelism.tp=2", "parallelism.ep=4"),
    ],
    ids=lambda o: " ".join(o) or "defaults",
)
def test_valid(overrides):
    check(*overrides, machine=GPU_BOX)


# ---------------------------------------------------------------------------- keys
@pytest.mark.parametrize("override", ["+training.stepz=3", "+a2a.dispatch=mxfp8", "+experimentt=x"])
def test_appended_unknown_key_is_rejected_with_the_known_fields(override):
    key = override[1:].split("=")[0]
    msg = one_problem(override)
    assert f"unknown key {key}" in msg
    if key == "training.stepz":
        assert "did you mean training.steps?" in msg and "local_batch_size" in msg
    if key == "experimentt":
        assert "did you mean experiment?" in msg


def test_launcher_keys_are_the_chosen_launchers():
    """launcher=local has no SLURM fields: one added with + is an unknown key of launcher=local;
    a typo of a launcher=slurm field gets its correction."""
    msg = one_problem("+launcher.partition=gpu")
    assert msg.startswith("unknown key launcher.partition: launcher=local has name"), msg
    msg = one_problem("launcher=slurm", "+launcher.partitoin=gpu")
    assert "did you mean launcher.partition?" in msg and "launcher=slurm has account" in msg


def test_a_launcher_value_of_the_wrong_type():
    assert one_problem("launcher=slurm", "launcher.exclusive=maybe") == (
        "launcher.exclusive=maybe: expected true or false")


def test_free_form_dict_fields_take_any_key():
    check("launcher=slurm", "+launcher.additional_parameters.reservation=res1")


# ------------------------------------------------------------------ parallelism
def test_ep_must_divide_number_of_experts():
    # tiny_llama4 has 4 experts; 3 processes, EP 3 divides the world but not the experts
    msg = one_problem("parallelism.procs_per_node=3", "parallelism.ep=3", "training.seq_len=64")
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
    msg = one_problem("parallelism.procs_per_node=4", "parallelism.tp=4", "parallelism.ep=1")
    assert "parallelism.tp=4 must divide n_kv_heads=2" in msg


@pytest.mark.parametrize("key", ["nodes", "procs_per_node", "ep", "tp"])
def test_degrees_at_least_one(key):
    assert f"parallelism.{key}=0 must be >= 1" in problems(f"parallelism.{key}=0")[0]


def test_ep_with_tp_leaving_fsdp_one_is_refused_with_the_layouts_that_run():
    """torchtitan builds no FSDP mesh of degree 1 and an EP run's parallelize asks for one."""
    msg = one_problem("parallelism.tp=2")
    assert "parallelism.ep=2 with parallelism.tp=2 leaves an FSDP degree of 1" in msg
    for fix in ("parallelism.tp=1", "parallelism.procs_per_node=4", "parallelism.ep=1"):
        assert fix in msg
    check("parallelism.tp=2", "parallelism.procs_per_node=4", machine=GPU_BOX)
    check("parallelism.tp=2", "parallelism.ep=1", machine=GPU_BOX)


def test_fsdp_zero():
    assert "parallelism.fsdp=0" in one_problem("parallelism.fsdp=0")


@pytest.mark.parametrize("seq_len,tp,fix", [(7, 1, 8), (66, 2, 68)])
def test_seq_len_is_what_torchtitan_divides(seq_len, tp, fix):
    extra = ("parallelism.procs_per_node=2", f"parallelism.tp={tp}", "parallelism.ep=1") if tp > 1 else ()
    msg = one_problem(f"training.seq_len={seq_len}", *extra)
    assert f"training.seq_len={seq_len}: torchtitan needs a multiple of 2 × parallelism.tp = {2 * tp}" in msg
    assert f"training.seq_len={fix}" in msg


# ------------------------------------------------------------------------- a2a
def test_mxfp8_needs_hidden_dim_multiple_of_32(odd_model):
    msg = one_problem("a2a=mxfp8", odd_model)
    assert "hidden dim 100, not a multiple of 32" in msg and "a2a=bf16" in msg
    check("a2a=bf16", odd_model)  # bf16 does not care


def test_quantized_a2a_with_ep1_warns():
    warnings = check("a2a=mxfp8", "parallelism=single")
    assert any("nothing crosses a wire" in w for w in warnings)
    assert not any("wire" in w for w in check("a2a=bf16", "parallelism=single"))
    assert not any("wire" in w for w in check("a2a=mxfp8", "parallelism=single", "a2a.quantize_local_rows=true"))


def test_quantize_local_rows_needs_an_mxfp8_leg_and_whole_experts():
    msg = one_problem("a2a=bf16", "a2a.quantize_local_rows=true")
    assert "a2a.quantize_local_rows=true" in msg and "a2a=bf16 quantizes none" in msg and "a2a=mxfp8" in msg
    msg = one_problem("a2a=mxfp8", "a2a.quantize_local_rows=true", "parallelism.ep=1", "parallelism.tp=2")
    assert "parallelism.tp=2 shards them" in msg
    check("a2a=mxfp8", "a2a.quantize_local_rows=true", "parallelism.tp=2",  # EP 2: the dispatcher's own layers
          "parallelism.procs_per_node=4")


def test_numerics_telemetry_warns_where_it_would_log_nothing():
    assert "logging.numerics_every=-1: 0 (off)" in one_problem("logging.numerics_every=-1")
    msg = one_problem("a2a=mxfp8", "logging.numerics_every=50")  # the default 20 steps: no step sampled
    assert msg.startswith("logging.numerics_every=50 > training.steps=20: ") and "logging.numerics_every <= 20" in msg
    check("a2a=mxfp8", "logging.numerics_every=50", "training.steps=50")
    assert any("has none: nothing will be logged" in w for w in check("logging.numerics_every=5"))
    single = check("a2a=mxfp8", "parallelism=single", "logging.numerics_every=5")
    assert any("add a2a.quantize_local_rows=true" in w for w in single)
    assert not any("numerics" in w for w in check("a2a=mxfp8", "logging.numerics_every=5"))
    assert not any("numerics" in w for w in check("a2a=mxfp8", "parallelism=single", "logging.numerics_every=5",
                                                     "a2a.quantize_local_rows=true"))


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
    assert one_problem("a2a.name=custom", f"a2a.{leg}=fp8") == (
        f"a2a.{leg}='fp8': did you mean a2a.{leg}=mxfp8? use one of ['bf16', 'mxfp8']")
    assert one_problem("a2a.name=custom", f"a2a.{leg}=nvfp4").startswith(
        f"a2a.{leg}='nvfp4': use one of")  # nothing close: no guess


def test_unknown_scale_rounding_kernel_transport():
    found = problems("a2a.scale_rounding=nearest", "a2a.kernel=cuda", "a2a.transport=nvshmem")
    assert any("a2a.scale_rounding='nearest'" in p for p in found)
    assert any("a2a.kernel='cuda'" in p for p in found)
    assert any("a2a.transport='nvshmem'" in p and "'symm'" in p for p in found)
    assert "did you mean a2a.kernel=triton?" in one_problem("a2a.kernel=tritn")
    assert "did you mean a2a.transport=symm?" in one_problem("a2a.transport=sym")


# --------------------------------------------------------------------- device
def test_triton_kernel_needs_a_gpu():
    msg = one_problem("a2a.kernel=triton")
    assert "a2a.kernel=triton needs CUDA GPUs" in msg and "no GPU" in msg
    assert "a2a.kernel=auto" in msg
    check("a2a.kernel=triton", machine=GPU_BOX)
    assert "launcher.gpus_per_node=0" in one_problem(
        "a2a.kernel=triton", "launcher=slurm", "launcher.gpus_per_node=0",
        "training.checkpoint_enable=true", machine=GPU_BOX)


def test_symm_transport_on_cpu_is_rejected_before_launch():
    msg = one_problem("a2a.transport=symm")
    assert "a2a.transport=symm needs one node with CUDA and >= 2 GPUs" in msg
    assert "no GPU" in msg and "a2a.transport=auto" in msg


def test_symm_transport_needs_one_node_and_two_gpus():
    msg = one_problem("a2a.transport=symm", "launcher=slurm", "parallelism=2nodes_8gpus",
                      "model=llama4_debugmodel", "training.checkpoint_enable=true", machine=GPU_BOX)
    assert "parallelism.nodes=2 (symmetric memory spans one node)" in msg
    msg = one_problem("a2a.transport=symm", "parallelism=single", machine=GPU_BOX)
    assert "parallelism.procs_per_node=1" in msg
    check("a2a.transport=nccl", "launcher=slurm", "parallelism=2nodes_8gpus",
          "model=llama4_debugmodel", "training.checkpoint_enable=true", machine=GPU_BOX)


TWO_NODES = ("model=dsv3_16b", "parallelism=2nodes_8gpus", "launcher=slurm", "training.checkpoint_enable=true")


def test_two_hop_splits_an_ep_group_into_nodes_of_a2a_ranks_per_node_on_one_host():
    four = ("a2a.transport=two_hop", "parallelism.procs_per_node=4", "parallelism.ep=4")
    assert check(*four, "a2a.ranks_per_node=2") == ["no GPU: 4 CPU worker processes on 2 cores will be slow"]
    msg = one_problem("a2a.transport=two_hop")
    assert msg.startswith("a2a.transport=two_hop splits the EP group into >= 2 nodes of equal size, but "
                          "parallelism.nodes=1 puts the whole EP group of parallelism.ep=2 on one host: set "
                          "a2a.ranks_per_node=<ranks>"), msg
    assert "a2a.transport=nccl (the flat all-to-all)" in msg
    for ranks, why in ((3, "it does not divide parallelism.ep=4"), (4, "that makes parallelism.ep=4 one node")):
        msg = one_problem(*four, f"a2a.ranks_per_node={ranks}")
        assert f"but a2a.ranks_per_node={ranks}: {why}; use a2a.ranks_per_node from [1, 2]" in msg, msg
    assert "parallelism.ep=1 has no EP exchange" in one_problem("a2a.transport=two_hop", "parallelism.ep=1")
    assert "a2a.ranks_per_node=0: the EP ranks of one node" in one_problem(*four, "a2a.ranks_per_node=0")


def test_two_hop_across_hosts_takes_the_hosts_as_nodes():
    """Asked for, or ``auto`` with CUDA across hosts: the EP group must span >= 2 hosts (or
    ``a2a.ranks_per_node`` split it); a symm across hosts names two_hop."""
    assert check(*TWO_NODES, "parallelism.ep=16", "a2a.transport=two_hop", machine=GPU_BOX) == []
    msg = one_problem(*TWO_NODES, "a2a.transport=two_hop", machine=GPU_BOX)  # EP 8: one host
    assert ("but parallelism.ep=8 on parallelism.procs_per_node=8 keeps the EP group inside one host; use "
            "parallelism.ep=16 (the EP group over 2 hosts), a2a.ranks_per_node from [1, 2, 4]") in msg, msg
    msg = one_problem(*TWO_NODES, "parallelism.ep=16", "a2a.ranks_per_node=16", machine=GPU_BOX)
    assert msg.startswith("a2a.transport=auto runs two_hop here (CUDA, an EP group across nodes): "), msg
    assert "that makes parallelism.ep=16 one node; use a2a.ranks_per_node from [1, 2, 4, 8], or " \
           "a2a.transport=nccl (the flat all-to-all)" in msg
    msg = one_problem(*TWO_NODES, "parallelism.ep=16", "a2a.transport=symm", machine=GPU_BOX)
    assert "parallelism.ep=16 spans nodes of parallelism.procs_per_node=8" in msg and "a2a.transport=two_hop" in msg


def test_ranks_per_node_without_two_hop_is_a_warning():
    (warning,) = check("a2a.transport=nccl", "a2a.ranks_per_node=1")
    assert warning.startswith("a2a.ranks_per_node=1 sets the nodes of the two_hop transport, but the EP layers run "
                              "nccl"), warning


def test_flex_attention_model_cannot_train_on_cpu():
    msg = one_problem("model=dsv3_debugmodel", "model.flavor=debugmodel_flex_attn")
    assert "flex attention" in msg and "cannot train on CPU" in msg
    check("model=dsv3_debugmodel", "model.flavor=debugmodel_flex_attn", machine=GPU_BOX)


# ----------------------------------------------------------------------- model
def test_unknown_flavor_lists_known_ones():
    msg = one_problem("model.flavor=huge")
    assert "model.flavor='huge'" in msg and "17bx16e" in msg
    assert "did you mean model.flavor=tiny?" in one_problem("model.flavor=tinny")


def test_unknown_family():
    assert "model.family='gpt'" in one_problem("model.family=gpt")
    assert "did you mean model.family=llama4?" in one_problem("model.family=lama4")


def test_a_family_of_the_other_torchtitan_stack_is_refused_in_one_line(monkeypatch):
    """Llama4 is not in torchtitan 0.3.0; the recipe trains Qwen3 MoE on 0.3.0: each is refused
    on the other stack, naming the stack that trains it and the models that train here."""
    from launch.config import stack

    monkeypatch.setattr(stack, "_version", lambda package: {"torchtitan": "0.2.2"}.get(package, "1.0"))
    assert one_problem("model=tiny_qwen3") == (
        "model=tiny_qwen3: the recipe trains Qwen3 MoE on torchtitan 0.3.0 (`bash scripts/install.sh --torchtitan "
        "0.3.0`), and this environment runs torchtitan 0.2.2; here: model=tiny_llama4, model=tiny_dsv3, ...")
    monkeypatch.setattr(stack, "_version", lambda package: {"torchtitan": "0.3.0"}.get(package, "1.0"))
    assert one_problem("model=tiny_llama4") == (
        "model=tiny_llama4: Llama4 is not in torchtitan 0.3.0 (removed upstream: \"deprecate llama4\"), which this "
        "environment runs; Llama4 trains on the torchtitan 0.2.2 stack (`bash scripts/install.sh`); here: "
        "model=tiny_dsv3, model=tiny_qwen3, ...")
    check("model=tiny_qwen3")
    check("model=qwen3_30b_a3b", "parallelism=2nodes_8gpus", "launcher=slurm", "a2a=mxfp8", machine=GPU_BOX)
    monkeypatch.setattr(stack, "_version", lambda package: {"torchtitan": "0.2.1"}.get(package))
    assert one_problem() == ("this environment has torchtitan 0.2.1; the recipe runs torchtitan 0.2.2 or 0.3.0: "
                             "install one with `bash scripts/install.sh` or `bash scripts/install.sh --torchtitan "
                             "0.3.0`")


def test_flavor_case_does_not_matter():
    check("model=dsv3_debugmodel", "model.flavor=DebugModel")


def test_the_learning_rate_schedule_spans_every_step():
    assert one_problem("training.steps=20", "training.lr_schedule_steps=10") == (
        "training.steps=20 > training.lr_schedule_steps=10: the learning rate decays to 0 at step 10 and would "
        "stay there; use training.lr_schedule_steps >= 20, or leave it out (the schedule spans training.steps)")
    assert "training.lr_schedule_steps=0 must be > 0" in one_problem("training.lr_schedule_steps=0")
    check("training.steps=20", "training.lr_schedule_steps=100")  # the first 20 steps of a longer schedule


# ------------------------------------------------------------------------ data
def test_missing_dataset_and_tokenizer_paths(tmp_path):
    found = problems(f"training.dataset_path={tmp_path / 'nope.jsonl'}",
                     f"training.tokenizer_path={tmp_path / 'tok'}")
    assert any(f"training.dataset_path={tmp_path / 'nope.jsonl'}: no such file" in p for p in found)
    assert any(f"training.tokenizer_path={tmp_path / 'tok'}: no such directory" in p for p in found)
    (tmp_path / "tok").mkdir()
    assert "has none of ['tokenizer.json'" in one_problem(f"training.tokenizer_path={tmp_path / 'tok'}")
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    check(f"training.tokenizer_path={tmp_path / 'tok'}")


def test_unknown_dataset_and_c4_download():
    assert "training.dataset='c5'" in one_problem("training.dataset=c5")
    assert any("downloads allenai/c4" in w for w in check("training.dataset=c4"))
    assert "tests/assets/c4_test: no such file" in one_problem("training.dataset=c4_test")


# ---------------------------------------------------------------------- memory
def test_model_too_big_for_this_machine_names_the_numbers():
    # the dsv3_16b_ep8 recipe's batch on 80 GB GPUs: one process per GPU, 16 bytes per
    # parameter over 8 ranks (29 GiB) plus activations of 4 × 4096 tokens
    msg = one_problem("parallelism=ep8", "model=dsv3_16b", "training.seq_len=4096",
                      machine=Machine(24 * GIB, 2, gpu_memory_bytes=(80 * GIB,) * 8))
    assert "model=dsv3_16b with parallelism=ep8 needs about" in msg
    assert "parameters 7.3, gradients 7.3, optimizer state 14.6" in msg
    assert "each GPU's memory" in msg and "is 80.0 GiB" in msg
    assert "validate.memory=warn launches anyway" in msg


def test_cpu_processes_share_the_ram():
    found = problems("parallelism=ep8", "model=dsv3_16b")  # what the issue tried on 24 GB
    memory = next(p for p in found if "needs about" in p)
    assert "× 8 processes" in memory and "this machine's RAM is 24.0 GiB" in memory
    assert any("flex attention" in p for p in found)


@pytest.mark.parametrize("value", ["0.0", "0", "-2"])
def test_capacity_factor_of_zero_or_less_is_refused(value):
    assert f"a2a.capacity_factor={float(value) if '.' in value else int(value)!r}" in one_problem(
        f"a2a.capacity_factor={value}")


@pytest.mark.parametrize("key", ["activation_pool_factor", "activation_pool_ceiling"])
@pytest.mark.parametrize("value", ["0", "-1.5"])
def test_pool_factor_or_ceiling_of_zero_or_less_is_refused_with_the_default(key, value):
    msg = one_problem(f"a2a.{key}={value}")
    assert msg.startswith(f"a2a.{key}={float(value)!r}: expected a finite number > 0") and "or null" in msg
    assert f"the default is a2a.{key}=" in msg


def test_pool_ceiling_below_its_factor_is_refused_naming_the_fix():
    msg = one_problem("a2a.activation_pool_factor=3", "a2a.activation_pool_ceiling=2")
    assert "a2a.activation_pool_ceiling=2.0 is below a2a.activation_pool_factor=3.0" in msg
    assert "use a2a.activation_pool_ceiling >= 3.0 or null" in msg
    check("a2a.activation_pool_factor=3", "a2a.activation_pool_ceiling=null")
    check("a2a.activation_pool_factor=null", "a2a.activation_pool_ceiling=0.5")  # no pool: no ceiling to hold


def test_symm_memory_is_a_factor_of_the_balanced_case():
    """Where the EP layers run the symm transport at an elastic capacity, the estimate keeps
    every MoE layer's expert rows but the last one's in the activation pool at a pool factor
    times the balanced rows of all the layers, holds one layer's expert rows at ``a2a.capacity_factor`` times the
    balanced case and adds its peer buffers: DeepSeek-V3 16B at EP 8 (seq 4096, local batch 2)
    within 1.15x of the all-to-all's estimate with selective and with no checkpointing, where
    every layer at the worst case (``capacity_factor=null``, no pool) needs over twice as much;
    the error names the factor."""
    from launch.config.memory import estimate, expert_row_bytes, pool_rows, pooled_row_bytes

    m = MODELS["deepseek_v3", "16B"]
    for checkpointing, kept in (("none", 1.0), ("selective", 0.5)):
        kw = dict(world=8, ep=8, tp=1, local_batch_size=2, seq_len=4096, activation_checkpoint=checkpointing,
                  device="cuda")
        nccl, symm = estimate(m, **kw), estimate(m, **kw, symm=True)
        worst = estimate(m, **kw, symm=True, capacity_factor=None, pool_factor=None)
        # The staging is sized once, for the worst case's maps: growth and spills allocate none.
        assert nccl.peer_buffers == 0 < symm.peer_buffers == worst.peer_buffers, checkpointing
        assert symm.total <= 1.15 * nccl.total < 2 * nccl.total < worst.total, (checkpointing, symm, nccl, worst)
        # The pool: 1.25 x 8192 tokens x top-6 (plus 8 local experts' padding) x 26 MoE layers
        # rows of the pooled row's bytes (input, h1, h3, product, combine's expert output),
        # kept like the rest of the layer, less the last keeping layer (its backward reads its
        # tensors as they are); one layer's rows at the capacity, whole.
        layers = 26 * kept - 1
        assert symm.activation_pool == int(pool_rows(m, 8192, 8, 1.25) * pooled_row_bytes(m, True) * layers / 26)
        assert pool_rows(m, 8192, 8, 1.25) == (1.25 * 8192 * 6 + 8 * 8) * 26
        assert pooled_row_bytes(m, True) == 2 * (2 * 2048 + 3 * 1408)
        assert symm.layer_transient == (int(1.25 * 8192 * 6) + 8 * 8) * expert_row_bytes(m)
        # Only the one layer scales with the capacity factor; the pool with its own factor.
        higher = estimate(m, **kw, symm=True, capacity_factor=2.0)
        assert higher.total > symm.total and higher.activation_pool == symm.activation_pool
        assert higher.total - symm.total == higher.layer_transient - symm.layer_transient
        assert estimate(m, **kw, symm=True, pool_factor=1.5).activation_pool > symm.activation_pool
        # nccl keeps the routed rows: above balanced on a rank's sum over the layers, more
        assert estimate(m, **kw, routed_load=1.3).total > nccl.total
    # Full checkpointing keeps no expert rows across layers: the one layer's only.
    full = estimate(m, world=8, ep=8, tp=1, local_batch_size=2, seq_len=4096, activation_checkpoint="full",
                    device="cuda", symm=True)
    assert full.activation_pool == 0 < full.layer_transient
    # EP 1, or an EP group across nodes under auto: nccl, nothing extra.
    kw = dict(world=8, ep=1, tp=1, local_batch_size=2, seq_len=4096, activation_checkpoint="none", device="cuda")
    assert estimate(m, **kw, symm=True) == estimate(m, **kw)
    run = ("parallelism=ep8", "model=dsv3_16b", "training.seq_len=4096", "training.local_batch_size=2",
           "training.activation_checkpoint=selective")
    assert check(*run, machine=H100_BOX) == []  # a2a.transport=auto: symm on one 8-GPU node
    msg = one_problem(*run, "a2a.capacity_factor=null", machine=H100_BOX)
    assert "symm peer buffers" in msg and "a2a.capacity_factor" in msg and "a2a.transport=nccl" in msg
    assert check(*run, "a2a.capacity_factor=null", "a2a.transport=nccl", machine=H100_BOX) == []


DSV3_EP8 = ("parallelism=ep8", "model=dsv3_16b", "training.seq_len=4096", "training.local_batch_size=2",
            "training.activation_checkpoint=selective")


@pytest.mark.parametrize("value, why", [
    ("1.0", "a2a.capacity_ceiling=1.0 is below where the capacity starts (a2a.capacity_factor=1.25)"),
    ("0", "a2a.capacity_ceiling=0: expected a finite number > 0"),
    ("most", "a2a.capacity_ceiling='most': expected a finite number > 0"),
])
def test_a_ceiling_that_cannot_be_is_refused(value, why):
    assert why in one_problem(f"a2a.capacity_ceiling={value}")


def test_a_huge_finite_factor_is_the_worst_case_not_a_crash():
    """``a2a.capacity_factor=1e308`` (and the same ceiling) is the worst case: accepted, and on
    an 8-GPU node the memory check holds it to the worst case's estimate."""
    from launch.config.memory import estimate

    assert check("a2a.capacity_factor=1e308", "a2a.capacity_ceiling=1e308") == []
    from mxfp8_ep.config import DEFAULT_POOL_CEILING

    worst = estimate(MODELS["deepseek_v3", "16B"], world=8, ep=8, tp=1, local_batch_size=2, seq_len=4096,
                     activation_checkpoint="selective", device="cuda", symm=True, capacity_factor=None,
                     pool_factor=DEFAULT_POOL_CEILING)  # the ceilings' check: the pool at its ceiling too
    msg = one_problem(*DSV3_EP8, "a2a.capacity_factor=1e308", "a2a.capacity_ceiling=1e308", machine=SMALL_GPU_BOX)
    assert f"needs about {worst.total / GIB:.1f} GiB" in msg, msg


def test_a_ceiling_that_does_not_fit_is_refused_and_auto_takes_the_largest_that_fits(monkeypatch):
    """DeepSeek-V3 16B at EP 8 on GPUs of 66.5 GiB: the capacity starts at 1.25x the balanced case
    (fits), a ceiling at the worst case (null) or at 6x does not fit and is refused before
    launch, naming the largest that does; ``auto`` (the default) becomes that ceiling in the
    launch config, and its estimate fits while the next step up does not. On 80 GB GPUs the
    library's default ceiling fits: ``auto`` is that."""
    from launch.config.memory import CEILING_STEP
    from launch.config.model_facts import facts
    from launch.launchers.launcher import Target
    from launch.preflight.prepare import with_capacity_ceiling
    from launch.preflight.validate import memory_estimate

    from mxfp8_ep.config import DEFAULT_CAPACITY_CEILING

    assert check(*DSV3_EP8, machine=SMALL_GPU_BOX) == []
    for ceiling in ("null", "6.0"):
        msg = one_problem(*DSV3_EP8, f"a2a.capacity_ceiling={ceiling}", machine=SMALL_GPU_BOX)
        assert f"a2a.capacity_ceiling={ceiling.rstrip('0').rstrip('.') if ceiling != 'null' else 'null'}" in msg, msg
        assert "the largest ceiling that fits is" in msg and "a2a.capacity_ceiling=auto picks it" in msg, msg
    largest = float(msg.split("the largest ceiling that fits is ")[1].split(" ")[0])
    assert check(*DSV3_EP8, f"a2a.capacity_ceiling={largest}", machine=SMALL_GPU_BOX) == []

    import launch.preflight.prepare as prepare

    monkeypatch.setattr(prepare.Machine, "probe", staticmethod(lambda: H100_BOX))
    assert with_capacity_ceiling(compose_cfg(*DSV3_EP8)).a2a.capacity_ceiling == DEFAULT_CAPACITY_CEILING
    monkeypatch.setattr(prepare.Machine, "probe", staticmethod(lambda: SMALL_GPU_BOX))
    cfg = compose_cfg(*DSV3_EP8)
    resolved = with_capacity_ceiling(cfg)
    assert cfg.a2a.capacity_ceiling == "auto" and resolved.a2a.capacity_ceiling == largest < DEFAULT_CAPACITY_CEILING
    target, m = Target("cuda", int(66.5 * GIB), "each GPU's memory", "8 GPUs"), facts("deepseek_v3", "16B")
    assert memory_estimate(resolved, target, m, largest).total <= target.memory_bytes
    assert memory_estimate(resolved, target, m, largest + CEILING_STEP).total > target.memory_bytes
    # Where the memory is not known before launch (a SLURM job), auto stays for the job's nodes.
    assert with_capacity_ceiling(compose_cfg(*DSV3_EP8, "launcher=slurm")).a2a.capacity_ceiling == "auto"


def test_memory_warn_launches_anyway():
    machine = Machine(24 * GIB, 2, gpu_memory_bytes=(80 * GIB,) * 8)
    warnings = check("parallelism=ep8", "model=dsv3_16b", "training.seq_len=4096",
                     "validate.memory=warn", machine=machine)
    assert any("needs about" in w for w in warnings)
    assert "validate.memory='never'" in one_problem("validate.memory=never")


def test_a_step_that_cpu_cores_cannot_finish_is_refused():
    """On CPU, attention's work grows with seq_len²: the tiny default at seq_len=100000 would
    print nothing for hours. Refused before launch, naming the field and the estimate."""
    msg = one_problem("training.seq_len=100000")  # CPU_BOX: 2 cores, one per process
    assert msg.startswith("training.seq_len=100000: every training step would take at least 10m")
    assert "on 1 CPU core(s) per process" in msg and "attention over 100,000² token pairs" in msg
    assert msg.endswith("validate.max_step_s=0 launches anyway")
    assert check("training.seq_len=16384") == []  # 26 s a step measured on such a box
    assert check("training.seq_len=100000", "validate.max_step_s=0") == []
    assert check("training.seq_len=100000", machine=Machine(24 * GIB, 32)) == []  # 16 cores each
    assert check("training.seq_len=100000", machine=Machine(64 * GIB, 2, gpu_memory_bytes=(80 * GIB,) * 2)) == []
    assert "validate.max_step_s=-1: 0 (no check)" in one_problem("validate.max_step_s=-1")


def test_default_run_fits_a_small_laptop():
    check(machine=Machine(4 * GIB, 2))
    assert "needs about" in one_problem(machine=Machine(1 * GIB, 2))


# -------------------------------------------------------------------- training
@pytest.mark.parametrize(
    "override,text",
    [
        ("training.steps=0", "training.steps=0 must be > 0"),
        ("training.seq_len=-2", "training.seq_len=-2 must be > 0"),
        ("training.local_batch_size=0", "training.local_batch_size=0 must be > 0"),
        ("training.lr=0", "training.lr=0.0 must be > 0"),
        ("training.warmup_steps=-1", "training.warmup_steps=-1 must be >= 0"),
        ("training.max_norm=0", "training.max_norm=0.0 must be > 0"),
        ("training.activation_checkpoint=some", "training.activation_checkpoint='some'"),
        ("training.activation_checkpoint=ful", "did you mean training.activation_checkpoint=full?"),
        ("logging.wandb_mode=ofline", "did you mean logging.wandb_mode=offline?"),
        ("training.dataset=mxfp8ep_tinny", "did you mean training.dataset=mxfp8ep_tiny?"),
        ("training.profile_freq=3", "training.profile_freq=3: 0 (off) or >= 4"),
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
    msg = one_problem("parallelism=2nodes_8gpus", "model=llama4_debugmodel", machine=GPU_BOX)
    assert "launcher=local" in msg and "launcher=slurm" in msg


def test_local_launcher_needs_a_gpu_per_process():
    msg = one_problem("parallelism=ep8", "model=llama4_debugmodel",
                      machine=Machine(64 * GIB, 16, gpu_memory_bytes=(80 * GIB,) * 2))
    assert "parallelism=ep8 starts 8 processes, one per GPU, but this machine has 2 GPU(s); use parallelism=ep2" in msg
    msg = one_problem("parallelism=ep8", "model=llama4_debugmodel",
                      machine=Machine(64 * GIB, 16, gpu_memory_bytes=(80 * GIB,) * 6))
    assert "use parallelism.procs_per_node=6 with parallelism.ep=6 (or a divisor of it)" in msg


@pytest.mark.parametrize("gpus, option", [(4, "ep4"), (8, "ep8")])
def test_the_default_on_a_machine_with_more_gpus_says_which_option_uses_them(gpus, option):
    """parallelism=ep2 (the default) starts 2 processes whatever the machine: the others idle."""
    warnings = check(machine=Machine(64 * GIB, 16, gpu_memory_bytes=(80 * GIB,) * gpus))
    assert f"parallelism=ep2 starts 2 process(es), one per GPU, but this machine has {gpus} GPUs: {gpus - 2} " \
           f"stay idle; parallelism={option} uses them all" in warnings
    box = Machine(64 * GIB, 16, gpu_memory_bytes=(80 * GIB,) * gpus)
    assert not [w for w in check(f"parallelism={option}", "model=llama4_debugmodel", machine=box) if "idle" in w]


ONE_GPU = Machine(64 * GIB, 16, gpu_memory_bytes=(80 * GIB,))


def test_one_gpu_machine_names_the_parallelism_that_fits():
    """The default (parallelism=ep2) on a one-GPU machine: the way out is parallelism=single,
    not the option that just failed."""
    msg = one_problem(machine=ONE_GPU)
    assert "parallelism=ep2 starts 2 processes, one per GPU, but this machine has 1 GPU(s)" in msg
    assert "use parallelism=single" in msg and "EP 1 sends nothing over the wire" in msg
    assert "parallelism=ep2 (" not in msg and "e.g. parallelism=ep2" not in msg
    check("parallelism=single", machine=ONE_GPU)  # and what it names passes


def test_one_gpu_machine_runs_ep2_with_the_gpu_shared(tmp_path):
    """parallelism=ep2_shared_gpu: two processes on the one GPU, through the symm transport; the
    default's refusal names it. The nccl transport, or no EP exchange, is refused; so is SLURM."""
    assert "parallelism=ep2_shared_gpu for EP numerics" in one_problem(machine=ONE_GPU)
    assert check("parallelism=ep2_shared_gpu", machine=ONE_GPU) == []
    assert check("parallelism=ep2_shared_gpu", "a2a=mxfp8_all", "a2a.transport=symm", machine=ONE_GPU) == []
    # EP=4 on the one GPU; parity_dsv3 reads a corpus, here a stand-in whose one warning is its size
    corpus = write_corpus(tmp_path, sample_texts(200), sample_texts(200, offset=500))
    warnings = check("+recipe=parity_dsv3", "parallelism=ep4_shared_gpu", "a2a=mxfp8", "a2a.transport=symm",
                     "training.local_batch_size=2", f"training.dataset_path={corpus}", machine=ONE_GPU)
    assert [w for w in warnings if "later passes repeat what the model has seen" not in w] == []
    for refused in (("a2a.transport=nccl",), ("parallelism.ep=1",)):
        msg = one_problem("parallelism=ep2_shared_gpu", *refused, machine=ONE_GPU)
        assert "parallelism.share_gpu=true" in msg and "must be the symm transport" in msg, refused
    assert any("parallelism.share_gpu=true puts every process on one GPU" in p
               for p in problems("parallelism=ep2_shared_gpu", "launcher=slurm", machine=ONE_GPU))


def test_shared_gpu_on_cpu_only_warns():
    """No GPU to share: the run is the plain CPU run (gloo), said in a warning."""
    warnings = check("parallelism=ep2_shared_gpu", "a2a.transport=nccl")
    assert any("no GPU to share" in w for w in warnings)
    assert check("parallelism=ep2") == []


def test_shared_gpu_memory_counts_every_process():
    """The memory estimate is per process: on a shared GPU all of them must fit together."""
    msg = one_problem("parallelism=ep2_shared_gpu", "model=dsv3_16b",
                      machine=Machine(64 * GIB, 16, gpu_memory_bytes=(1 * GIB,)))
    per_process = float(msg.split("needs about ")[1].split(" GiB")[0].replace(",", ""))
    assert "× 2 processes" in msg
    between = int(1.5 * per_process * GIB)
    check("model=dsv3_16b", machine=Machine(64 * GIB, 16, gpu_memory_bytes=(between,) * 2))
    msg = one_problem("parallelism=ep2_shared_gpu", "model=dsv3_16b",
                      machine=Machine(64 * GIB, 16, gpu_memory_bytes=(between,)))
    assert "× 2 processes" in msg


def test_cli_on_a_one_gpu_machine(tmp_path):
    """The same from the command line, the GPU count faked by an nvidia-smi on PATH."""
    import os
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 81559\n")  # --query-gpu=memory.total in MiB: one H100
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    proc = run_train(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "this machine has 1 GPU(s); use parallelism=single" in proc.stderr
    assert not (tmp_path / "outputs").exists()  # nothing was made


def test_local_cpu_oversubscription_only_warns():
    assert any("CPU worker processes" in w for w in check("parallelism.procs_per_node=4",
                                                          "parallelism.ep=4"))


def test_slurm_fields_need_launcher_slurm():
    assert check("launcher=slurm", "launcher.partition=gpu", "training.checkpoint_enable=true") == []


def test_launcher_target_must_name_a_class():
    assert "does not name a launcher class" in one_problem("launcher._target_=launch.nope.Launcher")
    assert "has no Config dataclass" in one_problem("launcher._target_=launch.launchers.machine.Machine")


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


def test_slurm_cpu_cluster_memory_from_mem_gb():
    msg = one_problem("launcher=slurm", "launcher.gpus_per_node=0", "launcher.mem_gb=8",
                      "model=dsv3_debugmodel", "training.checkpoint_enable=true",
                      "parallelism.procs_per_node=8", "parallelism.ep=8", "training.local_batch_size=64",
                      "training.seq_len=2048")
    assert "launcher.mem_gb is 8.0 GiB" in msg


# ------------------------------------------------------------------ all at once
def test_all_problems_in_one_error():
    with pytest.raises(ConfigError) as e:
        check("training.steps=0", "a2a.name=bogus", "parallelism.ep=4", "logging.log_freq=0")
    assert len(e.value.problems) == 4
    text = str(e.value)
    assert text.startswith("4 problem(s) in the training config:")
    for p in e.value.problems:
        assert f"  - {p}" in text


# --------------------------------------------------------------- before launch, fast
def test_validation_imports_neither_torch_nor_torchtitan_and_is_fast():
    code = (
        "import sys, time\n"
        "t0 = time.perf_counter()\n"
        "from tests.hydra_compose import compose_cfg\n"
        "from launch.launchers import slurm_cluster\n"
        "slurm_cluster.partitions = lambda: None  # sinfo's own time is SLURM's\n"
        "from launch.preflight.validate import validate\n"
        "validate(compose_cfg('a2a=mxfp8', 'model=dsv3_16b', 'parallelism=2nodes_8gpus', "
        "'launcher=slurm', 'training.checkpoint_enable=true'))\n"
        "print(time.perf_counter() - t0, [m for m in ('torch', 'torchtitan') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=train_env(),
                         capture_output=True, text=True, timeout=60, check=True)
    seconds, imported = out.stdout.split(maxsplit=1)
    assert imported.strip() == "[]"
    assert float(seconds) < 2.0, f"compose + validate took {float(seconds):.2f}s"


@pytest.mark.parametrize(
    "override,text",
    [
        ("+training.stepz=3", "unknown key training.stepz"),
        ("training.stepz=3", "unknown key training.stepz: did you mean training.steps?"),
        ("a2a=mxfp9", "a2a=mxfp9: no such option; did you mean a2a=mxfp8? a2a has bf16, mxfp8"),
        # as close to ep2 (the default) as to ep4 and ep8: all three named, none picked
        ("parallelism=ep3", "parallelism=ep3: no such option; did you mean parallelism=ep2, parallelism=ep4 or "
                            "parallelism=ep8? parallelism has 2nodes_8gpus, 4nodes_8gpus, ep2, ep2_shared_gpu, ep4, "
                            "ep4_shared_gpu, ep8, single"),
        ("training.seq_len=0", "training.seq_len=0 must be > 0 (the default: training.seq_len=64)"),
        ("training.steps=abc", "training.steps=abc: expected a whole number"),
        ("+training.steps=3", "training.steps already exists, so drop the + (training.steps=3)"),
        ("launcher.partition=gpu", "launcher=local has name (launcher.partition is a field of "
                                   "launcher=slurm)"),
        ("a2a.kernel=tritn", "did you mean a2a.kernel=triton?"),
        ("training.seq_len=7", "training.seq_len=7: torchtitan needs a multiple of 2"),
        ("a2a.kernel=triton", "a2a.kernel=triton needs CUDA GPUs"),
        ("training.tokenizer_path=/nonexistent", "no such directory"),
    ],
)
def test_cli_rejects_before_starting_anything(tmp_path, override, text):
    """`python launch/train.py` reports config problems in about a second, starting nothing."""
    t0 = time.monotonic()
    proc = run_train(tmp_path, override, f"hydra.run.dir={tmp_path / 'run'}")
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert text in proc.stderr
    assert "Traceback" not in proc.stderr and "To append to your config" not in proc.stderr
    assert not (tmp_path / "run").exists()  # rejected before Hydra made the run dir
    assert elapsed < 10, f"validation took {elapsed:.1f}s"  # ~1 s; slack for a busy CI box
    print(f"{override}: rejected in {elapsed:.2f}s")


@pytest.mark.parametrize("args,text", [
    (["recipe=tiny_cpu_smoke"], "recipe=tiny_cpu_smoke: a recipe is added to the config, not swapped in the defaults "
                                "list: write +recipe=tiny_cpu_smoke (python launch/train.py +recipe=tiny_cpu_smoke"),
    (["training.dataset=debian_docs", "training.dataset_path=~/corpus"],
     "training.dataset_path=~/corpus: Hydra's override grammar cannot read ~ in a value"),
    (["a2a=bf16,mxfp8", "training.steps=50"], "add --multirun before the overrides (python launch/train.py --multirun "
                                              "a2a=bf16,mxfp8 training.steps=50)"),
    (["a2a=bf16,mxfp8", "--multirun", "training.steps=50"],
     "the overrides stand on both sides of --multirun, and Hydra reads them as one list: put the flags first "
     "(python launch/train.py --multirun a2a=bf16,mxfp8 training.steps=50 hydra.run.dir="),
], ids=["recipe without +", "~ in a path", "a sweep without --multirun", "overrides on both sides of --multirun"])
def test_cli_names_the_command_that_fixes_a_hydra_mistake(tmp_path, args, text):
    import os

    proc = run_train(tmp_path, *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and text in proc.stderr, proc.stderr[-2000:]
    if "~" in args[-1]:  # the path written out, as the shell would have expanded it
        assert f"training.dataset_path={os.path.expanduser('~/corpus')} " in proc.stderr
    assert not (tmp_path / "run").exists()


def test_cli_reports_all_problems_and_exits_2(tmp_path):
    proc = run_train(tmp_path, "parallelism.ep=4", "training.steps=0",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "2 problem(s) in the training config" in proc.stderr
    assert "parallelism.ep=4 must divide the world size" in proc.stderr


# ------------------------------------------------------------------------ sweeps
def test_sweep_points_like_the_basic_sweeper():
    from launch.preflight.callbacks import sweep_points

    cfg = compose_cfg("+recipe=dsv3_16b_2nodes_sweep", "training.steps=5", hydra_node=True)
    points = sweep_points(cfg)
    assert len(points) == 6  # a2a × a2a.transport from the recipe
    assert {(p[0], p[1]) for p in points} == {
        (f"a2a={a}", f"a2a.transport={t}") for a in ("bf16", "mxfp8", "mxfp8_all") for t in ("two_hop", "nccl")
    }
    assert all("training.steps=5" in p and "+recipe=dsv3_16b_2nodes_sweep" in p for p in points)


def test_cli_sweep_with_a_bad_point_starts_nothing(tmp_path):
    proc = run_train(tmp_path, "--multirun", "parallelism.ep=2,4", "training.steps=2",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "sweep job #1 (parallelism.ep=4 training.steps=2): parallelism.ep=4 must divide" in proc.stderr
    # the problems are counted; what follows from them is a line of its own
    assert proc.stderr.startswith("[mxfp8ep] 1 problem(s) in the training config:\n  - sweep job #1")
    assert proc.stderr.splitlines()[-1] == "nothing was started: fix or drop these points of the 2-job sweep"
    assert not list((tmp_path / "sweep").rglob("worker_logs"))


def test_comm_heavy_model_fits_two_h200_and_not_a_cpu_box():
    """model=dsv3_ep_bench (full-width DeepSeek-V3 MoE layers, for transport/format training
    comparisons) passes every check on a 2xH200 node at 8192 tokens per GPU with the symm
    transport, and is stopped before launch on the 24 GB CPU box by the memory estimate."""
    two_h200 = Machine(ram_bytes=256 * GIB, cpu_count=32, gpu_memory_bytes=(141 * GIB,) * 2)
    run = ("model=dsv3_ep_bench", "parallelism=ep2", "training.local_batch_size=2", "training.seq_len=4096")
    assert check(*run, "a2a=mxfp8", "a2a.transport=symm", machine=two_h200) == []
    with pytest.raises(ConfigError, match="memory"):
        check(*run, "a2a=mxfp8")


def test_fsdp_reshard_policy_is_one_torchtitan_knows():
    msg = one_problem("parallelism.fsdp_reshard_after_forward=sometimes")
    assert "parallelism.fsdp_reshard_after_forward='sometimes'" in msg
    assert "default, always, never" in msg


def test_a_sweep_of_one_point_says_one_run(tmp_path):
    proc = run_train(tmp_path, "--multirun", "launcher._target_=tests.launch_recorder.Recorder", "training.steps=1",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[mxfp8ep] sweep of 1 run, launched one after another with launcher=local" in proc.stdout


def test_cfg_job_prints_the_checked_config_the_launch_runs_with(tmp_path):
    """--cfg job: the fields a launch fills in are filled in, and a mistake is refused as a launch
    refuses it (Hydra's own --cfg job printed nulls and checked nothing)."""
    from omegaconf import OmegaConf

    proc = run_train(tmp_path, "--cfg", "job", "a2a=mxfp8", "training.steps=30", timeout=60)
    assert proc.returncode == 0, proc.stderr
    header, text = proc.stdout.split("\n", 1)
    assert header == "# the config this command line launches with (checked; logging.run_id: a new one at each launch)"
    cfg = OmegaConf.create(text)
    assert cfg.logging.group == "default" and cfg.logging.run_name == "a2a=mxfp8,training.steps=30"
    assert cfg.training.lr_schedule_steps == 30 and cfg.logging.run_id is None
    proc = run_train(tmp_path, "--cfg", "job", "training.steps=0", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("[mxfp8ep] 1 problem(s) in the training config:\n"
                           "  - training.steps=0 must be > 0 (the default: training.steps=20)\n")
    assert not (tmp_path / "outputs").exists()


# ------------------------------------------------------ the GPUs a config is meant for
EP8_RECIPE = "+recipe=dsv3_16b_ep8_bf16_vs_mxfp8"


def test_cfg_job_checks_an_8_gpu_recipe_for_its_gpus_from_any_machine(tmp_path):
    """The 8-GPU recipe names its GPUs (validate.gpu_mem_gib): --cfg job on a CPU machine checks
    and prints it for 8 GPUs of that memory (the symm transport's auto ceiling resolved there),
    not refused for this machine's RAM or flex attention; with validate.gpu_mem_gib=null it is
    checked against this machine again."""
    from omegaconf import OmegaConf

    from mxfp8_ep.config import DEFAULT_CAPACITY_CEILING

    from launch.config.memory import estimate, gib

    proc = run_train(tmp_path, EP8_RECIPE, "--cfg", "job", timeout=120)
    assert proc.returncode == 0, proc.stderr
    header, where, memory, ceilings, nccl, text = proc.stdout.split("\n", 5)
    assert where == "# checked for 8 GPU(s) of 79.6 GiB per node (validate.gpu_mem_gib), not this machine"
    # the estimate it checked: the total and its parts, then the parts that differ at the ceilings and on nccl
    m = MODELS["deepseek_v3", "16B"]
    kw = dict(world=8, ep=8, tp=1, local_batch_size=2, seq_len=4096, activation_checkpoint="selective",
              device="cuda")
    symm, other = estimate(m, **kw, symm=True), estimate(m, **kw)
    top = estimate(m, **kw, symm=True, capacity_factor=6.0, pool_factor=2.0)
    assert memory == (f"# memory (launch/config/memory.py) per process, against each GPU's memory (the smallest of 8) "
                      f"of 79.6 GiB: {gib(symm.total)} GiB ({symm.breakdown()})"), memory
    assert ceilings.startswith(f"#   at a2a.capacity_ceiling=6.0 and a2a.activation_pool_ceiling=2.0: "
                               f"{gib(top.total)} GiB (symm activation pool {gib(top.activation_pool)}, "), ceilings
    assert nccl == (f"#   with a2a.transport=nccl: {gib(other.total)} GiB (activations {gib(other.activations)}, "
                    f"no symm activation pool, no one layer's symm expert rows, no symm peer buffers)"), nccl
    cfg = OmegaConf.create(text)
    assert cfg.model.name == "dsv3_16b" and cfg.parallelism.procs_per_node == 8
    assert cfg.a2a.capacity_ceiling == DEFAULT_CAPACITY_CEILING  # auto, for an 80 GB GPU
    here = run_train(tmp_path, EP8_RECIPE, "--cfg", "job", "validate.gpu_mem_gib=null", timeout=120)
    assert here.returncode == 2 and "flex attention" in here.stderr and "this machine's RAM" in here.stderr


def test_a_cpu_launch_of_a_recipe_for_gpus_gives_the_breakdown_its_check_gives():
    """Launched on a machine without GPUs, the 8-GPU recipe is refused for this machine's RAM, and
    the message gives, after this machine's figure, the estimate on the GPUs it names: the
    total and parts `--cfg job` prints."""
    from launch.preflight.prepare import meant_for
    from launch.preflight.validate import memory_report

    found = problems(EP8_RECIPE, "a2a=mxfp8", machine=CPU_BOX)
    (memory,) = [p for p in found if "needs about" in p]
    cfg = compose_cfg(EP8_RECIPE, "a2a=mxfp8")
    checked = memory_report(cfg, meant_for(cfg))[0].split(" GiB: ", 1)[1]
    assert memory.endswith(f"On the GPUs it names (validate.gpu_mem_gib=79.6, 8 per node), as `--cfg job` checks "
                           f"it from here: {checked.replace(' GiB (', ' GiB per process (')}"), memory


def test_a_recipe_that_does_not_fit_its_gpus_is_refused_with_the_one_estimate():
    """Checked for the GPUs it names, the recipe at local batch 4 does not fit: the refusal
    quotes the estimate benchmarks.memory gives for that GPU run (the symm transport on CUDA),
    on every launcher, SLURM included, before sbatch."""
    from launch.config.memory import estimate
    from launch.preflight.prepare import meant_for

    m = MODELS["deepseek_v3", "16B"]
    est = estimate(m, world=8, ep=8, tp=1, local_batch_size=4, seq_len=4096, activation_checkpoint="selective",
                   device="cuda", symm=True)
    for launcher in ("launcher=local", "launcher=slurm"):
        cfg = compose_cfg(EP8_RECIPE, launcher, "training.local_batch_size=4")
        msg = one_problem(EP8_RECIPE, launcher, "training.local_batch_size=4", machine=meant_for(cfg))
        assert f"needs about {est.total / GIB:,.1f} GiB per process" in msg, msg
    requeue = ["launcher=slurm requeues a preempted or timed-out job, but training.checkpoint_enable=false: a requeued "
               "job starts again from step 0"]
    assert check(EP8_RECIPE, "launcher=slurm", machine=CPU_BOX) == requeue
    # SLURM: the nodes' GPUs cannot be seen from here; the memory the config names is checked on any machine
    msg = one_problem(EP8_RECIPE, "launcher=slurm", "training.local_batch_size=4", machine=CPU_BOX)
    assert "each GPU's memory (validate.gpu_mem_gib=79.6) is 79.6 GiB" in msg, msg
    assert check(EP8_RECIPE, "launcher=slurm", "training.local_batch_size=4", "validate.gpu_mem_gib=null",
                 machine=CPU_BOX) == requeue  # no memory check without it
    assert "validate.gpu_mem_gib=0" in one_problem("validate.gpu_mem_gib=0")
