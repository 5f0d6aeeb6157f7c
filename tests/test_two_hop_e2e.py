"""`python launch/train.py a2a.transport=two_hop` end to end on CPU: 4 gloo processes, EP 4 split
into 2 nodes of 2 ranks on this host (``a2a.ranks_per_node=2``), the tiny DeepSeek-V3 (8 experts,
top-2), side by side with the flat nccl all-to-all on the same layout. Both start from the same
weights and read the same batches, so their losses agree within fp32 sums in another order
(``ORDER_TOL``, as tests/test_two_hop.py states for the layer). About a minute and a half on 2
cores."""

from __future__ import annotations

from tests.train_cli import run_side_by_side

from launch.run.run_summary import INTER_NODE, RunSummary
from mxfp8_ep.config import LEGS

ORDER_TOL = 1e-5  # relative
COMMON = ("model=tiny_dsv3", "parallelism.procs_per_node=4", "parallelism.ep=4", "training.steps=3", "logging=none")
TWO_HOP = ("a2a.transport=two_hop", "a2a.ranks_per_node=2")


def test_two_hop_trains_as_the_flat_all_to_all_does(tmp_path):
    two_hop_dir, nccl_dir = tmp_path / "two_hop", tmp_path / "nccl"
    _, proc = run_side_by_side(tmp_path, (*COMMON, "a2a.transport=nccl", f"hydra.run.dir={nccl_dir}"),
                               (*COMMON, *TWO_HOP, f"hydra.run.dir={two_hop_dir}"))
    s, flat = RunSummary.read(two_hop_dir), RunSummary.read(nccl_dir)
    assert (s.transport, flat.transport) == ("two_hop", "nccl")
    assert s.world_size == s.ep == 4 and s.steps == flat.steps == 3
    for step, (mine, theirs) in enumerate(zip(s.losses, flat.losses, strict=True), start=1):
        assert abs(mine - theirs) <= ORDER_TOL * abs(theirs), f"step {step}: two_hop {mine} vs nccl {theirs}"
    # under the replay guard, as symm: its capacity reported
    assert s.capacity_rows is not None and flat.capacity_rows is None
    # every leg crosses between the 2 nodes, a part of its bytes; nccl counts none between nodes
    legs = s.a2a_bytes_per_step_by_leg
    assert all(0 < legs[f"{leg}_{INTER_NODE}"] < legs[leg] for leg in LEGS), legs
    assert legs[INTER_NODE] == sum(legs[f"{leg}_{INTER_NODE}"] for leg in LEGS)
    assert s.a2a_bytes_per_step == sum(legs[leg] for leg in LEGS)
    assert INTER_NODE not in flat.a2a_bytes_per_step_by_leg
    assert "  model tiny_dsv3  a2a bf16 over two_hop  parallelism" in proc.stdout
    assert "a symm dispatch" not in proc.stdout  # a replay's line names two_hop
    assert f"a2a bytes/step  {s.a2a_bytes_per_step:,.0f}, {legs[INTER_NODE]:,.0f} of them between nodes" in proc.stdout
