"""Node-limited routing (``model.num_expert_groups`` / ``model.num_limited_groups``): checked
against the EP layout before launch (launch/config/node_limited.py, through validate), off by
default, the DeepSeek-V3 paper's values on the 671B, and the values in the routers torchtitan
builds from the job config (tests/titan030 runs that test on torchtitan 0.3.0). Seconds."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tests.hydra_compose import compose_cfg, no_slurm_cluster  # noqa: F401 (autouse)

from launch.config.node_limited import ep_nodes, node_limited_problems
from launch.config.stack import installed_torchtitan
from launch.launchers.machine import GIB, Machine
from launch.preflight.validate import ConfigError, validate

GPU_BOX = Machine(ram_bytes=2048 * GIB, cpu_count=128, gpu_memory_bytes=(141 * GIB,) * 8)
# DeepSeek-V3 16B at EP 16 over two 8-GPU nodes (its 2-node recipe's EP 16 point).
TWO_NODES = ("model=dsv3_16b", "parallelism=2nodes_8gpus", "launcher=slurm", "parallelism.ep=16")


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(*overrides), machine=GPU_BOX)
    return e.value.problems


def test_off_by_default_and_the_papers_values_on_the_671b():
    assert (compose_cfg().model.num_expert_groups, compose_cfg().model.num_limited_groups) == (None, None)
    m = compose_cfg("model=dsv3_16b").model
    assert (m.num_expert_groups, m.num_limited_groups) == (None, None)
    m = compose_cfg("model=dsv3_671b").model
    assert (m.num_expert_groups, m.num_limited_groups) == (8, 4)  # DeepSeek-V3: 8 nodes, at most 4 per token
    for recipe in ("dsv3_16b_2nodes_sweep", "dsv3_16b_ep8_bf16_vs_mxfp8"):
        m = compose_cfg(f"+recipe={recipe}").model
        assert (m.num_expert_groups, m.num_limited_groups) == (None, None), recipe


def test_groups_that_are_the_ep_groups_nodes_pass():
    validate(compose_cfg(*TWO_NODES, "model.num_expert_groups=2", "model.num_limited_groups=1"), machine=GPU_BOX)
    # the 671B's 8 groups on EP 64 over 8 nodes
    errors, _ = node_limited_problems(8, 4, num_experts=256, top_k=8, ep=64, procs_per_node=8, model="dsv3_671b")
    assert errors == []


def test_groups_other_than_the_ep_groups_nodes_name_the_nodes():
    found = problems(*TWO_NODES, "model.num_expert_groups=4", "model.num_limited_groups=2")
    assert len(found) == 1 and "spans 2 nodes; use model.num_expert_groups=2" in found[0], found


def test_an_ep_group_inside_one_node_has_no_nodes_to_limit():
    found = problems("model=dsv3_16b", "parallelism=2nodes_8gpus", "launcher=slurm",
                     "model.num_expert_groups=2", "model.num_limited_groups=1")
    assert len(found) == 1 and "keeps every expert on one node" in found[0] and "parallelism.ep=16" in found[0]
    assert "model.num_expert_groups=null model.num_limited_groups=null" in found[0]


def test_the_671b_off_its_eight_nodes_is_refused_with_the_fix():
    found = problems("model=dsv3_671b", "parallelism=2nodes_8gpus", "launcher=slurm", "parallelism.ep=16",
                     "validate.memory=warn")
    assert any("spans 2 nodes; use model.num_expert_groups=2" in p for p in found), found


@pytest.mark.parametrize("groups,limited,expected", [
    (2, None, "model.num_expert_groups is set alone"),
    (None, 1, "model.num_limited_groups is set alone"),
    (2, 3, "model.num_limited_groups=3 > model.num_expert_groups=2"),
    (2, 0, "both must be >= 1"),
])
def test_bad_pairs_are_refused(groups, limited, expected):
    def value(v):
        return "null" if v is None else str(v)

    found = problems(*TWO_NODES, f"model.num_expert_groups={value(groups)}",
                     f"model.num_limited_groups={value(limited)}")
    assert len(found) == 1 and expected in found[0], found


def test_groups_must_divide_the_experts_and_hold_top_k():
    errors, _ = node_limited_problems(3, 1, num_experts=64, top_k=6, ep=24, procs_per_node=8, model="m")
    assert len(errors) == 1 and "must divide the 64 routed experts" in errors[0], errors
    errors, _ = node_limited_problems(32, 16, num_experts=32, top_k=2, ep=256, procs_per_node=8, model="m")
    assert len(errors) == 1 and "groups of 1" in errors[0], errors
    # top-6 of 64 experts in 16 groups of 4: one group holds 4 experts, two hold 8
    errors, _ = node_limited_problems(16, 1, num_experts=64, top_k=6, ep=128, procs_per_node=8, model="m")
    assert len(errors) == 1 and "use model.num_limited_groups >= 2" in errors[0], errors
    assert node_limited_problems(16, 2, num_experts=64, top_k=6, ep=128, procs_per_node=8, model="m")[0] == []


def test_every_group_open_is_a_warning():
    errors, warnings = node_limited_problems(2, 2, num_experts=64, top_k=6, ep=16, procs_per_node=8, model="m")
    assert errors == [] and len(warnings) == 1 and "not limited" in warnings[0]


def test_ep_nodes():
    assert [ep_nodes(ep, 8) for ep in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 1, 2, 8]
    assert ep_nodes(12, 8) is None and ep_nodes(3, 8) is None


def _routers(job_config) -> list[tuple]:
    """(num_expert_groups, num_limited_groups) of every router of the model torchtitan builds
    from ``job_config`` (on the meta device), on the installed stack."""
    with torch.device("meta"):
        if installed_torchtitan() == "0.2.2":
            from torchtitan.protocols.train_spec import get_train_spec

            spec = get_train_spec(job_config.model.name)
            args = copy.deepcopy(spec.model_args[job_config.model.flavor])
            args.update_from_config(job_config)
            model = spec.model_cls(args)
        else:
            model = job_config.model_spec.model.build()
    return [(m.num_expert_groups, m.num_limited_groups) for m in model.modules()
            if type(m).__name__ == "TokenChoiceTopKRouter"]


@pytest.mark.parametrize("groups,limited", [(2, 1), (None, None)])
def test_node_limited_routing_reaches_torchtitans_routers(groups, limited, tmp_path: Path):
    from launch.titan.runner import build_job_config

    if installed_torchtitan() == "0.2.2":
        from launch.titan.models import flavors_in_torchtitan
    else:
        from launch.titan.titan030.models import flavors_in_torchtitan

    def value(v):
        return "null" if v is None else str(v)

    flavors = sorted(flavors_in_torchtitan())
    cfg = compose_cfg("model=tiny_dsv3", f"model.num_expert_groups={value(groups)}",
                      f"model.num_limited_groups={value(limited)}")
    routers = _routers(build_job_config(cfg, str(tmp_path)))
    assert routers and set(routers) == {(groups, limited)}, routers
    assert sorted(flavors_in_torchtitan()) == flavors  # the model facts table's flavors stay torchtitan's
    # the flavor torchtitan ships stays as it was
    routers = _routers(build_job_config(compose_cfg("model=tiny_dsv3"), str(tmp_path)))
    assert set(routers) == {(None, None)}, routers


def test_off_turns_off_a_flavor_that_has_it(tmp_path: Path):
    """torchtitan's 671B sets 8 / 4; null in the recipe's config means off there too."""
    if installed_torchtitan() != "0.2.2":
        pytest.skip("the 671B's routers are read from torchtitan 0.2.2's args here (no model built)")
    from torchtitan.protocols.train_spec import get_train_spec

    from launch.titan.runner import build_job_config

    cfg = compose_cfg("model=dsv3_671b", "model.num_expert_groups=null", "model.num_limited_groups=null")
    jc = build_job_config(cfg, str(tmp_path))
    moe = get_train_spec("deepseek_v3").model_args[jc.model.flavor].moe_args
    assert (moe.num_expert_groups, moe.num_limited_groups) == (None, None)
    jc = build_job_config(compose_cfg("model=dsv3_671b"), str(tmp_path))
    assert jc.model.flavor == "671B"


def test_the_routers_torchtitan_builds_keep_each_token_on_its_limited_groups(tmp_path: Path):
    """The tiny DeepSeek-V3's routers (8 experts, top-2) with 4 groups of 2, 1 limited: each
    token's two experts are one group's two."""
    if installed_torchtitan() != "0.2.2":
        pytest.skip("the router's call is 0.2.2's here")
    from torchtitan.protocols.train_spec import get_train_spec

    from launch.titan.cpu_compat import apply_cpu_compat
    from launch.titan.runner import build_job_config

    apply_cpu_compat()  # the router's histc of its expert ids on CPU
    cfg = compose_cfg("model=tiny_dsv3", "model.num_expert_groups=4", "model.num_limited_groups=1")
    jc = build_job_config(cfg, str(tmp_path))
    spec = get_train_spec(jc.model.name)
    args = copy.deepcopy(spec.model_args[jc.model.flavor])
    args.update_from_config(jc)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    routers = [m for m in model.modules() if type(m).__name__ == "TokenChoiceTopKRouter"]
    x = torch.randn(256, args.dim)
    for router in routers:
        with torch.no_grad():
            _, expert_ids, _ = router(x)
        groups = expert_ids // 2  # 8 experts in 4 groups of 2
        assert (groups == groups[:, :1]).all()
