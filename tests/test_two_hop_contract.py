"""The two_hop transport's contract beside its numbers (tests/test_two_hop.py), on a CPU world of
2 nodes x 2 ranks (gloo for the node hop, the symm twins inside a node):

* bytes: at the worst case each leg's node hop sends what ``capacity.node_hop_bytes`` counts,
  the rows of its blocks that carry no token reach no expert, and a top-1 fan-out counts the
  rows it sends to another rank of the node, not its masked slots;
* replays and spills: at a cut capacity (the node hop's and the fan-out's) a guarded step that
  overflows reruns, and one past the ceiling spills; every output and gradient is bit for bit
  the worst case's (``capacity_factor=None``), and so is a dispatch outside any guard;
* no host read: a guarded step at a capacity that fits reads no device value in the library
  (every ``Tensor`` read to the host is spied on) but where a CUDA step reads none or reads once
  by design (``ALLOWED``);
* bad input on one rank (an expert id out of range, counts that disagree with the ids, more
  tokens than the buffers hold, a model dim MXFP8 cannot carry): a clear error on every rank
  within seconds, naming the rank; then a valid batch goes through;
* a fuzz of routings, token counts (a rank with none included) and presets against the flat
  nccl transport;
* the node layout a two_hop group needs, and ``auto`` choosing two_hop.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep import elastic
from mxfp8_ep.config import LEGS, A2AConfig
from mxfp8_ep.dispatcher import symm
from mxfp8_ep.dispatcher.two_hop import node_layout
from mxfp8_ep.exchange.capacity import node_hop_bytes
from mxfp8_ep.exchange.staging import staged_row_nbytes
from mxfp8_ep.telemetry import wire_stats
from mxfp8_ep.transport import Transport, resolve
from tests.distributed import SHARED_GPU, rank_device, run_on_ranks
from tests.moe_harness import bits, preload, rel_err, run_forked, setup_rank
from tests.round_trips import TIMEOUT_S, fails_everywhere
from tests.two_hop_layer import DIM, LOCAL_EXPERTS, TOKENS, layer_config, layer_inputs, run_layer

NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
CUT = 0.5  # a capacity factor that a routing to one node overflows, on both hops


def _build(preset, top_k, factor=None, ceiling=None, score_before=False):
    config = layer_config(WORLD, top_k, preset, "two_hop", score_before, ranks_per_node=RANKS_PER_NODE,
                          capacity_factor=factor, capacity_ceiling=ceiling)
    return config.build(dist.group.WORLD, rank_device())


def _same(got, want, where):
    for a, b, what in zip(got, want, ("output", "x grad", "score grad", "expert grad"), strict=True):
        assert a.shape == b.shape and torch.equal(bits(a), bits(b)), f"{what} differs: {where}"


# ---------------------------------------------------------------------------------------------
# replays and spills


def _replays_and_spills(rank, world):
    setup_rank()
    for preset, top_k, score_before in (("bf16", 2, False), ("mxfp8_all", 3, False), ("mxfp8", 1, True)):
        for to_node in (None, 1 - rank // RANKS_PER_NODE):  # uniform; every pick on the other node
            x, scores, ids, weights, grad_out = layer_inputs(rank, world, top_k, 11 + top_k, to_node=to_node)
            inputs = (x, scores, ids, weights, rank, grad_out)
            where = f"rank {rank} {preset} top-{top_k} to node {to_node}"
            symm.release_peer_buffers()
            _experts_get_the_flat_transports_rows(x, scores, ids, preset, top_k, score_before)
            wire_stats.reset()
            want = run_layer(_build(preset, top_k, score_before=score_before), *inputs)
            sent = wire_stats.snapshot(reset=True)
            _sent_what_the_buffers_hold(sent, preset, top_k, x.dtype)
            if top_k == 1:
                _fan_out_sent_its_crossing_rows(sent, preset, ids, rank, x.dtype)
            # A cut capacity: the step reruns at the grown one.
            symm.release_peer_buffers()
            dispatcher = _build(preset, top_k, CUT, score_before=score_before)
            guard = elastic.ReplayGuard(())
            for _ in guard.attempts():
                got = run_layer(dispatcher, *inputs)
            _same(got, want, where)
            if to_node is not None:
                assert guard.replays >= 1 and guard.spills == 0, (guard.replays, guard.spills, where)
            # A ceiling at the cut: the step spills (each dispatch at exactly its rows).
            symm.release_peer_buffers()
            dispatcher = _build(preset, top_k, CUT, CUT, score_before=score_before)
            guard = elastic.ReplayGuard(())
            for _ in guard.attempts():
                got = run_layer(dispatcher, *inputs)
            _same(got, want, f"{where}, spilled")
            if to_node is not None:
                assert guard.spills >= 1, (guard.replays, guard.spills, where)
            # No guard: the dispatch reads its rows on the host and takes exactly those.
            _same(run_layer(dispatcher, *inputs), want, f"{where}, unguarded")
    symm.release_peer_buffers()


def _experts_get_the_flat_transports_rows(x, scores, ids, preset, top_k, score_before):
    """At the worst case, where most rows of a node-hop block carry no token, each expert gets
    the rows flat nccl gives it, no more: a row no token filled reaches no expert."""
    counts = torch.bincount(ids.reshape(-1), minlength=LOCAL_EXPERTS * WORLD)
    got = _build(preset, top_k, score_before=score_before).dispatch(x, scores, ids, counts)[1]
    flat = layer_config(WORLD, top_k, preset, "nccl", score_before).build(dist.group.WORLD, rank_device())
    assert torch.equal(got.cpu(), flat.dispatch(x, scores, ids, counts)[1].cpu()), (got, preset, top_k)
    symm.release_peer_buffers()


def _sent_what_the_buffers_hold(sent, preset, top_k, dtype):
    """At the worst case each leg's node hop sends a full block of ``TOKENS`` rows to each other
    node, as ``capacity.node_hop_bytes`` (the memory estimate's) counts them."""
    a2a = A2AConfig.preset(preset)
    for leg in LEGS:
        row = staged_row_nbytes(DIM, dtype, a2a.wire_format(leg))
        want = node_hop_bytes(NODES, TOKENS, row, top_k, leg) // 2  # the send buffer
        assert sent.get(wire_stats.inter_node_key(leg)) == want, (leg, sent)


def _fan_out_sent_its_crossing_rows(sent, preset, ids, rank, dtype):
    """Top-1 fans out row by row: over the group, dispatch's fan-out sends one row per pick whose
    expert sits at another local index than the token's rank (the rank that holds it after the
    node hop has the token's local index); a masked slot (a pick on another node) sends none."""
    local_of_expert = ids // LOCAL_EXPERTS % RANKS_PER_NODE
    crossing = torch.tensor([int((local_of_expert != rank % RANKS_PER_NODE).sum())])
    inside = torch.tensor([sent["dispatch_fwd"] - sent.get(wire_stats.inter_node_key("dispatch_fwd"), 0)])
    dist.all_reduce(crossing)
    dist.all_reduce(inside)
    fmt = A2AConfig.preset(preset).wire_format("dispatch_fwd")
    assert int(inside) == int(crossing) * wire_stats.row_bytes(DIM, dtype.itemsize, fmt), (int(inside), int(crossing))


def test_replays_and_spills_match_the_worst_case_bit_for_bit():
    preload(titan=False)
    run_forked(WORLD, _replays_and_spills, timeout_s=60)


# ---------------------------------------------------------------------------------------------
# no host read inside a guarded step

LIBRARY = Path(inspect.getfile(symm)).resolve().parents[1]
# Tensor methods that read a device value to the host, and torch functions whose output size
# depends on the values (a sync on CUDA).
READS = ("item", "tolist", "__int__", "__index__", "__float__", "__bool__", "nonzero", "unique", "masked_select")
# The reads a CUDA step does not make, or makes once a step by design: assert_no_faults (a host
# read on CPU, a device assert on CUDA), the kernels' torch twins (Triton kernels on CUDA) and
# the guard's one read of the overflow count after the step.
ALLOWED = {"checks.py", "symm_reference.py", "elastic.py"}


class _HostReads:
    """Every call of ``READS`` made from a library file other than ``ALLOWED``, while active."""

    def __init__(self):
        self.calls: list[str] = []
        self._saved = {}

    def _spy(self, name, original):
        def spied(*args, **kwargs):
            caller = inspect.stack(context=0)[1]
            path = Path(caller.filename).resolve()
            if LIBRARY in path.parents and path.name not in ALLOWED:
                self.calls.append(f"{name} at {path.relative_to(LIBRARY)}:{caller.lineno}")
            return original(*args, **kwargs)
        return spied

    def __enter__(self):
        for name in READS:
            for owner in (torch.Tensor, torch):
                if hasattr(owner, name):
                    self._saved[(owner, name)] = getattr(owner, name)
                    setattr(owner, name, self._spy(name, getattr(owner, name)))
        return self

    def __exit__(self, *exc):
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)


