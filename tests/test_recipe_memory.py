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
from launch.preflight.validate import elastic_symm, memory_estimate, resolved_ceiling

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
    if not elastic_symm(cfg, target) or start > target.memory_bytes:
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
