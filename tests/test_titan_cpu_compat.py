"""Each torchtitan 0.2.2 CPU patch in ``launch.titan.cpu_compat`` (single process)."""

from __future__ import annotations

import pytest
import torch

from launch.titan import cpu_compat as titan_cpu_compat
from launch.titan.cpu_compat import CpuDeviceModule, apply_cpu_compat, force_sum_reduction

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only patches")


@pytest.fixture(scope="module", autouse=True)
def patched() -> None:
    assert apply_cpu_compat() is True


def test_idempotent() -> None:
    histc = torch.histc
    assert apply_cpu_compat() is True
    assert torch.histc is histc
    assert titan_cpu_compat.is_applied()


def test_noop_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_cpu_compat() is False


def test_device_type_and_module() -> None:
    from torchtitan.components import metrics
    from torchtitan.distributed import parallel_dims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    for module in (utils, metrics, dist_utils):
        assert module.device_type == "cpu"
        assert isinstance(module.device_module, CpuDeviceModule)
    assert parallel_dims.device_type == "cpu"
    monitor = metrics.build_device_memory_monitor()
    stats = monitor.get_peak_stats()
    assert stats.max_reserved_gib > 0 and 0 < stats.max_reserved_pct < 100
    assert isinstance(utils.device_module.current_device(), int)


def test_histc_on_int64_matches_bincount() -> None:
    idx = torch.tensor([[0, 3], [3, 1], [7, 3]])
    counts = torch.histc(idx.view(-1), bins=8, min=0, max=8)
    assert counts.dtype == torch.int64
    assert torch.equal(counts, torch.bincount(idx.view(-1), minlength=8))
    # floating point input is untouched
    assert torch.histc(torch.tensor([0.5, 1.5]), bins=2, min=0, max=2).dtype == torch.float32


def test_permute_indices_takes_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.models.moe import kernels
    from torchtitan.models.moe import utils as moe_utils

    # EP's _permute calls the name in moe.utils: it must be the patched one.
    assert moe_utils.generate_permute_indices is kernels.generate_permute_indices
    tokens = torch.tensor([4, 2, 1, 3, 1, 2, 3, 4], dtype=torch.int64)  # 2 ranks x 4 experts
    ref = kernels.generate_permute_indices.__wrapped__(tokens, 4, 2, 64, 8, use_cpu=True)

    def no_triton(*_args, **_kwargs):
        raise AssertionError("the Triton kernel was launched for CPU tensors")

    monkeypatch.setattr(kernels, "fill_indices_wrapper", no_triton)
    got = moe_utils.generate_permute_indices(tokens, 4, 2, 64, 8)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_dsv3_args_have_moe_impl() -> None:
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    assert deepseekv3_args["debugmodel"].moe_impl == "standard"


def test_profiler_drops_the_missing_accelerator_activity() -> None:
    cpu = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[cpu, None]) as prof:  # torchtitan's list on a CPU machine
        torch.ones(4).sum()
    assert any(e.key == "aten::sum" for e in prof.key_averages())


def test_force_sum_reduction_counts_fsdp_modules() -> None:
    assert force_sum_reduction(torch.nn.Linear(2, 2)) == 0


def _force_sum_flags(model: torch.nn.Module) -> list[bool]:
    return [group.force_sum_reduction_for_comms for module in model.modules() if hasattr(module, "_get_fsdp_state")
            for group in module._get_fsdp_state()._fsdp_param_groups]


def _parallelize_switches_fsdp_to_sum(rank: int, world: int) -> None:  # noqa: ARG001
    torch.set_num_threads(1)  # a forked rank: no intra-op thread pool inherited half-made
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models import deepseek_v3, llama4

    for family in (llama4, deepseek_v3):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        fully_shard(model[0])
        fully_shard(model)
        model.model_args = SimpleNamespace()  # what torchtitan's parallelize reads of a model
        assert _force_sum_flags(model) == [False, False]
        job_config = JobConfig()
        job_config.activation_checkpoint.mode = "none"
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        assert family.get_train_spec().parallelize_fn(model, dims, job_config) is model
        assert _force_sum_flags(model) == [True, True], family.__name__


def test_parallelize_functions_switch_fsdp_to_sum_reduction() -> None:
    """The train specs' parallelize functions (the patched package attributes) leave every FSDP
    module of the model they parallelize reducing with SUM (gloo has no AVG)."""
    from tests.moe_harness import run_forked

    run_forked(1, _parallelize_switches_fsdp_to_sum)