def _no_host_read(rank, world):
    setup_rank()
    for preset, top_k in (("mxfp8_all", 2), ("bf16", 1)):
        x, scores, ids, weights, grad_out = layer_inputs(rank, world, top_k, 5)
        counts = torch.bincount(ids.reshape(-1), minlength=LOCAL_EXPERTS * world)
        dispatcher = _build(preset, top_k, 2.0)
        guard = elastic.ReplayGuard(())
        for _ in guard.attempts():  # the first step: buffers, the group's agreement
            run_layer(dispatcher, x, scores, ids, weights, rank, grad_out)
        with _HostReads() as reads:
            for _ in guard.attempts():
                x_ = x.clone().requires_grad_(True)
                routed, _, meta = dispatcher.dispatch(x_, scores, ids, counts)
                dispatcher.combine(routed * 2, meta).backward(grad_out)
        assert guard.replays == 0
        assert reads.calls == [], f"{preset}: the library read the device in a guarded step: {reads.calls}"
        # The spy sees reads: outside a guard, a node hop at a cut capacity reads its rows.
        cut = _build(preset, top_k, CUT)
        run_layer(cut, x, scores, ids, weights, rank, grad_out)
        with _HostReads() as reads:
            run_layer(cut, x, scores, ids, weights, rank, grad_out)
        assert any("two_hop.py" in call for call in reads.calls), f"the spy saw no read: {reads.calls}"
    symm.release_peer_buffers()


