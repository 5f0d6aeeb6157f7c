"""The routing telemetry: ``mxfp8_ep.telemetry.routing_stats`` against hand-computed loads, the recipe's
step bookkeeping (``launch.titan.routing_telemetry``) on stand-in MoE layers, and training runs
at EP=1 and EP=2 (symm, with replays) that write it to wandb, ``routing.jsonl`` and the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from launch.run.console import format_summary
from launch.run.run_dir import ROUTING_LOG
from launch.run.run_summary import RunSummary, imbalance_metric
from launch.titan.routing_telemetry import RoutingTelemetry
from mxfp8_ep.elastic import LOAD_BALANCE_BUFFERS
from mxfp8_ep.telemetry.routing_stats import busiest_rank_load, imbalance_degrees


# --------------------------------------------------------------------------------- the library

def test_busiest_rank_load_by_hand():
    counts = torch.tensor([[4, 0, 0, 0, 0, 0, 0, 4],   # EP2 blocks 4|4; EP4 4,0,0,4; EP8 one expert holds 4 of 8
                           [1, 1, 1, 1, 1, 1, 1, 9],   # EP2 4|12; EP4 2,2,2,10; EP8 9 of 16
                           [0, 0, 0, 0, 0, 0, 0, 0]])  # nothing counted
    loads = busiest_rank_load(counts, (2, 4, 8))
    assert loads.dtype == torch.float32 and loads.shape == (3, 3)
    assert loads.tolist() == [[1.0, 2.0, 4.0], [1.5, 2.5, 4.5], [0.0, 0.0, 0.0]]
    assert busiest_rank_load(counts, ()).shape == (3, 0)


def test_imbalance_degrees_add_the_runs_own_and_leave_out_what_does_not_divide():
    assert imbalance_degrees(16) == (2, 4, 8)
    assert imbalance_degrees(16, ep=16) == (2, 4, 8, 16)
    assert imbalance_degrees(12, ep=3) == (2, 3, 4)  # 8 does not divide 12
    assert imbalance_degrees(6, ep=1) == (2,)
    assert imbalance_degrees(7) == ()
    with pytest.raises(ValueError, match=r"\[3\] do not spread 8 experts"):
        busiest_rank_load(torch.ones(1, 8), (2, 3))


# ------------------------------------------------------------------------- the recipe's steps

class _MoE(nn.Module):
    def __init__(self, experts: int, counter: str):
        super().__init__()
        self.register_buffer(counter, torch.zeros(experts))


class _Block(nn.Module):
    def __init__(self, experts: int | None, counter: str):
        super().__init__()
        self.moe_enabled = experts is not None
        if experts is not None:
            self.moe = _MoE(experts, counter)


class _Model(nn.Module):
    """torchtitan's layout: ``layers`` of blocks, MoE ones with a per-expert token counter
    (``counter``: ``moe.tokens_per_expert`` on torchtitan 0.2.2, ``moe.tokens_per_expert_E`` on 0.3.0)."""

    def __init__(self, experts: int = 4, counter: str = "tokens_per_expert"):
        super().__init__()
        self.counter = counter
        self.layers = nn.ModuleDict({"0": _Block(None, counter), "1": _Block(experts, counter),
                                     "2": _Block(experts, counter)})

    def counts(self, name: str) -> torch.Tensor:
        """Layer ``name``'s counter."""
        return getattr(self.layers[name].moe, self.counter)

    def route(self, *counts):
        """One forward: the MoE layers count their tokens (layer 1 ``counts[0]``, layer 2 ``counts[1]``)."""
        for name, c in zip(("1", "2"), counts):
            self.counts(name).add_(torch.tensor(c, dtype=torch.float32))


@pytest.mark.parametrize("counter", LOAD_BALANCE_BUFFERS)
@pytest.mark.parametrize("load_balancing", [True, False])
def test_a_step_counts_once_its_own_tokens(tmp_path, load_balancing, counter):
    """Two microbatches a step; step 2's first attempt overflows and runs again from its counters
    as they were; with load balancing torchtitan zeroes the counters in the optimizer step,
    without it they add up over the run: either way each step's loads are its own tokens'."""
    model = _Model(counter=counter)
    telemetry = RoutingTelemetry.of([model], ep=1, run_dir=str(tmp_path))
    assert telemetry.layers == [1, 2] and telemetry.degrees == (2, 4)

    def step(number, microbatches, overflowed=None):
        telemetry.begin_step()
        start = [model.counts(n).clone() for n in ("1", "2")]
        if overflowed:
            model.route(*overflowed[0])
            telemetry.microbatch_done(number, 2)
            model.route(*overflowed[1])  # the check after the last backward raises: not done
            for n, saved in zip(("1", "2"), start):
                model.counts(n).copy_(saved)
            telemetry.restart_step()
        for counts in microbatches:
            model.route(*counts)
            telemetry.microbatch_done(number, 2)
        if load_balancing:
            for n in ("1", "2"):
                model.counts(n).zero_()

    step(1, [([1, 1, 1, 1], [4, 0, 0, 0]), ([1, 1, 1, 1], [4, 0, 0, 0])])
    step(2, [([3, 1, 0, 0], [1, 1, 1, 1]), ([3, 1, 0, 0], [1, 1, 1, 1])],
         overflowed=[([1, 1, 1, 1], [1, 1, 1, 1]), ([0, 0, 0, 8], [0, 0, 0, 8])])
    first = telemetry.collect()
    # layer 1: step 1 even; step 2 [6, 2, 0, 0] -> EP2 8 of 8 (2.0), EP4 6 of 8 (3.0).
    # layer 2: step 1 [8, 0, 0, 0] -> EP2 2.0, EP4 4.0; step 2 even.
    assert first == {imbalance_metric(2): 2.0, imbalance_metric(4): 4.0}
    step(3, [([1, 1, 1, 1], [1, 1, 1, 1]), ([1, 1, 1, 1], [1, 1, 1, 1])])
    assert telemetry.collect() == {imbalance_metric(2): 1.0, imbalance_metric(4): 1.0}
    assert telemetry.collect() == {}  # nothing since

    lines = [json.loads(line) for line in (tmp_path / ROUTING_LOG).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["layers"] == [1, 2] and line["picks"] == [8, 8] for line in lines)
    assert lines[1]["load"] == {"2": [2.0, 1.0], "4": [3.0, 1.0]}
    assert telemetry.summary() == {"ep2": {"max": 2.0, "max_step": 1, "last": 1.0},
                                   "ep4": {"max": 4.0, "max_step": 1, "last": 1.0}}


