"""The memory figures the recipes' comments quote are launch/config/memory.py's estimates of
those recipes on the GPUs they name (validate.gpu_mem_gib): every ``est. X GiB per GPU (Y at the
ceilings): <overrides>`` line is computed again here, and no other GiB figure is quoted."""

from __future__ import annotations

import re

import pytest

from tests.hydra_compose import REPO, compose_cfg, no_slurm_cluster  # noqa: F401 (autouse)

from launch.config import model_facts
from launch.config.memory import gib
from launch.launchers.launcher import launcher_class, with_typed_launcher
from launch.preflight.prepare import finalize, meant_for
from launch.preflight.validate import elastic_capacity, memory_estimate, resolved_ceiling

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
EST = re.compile(r"^#\s+est\. ([\d.,]+) GiB per GPU(?: \(([\d.,]+) at the ceilings\))?: (.*)$")


def quoted(path) -> list[tuple[str, str | None, list[str]]]:
    """(figure, figure at the ceilings or None, overrides) of each ``est.`` line."""
    out = []
    for line in path.read_text().splitlines():
        found = EST.match(line)
        if found:
            out.append((found[1], found[2], [w for w in found[3].split() if "=" in w]))
    return out


def computed(recipe: str, overrides: list[str]) -> tuple[str, str | None]:
    """The estimate the check before launch holds the recipe to on its GPUs, and at the
    ceilings it resolves (the symm transport at an elastic capacity, where the start fits)."""
    cfg = with_typed_launcher(finalize(compose_cfg(f"+recipe={recipe}", *overrides), overrides))
    target = launcher_class(cfg)().target(cfg, meant_for(cfg))
    facts = model_facts.facts(cfg.model.family, cfg.model.flavor)
    start = memory_estimate(cfg, target, facts).total
    if not elastic_capacity(cfg, target) or start > target.memory_bytes:
        return gib(start), None
    return gib(start), gib(memory_estimate(cfg, target, facts, resolved_ceiling(cfg, target, facts)).total)


def test_the_8_gpu_recipes_quote_their_estimates():
    with_figures = [p.stem for p in RECIPES if quoted(p)]
    assert with_figures == ["dsv3_16b_2nodes_sweep", "dsv3_16b_ep8_bf16_vs_mxfp8", "llama4_ep8_bf16_vs_mxfp8"]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_memory_figure_in_a_recipe_comment_is_the_codes(path):
    comments = [line for line in path.read_text().splitlines() if line.lstrip().startswith("#")]
    stray = [line for line in comments if re.search(r"\d\s*(GiB|GB/|TB)", line) and not EST.match(line)]
    assert not stray, stray
    for figure, at_ceilings, overrides in quoted(path):
        assert (figure, at_ceilings) == computed(path.stem, overrides), (path.stem, overrides)


def test_two_hop_holds_its_node_fan_out_and_its_node_hop_at_the_ceiling():
    """dsv3_16b_2nodes_sweep on two_hop (2 nodes of 8 GPUs): symm's staging pair over the node's
    8 ranks for 2 x T tokens each, no activation pool (every layer keeps its expert rows at the
    capacity), and the node hop's buffers at the ceiling's rows per node pair, in the largest of
    the legs' formats (the legs run one after another); on nccl none of them."""
    from launch.config.memory import EXPERT_ALIGN, BF16
    from mxfp8_ep.config import LEGS
    from mxfp8_ep.exchange.capacity import node_hop_bytes, node_hop_capacity, remote_node_share, symm_staging_bytes
    from mxfp8_ep.format.wire_format import WireFormat

    def estimates(*overrides):
        cfg = with_typed_launcher(finalize(compose_cfg("+recipe=dsv3_16b_2nodes_sweep", *overrides), overrides))
        target = launcher_class(cfg)().target(cfg, meant_for(cfg))
        m = model_facts.facts(cfg.model.family, cfg.model.flavor)
        ceiling = resolved_ceiling(cfg, target, m)
        return cfg, m, ceiling, memory_estimate(cfg, target, m), memory_estimate(cfg, target, m, ceiling)

    node_hop = {}
    for preset in ("bf16", "mxfp8_all"):
        cfg, m, ceiling, start, top = estimates(f"a2a={preset}", "a2a.transport=two_hop")
        T, nodes, per_node = 3 * 4096, 2, 8
        assert isinstance(ceiling, float) and ceiling > cfg.a2a.capacity_factor
        staging = symm_staging_bytes(per_node, nodes * T, m.top_k, m.num_experts // 16, EXPERT_ALIGN, True,
                                     m.dim * BF16)
        share = remote_node_share(m.num_experts, m.top_k, nodes)
        for est, factor in ((start, cfg.a2a.capacity_factor), (top, ceiling)):
            assert est.peer_buffers == staging and est.activation_pool == est.layer_transient == 0
            rows = node_hop_capacity(T, share, factor)
            assert est.node_hop == max(node_hop_bytes(nodes, rows, WireFormat(cfg.a2a[leg]).row_bytes(m.dim, BF16),
                                                      m.top_k) for leg in LEGS) > 0
        assert top.activations > start.activations and top.node_hop >= start.node_hop
        node_hop[preset] = top.node_hop
    assert node_hop["mxfp8_all"] < node_hop["bf16"]
    *_, start, top = estimates("a2a.transport=nccl")
    assert start.peer_buffers == start.node_hop == top.node_hop == 0