def test_a_guarded_step_reads_nothing_from_the_device():
    preload(titan=False)
    run_forked(WORLD, _no_host_read, timeout_s=60)


# ---------------------------------------------------------------------------------------------
# bad input


def _bad_input(rank, world):
    setup_rank()
    E, top_k = LOCAL_EXPERTS * world, 2
    cases = {  # what rank 1 gets wrong -> what every rank's error says
        "id out of range": r"rank 1\b.*expert id",
        "counts": r"rank 1\b.*(count|num_tokens_per_expert)",
        "too many tokens": r"rank 1\b.*(tokens|max_tokens_per_rank)",
        "dim 40": r"(rank 1\b.*(multiple of 32|whole blocks)|multiple of 32.*dim 40)",
    }
    for preset in ("bf16", "mxfp8"):
        dispatcher = _build(preset, top_k)
        x, scores, ids, weights, grad_out = layer_inputs(rank, world, top_k, 3)
        run_layer(dispatcher, x, scores, ids, weights, rank, grad_out)  # steady state
        for case, match in cases.items():
            if case == "dim 40" and preset == "bf16":
                continue
            bx, bscores, bids = x, scores, ids.clone()
            counts = torch.bincount(ids.reshape(-1), minlength=E)
            if rank == 1:
                if case == "id out of range":
                    bids[0, 0] = E
                elif case == "counts":
                    counts = counts.roll(1)
                elif case == "too many tokens":
                    bx, bscores, bids = x.repeat(2, 1), scores.repeat(2, 1), ids.repeat(2, 1)
                    counts = torch.bincount(bids.reshape(-1), minlength=E)
                else:
                    bx = x[:, :40].contiguous()
            fails_everywhere(lambda: dispatcher.dispatch(bx, bscores, bids, counts), ValueError, match, rank)
        # Still in step: a valid batch goes there and back.
        got = run_layer(dispatcher, x, scores, ids, weights, rank, grad_out)
        want = run_layer(layer_config(world, top_k, preset, "nccl").build(dist.group.WORLD, rank_device()),
                         x, scores, ids, weights, rank, grad_out)
        assert rel_err(got[0], want[0]) < 1e-5, f"{preset}: out of step after a failed dispatch"
    symm.release_peer_buffers()