def test_no_telemetry_without_a_degree_to_report(tmp_path):
    assert RoutingTelemetry.of([_Model(experts=3)], ep=1, run_dir=str(tmp_path)) is None  # 2, 4, 8 divide no 3
    assert RoutingTelemetry.of([nn.Linear(2, 2)], ep=1, run_dir=str(tmp_path)) is None  # no MoE layer
    assert RoutingTelemetry.of([_Model(experts=3)], ep=3, run_dir=str(tmp_path)).degrees == (3,)


# ------------------------------------------------------------------------------ training runs

def _routing_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / ROUTING_LOG).read_text().splitlines()]


def _window_max(lines: list[dict], steps: range, degree: int) -> float:
    return max(v for line in lines if line["step"] in steps for v in line["load"][str(degree)])


def test_an_ep1_run_reports_every_degree_from_all_ranks_tokens(tmp_path):
    """tiny DeepSeek-V3 (8 experts, top-2, 2 MoE layers) at EP=1 on 2 FSDP ranks, logging at
    steps 1, 2, 4, 6 (torchtitan logs step 1 and every 2nd): each step's loads count both ranks'
    tokens once; wandb's window values are the windows' largest; the summary and its console
    line hold the run's."""
    from tests.test_titan_runner import WORLD, make_cfg, train

    from launch.run.wandb_offline import read_runs

    cfg = make_cfg("deepseek_v3", steps=6)
    cfg.parallelism.ep, cfg.parallelism.name = 1, "fsdp2"
    cfg.logging.log_freq = 2
    run_dir = tmp_path / "ep1"
    summary = train(cfg, run_dir)

    lines = _routing_lines(run_dir)
    assert [line["step"] for line in lines] == list(range(1, 7))
    tokens = WORLD * cfg.training.local_batch_size * cfg.training.seq_len
    assert all(line["layers"] == [0, 1] and line["picks"] == [2 * tokens] * 2 for line in lines)  # top-2
    assert all(sorted(line["load"]) == ["2", "4", "8"] for line in lines)
    assert all(1.0 <= v <= int(e) for line in lines for e, vs in line["load"].items() for v in vs)

    (run,) = read_runs(str(run_dir))
    for e in (2, 4, 8):
        windows = [_window_max(lines, steps, e) for steps in (range(1, 2), range(2, 3), range(3, 5), range(5, 7))]
        assert run.series(imbalance_metric(e)) == pytest.approx(windows, abs=1e-4)
        load = summary["moe_imbalance"][f"ep{e}"]
        assert load["max"] == pytest.approx(max(windows), abs=1e-4)
        assert load["last"] == pytest.approx(windows[-1], abs=1e-4)
        assert run.summary[f"{imbalance_metric(e)}_max"] == pytest.approx(load["max"])
    assert "routing load    EP 2 " in format_summary(RunSummary.read(run_dir))


def test_an_ep2_symm_run_counts_a_replayed_step_once(tmp_path):
    """EP=2 over symm at half the balanced capacity: step 1 overflows and runs again; its loads
    count its tokens once, and the run's own EP is reported."""
    from tests.test_titan_runner import WORLD, make_cfg, train

    cfg = make_cfg("deepseek_v3", a2a="bf16", steps=3, wandb_mode="disabled", transport="symm", capacity_factor=0.5)
    summary = train(cfg, tmp_path / "ep2")
    assert summary["capacity_replay_steps"][:1] == [1]
    lines = _routing_lines(tmp_path / "ep2")
    assert [line["step"] for line in lines] == [1, 2, 3]
    tokens = WORLD * cfg.training.local_batch_size * cfg.training.seq_len
    assert all(line["picks"] == [2 * tokens] * 2 for line in lines)
    assert set(summary["moe_imbalance"]) == {"ep2", "ep4", "ep8"}
