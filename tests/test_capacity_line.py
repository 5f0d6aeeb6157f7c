"""launch/titan/a2a.py's console line for the symm transport's elastic capacity: each end names
the multiple of the balanced case it holds (a ceiling past the worst case is the worst case, with
its own multiple) and its own memory estimate."""

from __future__ import annotations

import re

from tests.hydra_compose import compose_cfg, no_slurm_cluster  # noqa: F401 (autouse)

from launch.config.memory import run_estimate, symm_capacity
from launch.config.model_facts import facts
from launch.titan.a2a import a2a_config, capacity_line, distinct_sizes

SYMM = ("model=tiny_dsv3", "a2a.transport=symm")


def _ends(line: str) -> list[tuple[str, str]]:
    return re.findall(r"([\d,]+ expert rows) \(([^;]*); est\. ([^)]*) per process\)", line)


def test_a_ceiling_past_the_worst_case_is_named_the_worst_case_with_its_own_multiple():
    cfg = compose_cfg(*SYMM, "a2a.capacity_ceiling=6")
    m, tokens = facts("deepseek_v3", "tiny"), cfg.training.local_batch_size * cfg.training.seq_len
    worst = symm_capacity(m, tokens, 2, None)
    (start_rows, start, start_mem), (top_rows, top, top_mem) = _ends(capacity_line(cfg, a2a_config(cfg)))
    assert start == "1.25x balanced" and top_rows == f"{worst:,} expert rows"
    assert top == f"the worst case, {worst / (tokens * m.top_k):.2f}x balanced, which caps 6x"
    assert start_mem != top_mem  # the ceiling's own estimate, not the start's rounded alike


def test_a_ceiling_below_the_worst_case_is_its_factor_with_its_own_memory():
    cfg = compose_cfg(*SYMM, "a2a.capacity_ceiling=1.5")
    (_, start, start_mem), (_, top, top_mem) = _ends(capacity_line(cfg, a2a_config(cfg)))
    assert (start, top) == ("1.25x balanced", "1.5x balanced")
    m = facts("deepseek_v3", "tiny")
    sizes = [run_estimate(cfg, m, "cpu", True, f, at_ceiling).total for f, at_ceiling in ((1.25, False), (1.5, True))]
    assert sizes[0] != sizes[1] and [start_mem, top_mem] == distinct_sizes(sizes)


def test_sizes_are_given_in_the_unit_that_tells_them_apart():
    gib = 2**30
    assert distinct_sizes([int(59.3 * gib), int(70.4 * gib)]) == ["59.3 GiB", "70.4 GiB"]
    assert distinct_sizes([int(0.61 * gib), int(0.612 * gib)]) == ["625 MiB", "627 MiB"]
    assert distinct_sizes([gib, gib]) == ["1.0 GiB", "1.0 GiB"]