def test_bad_input_on_one_rank_fails_every_rank():
    preload(titan=False)
    run_forked(WORLD, _bad_input, timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# fuzz


def _fuzz(rank, world, examples):
    setup_rank()
    replays = empty = 0
    for seed in range(examples):
        g = torch.Generator().manual_seed(seed)  # the same draws on every rank
        top_k = int(torch.randint(1, 5, (1,), generator=g))
        preset = ("bf16", "mxfp8", "mxfp8_all")[int(torch.randint(0, 3, (1,), generator=g))]
        factor = (None, 0.5, 1.25)[int(torch.randint(0, 3, (1,), generator=g))]
        counts = torch.randint(0, TOKENS + 1, (world,), generator=g)
        counts[int(torch.randint(0, world, (1,), generator=g))] = 0 if seed % 3 == 0 else counts[0]
        to_node = None if seed % 2 else int(torch.randint(0, NODES, (1,), generator=g))
        tokens = int(counts[rank])
        x, scores, ids, weights, grad_out = layer_inputs(rank, world, top_k, 100 + seed, tokens=tokens,
                                                         to_node=to_node)
        score_before = bool(seed % 4 == 1) and top_k == 1
        inputs = (x, scores, ids, weights, rank, grad_out)
        where = f"seed {seed}: {preset} top-{top_k} factor {factor} tokens {counts.tolist()} to node {to_node}"
        guard = elastic.ReplayGuard(())
        dispatcher = _build(preset, top_k, factor, score_before=score_before)
        for _ in guard.attempts():
            got = run_layer(dispatcher, *inputs)
        replays, empty = replays + guard.replays, empty + int((counts == 0).any())
        flat = layer_config(world, top_k, preset, "nccl", score_before).build(dist.group.WORLD, rank_device())
        want = run_layer(flat, *inputs)
        for a, b, what in zip(got, want, ("output", "x grad", "score grad", "expert grad"), strict=True):
            assert a.shape == b.shape, (what, where)
            if preset == "bf16" and b.numel():
                assert rel_err(a, b) <= 1e-5, (what, where, rel_err(a, b))
            elif b.numel() and b.norm() > 0:
                # MXFP8: both round the same rows once per leg; the sums differ in order and in
                # where a partial sum is rounded
                assert rel_err(a, b) <= 3 * 2.0**-4, (what, where, rel_err(a, b))
        symm.release_peer_buffers()
    assert replays and empty, f"the fuzz met no overflow ({replays}) or no rank without tokens ({empty})"


FUZZ_EXAMPLES = 24


def test_fuzz_against_the_flat_nccl_transport():
    preload(titan=False)
    run_forked(WORLD, _fuzz, FUZZ_EXAMPLES, timeout_s=60)


# ---------------------------------------------------------------------------------------------
# the fan-out's Triton kernels, masked slots included

SCORE_RTOL = 1e-5  # the kernels' score dot products sum in a tree (tl.sum), the twins in order


def _kernels_equal_twins(rank, world):
    setup_rank()
    for preset, top_k in (("mxfp8_all", 3), ("bf16", 2)):
        x, scores, ids, weights, grad_out = layer_inputs(rank, world, top_k, 40 + top_k, tokens=6)
        runs = {}
        for kernel in ("torch", "triton"):
            config = layer_config(world, top_k, preset, "two_hop", ranks_per_node=RANKS_PER_NODE, kernel=kernel)
            dispatcher = config.build(dist.group.WORLD, rank_device())
            runs[kernel] = run_layer(dispatcher, x, scores, ids, weights, rank, grad_out)
            symm.release_peer_buffers()
        (out, x_grad, score_grad, expert_grad), want = runs["triton"], runs["torch"]
        for got, ref, what in ((out, want[0], "output"), (x_grad, want[1], "x grad"),
                               (expert_grad, want[3], "expert grad")):
            assert torch.equal(bits(got), bits(ref)), f"{preset}: {what} differs from the twins'"
        scale = float(want[2].abs().max())
        assert torch.allclose(score_grad, want[2], rtol=SCORE_RTOL, atol=SCORE_RTOL * scale), preset


needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the ranks share it)")


def test_the_fan_outs_triton_kernels_equal_their_twins_with_masked_slots():
    """The fan-out's kernels (under the Triton interpreter on CPU) take a token's picks on other
    nodes as masked slots: the layer's output and gradients equal the torch twins' bit for bit
    (the score gradients to ``SCORE_RTOL``)."""
    import mxfp8_ep.exchange.symm_kernels  # noqa: F401  (Triton and the kernels, once, before the ranks fork)

    preload(titan=False)
    run_forked(WORLD, _kernels_equal_twins, timeout_s=300)


@needs_a_gpu
def test_on_one_gpu_the_compiled_kernels_equal_their_twins_and_replays_match_the_worst_case():
    """2 nodes x 2 ranks sharing one GPU (``tests.shared_gpu``: gloo for the node hop and the
    counts, CUDA IPC peers inside a node): the compiled kernels against the torch twins on CUDA,
    and the replay and spill checks with the compiled kernels and CUDA counters."""
    run_on_ranks(WORLD, _kernels_equal_twins, backend=SHARED_GPU, timeout_s=300)
    run_on_ranks(WORLD, _replays_and_spills, backend=SHARED_GPU, timeout_s=300)


# ---------------------------------------------------------------------------------------------
# layout


def test_the_node_layout_is_equal_nodes_of_consecutive_ranks():
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert node_layout(hosts, 3) == type(node_layout(hosts, 3))(nodes=3, ranks_per_node=2, node=1, local=1)
    assert node_layout(["h"] * 4, 2, ranks_per_node=2).node == 1  # nodes emulated on one host
    for hosts in (["a", "a", "a", "b"], ["a", "b", "a", "b"]):  # unequal nodes; a node's ranks not consecutive
        with pytest.raises(ValueError, match=r"nodes of consecutive EP ranks, the same number on each.*hosts"):
            node_layout(hosts, 0)
    with pytest.raises(ValueError, match=r"spans at least 2 nodes.*one"):
        node_layout(["a", "a"], 0)
    with pytest.raises(ValueError, match=r"ranks_per_node=4 does not divide the EP group's 6 ranks"):
        node_layout(["h"] * 6, 0, ranks_per_node=4)


def test_auto_picks_two_hop_across_nodes_of_two_or_more_cuda_ranks():
    def spans(n):
        return lambda: n

    assert resolve("auto", cuda=True, ranks=16, hosts=spans(2)) is Transport.TWO_HOP
    assert resolve("auto", cuda=True, ranks=2, hosts=spans(2)) is Transport.NCCL  # one rank per node
    assert resolve("auto", cuda=True, ranks=8, hosts=spans(1)) is Transport.SYMM
    assert resolve("auto", cuda=False, ranks=16, hosts=spans(2)) is Transport.NCCL
    assert resolve("two_hop", cuda=False, ranks=4, hosts=spans(1)) is Transport.TWO_HOP
    with pytest.raises(ValueError, match="two_hop"):
        resolve("symm", cuda=True, ranks=16, hosts=spans(2))
