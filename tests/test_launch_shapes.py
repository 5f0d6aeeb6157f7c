"""Launch shapes (``mxfp8_ep.kernels.launch_shapes``): a bad shape is a clear error when it is made, and
a dispatcher hands every kernel call of a leg the shape its config gives that leg's format
(``TokenDispatcher.Config.launch_shapes``), the format's default where the config gives none.
Whether the kernels give the same bits at other shapes is tests/test_symm_kernels.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.config import LEG_FORMATS, A2AConfig
from mxfp8_ep.kernels.launch_shapes import KernelShapes, LaunchShape
from tests.moe_harness import preload, run_forked

KERNELS = ("push_rows", "push_tokens", "push_partials", "receive_rows", "reduce_slots")


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="block=3"):
        LaunchShape(block=3, warps=4)
    with pytest.raises(ValueError, match="warps=0"):
        LaunchShape(block=1, warps=0)
    with pytest.raises(ValueError, match="block_d=16"):
        LaunchShape(block=1, warps=4, block_d=16)
    with pytest.raises(ValueError, match="stripes=0"):
        LaunchShape(block=1, warps=4, stripes=0)
    with pytest.raises(ValueError, match="push_rows only"):
        replace(KernelShapes.default("bf16"), reduce_slots=LaunchShape(block=1, warps=4, stripes=2))
    with pytest.raises(ValueError, match="unknown wire format 'fp4'"):
        KernelShapes.default("fp4")
    for fmt in LEG_FORMATS:
        assert isinstance(KernelShapes.default(fmt), KernelShapes)


class _Recording:
    """A kernels module (``symm_reference``) whose pushes and receiving passes record the
    format and launch shape of each call."""

    def __init__(self, kernels, calls: list):
        self._kernels, self._calls = kernels, calls

    def __getattr__(self, name):
        fn = getattr(self._kernels, name)
        if name not in KERNELS:
            return fn

        def recorded(leg, *args, **kwargs):
            self._calls.append((name, leg.fmt, leg.launch(name)))
            return fn(leg, *args, **kwargs)

        return recorded


def _overrides() -> dict[str, KernelShapes]:
    """Shapes no default has, different per format: bf16 blocks of 2, MXFP8 blocks of 16."""
    return {
        fmt: KernelShapes(**{k: LaunchShape(block=block, warps=2, block_d=64) for k in KERNELS})
        for fmt, block in (("bf16", 2), ("mxfp8", 16))
    }


def _record(rank, world, top_k, transport, launch_shapes, calls):
    from mxfp8_ep.exchange import symm_reference
    from mxfp8_ep.dispatcher import TokenDispatcher

    torch.manual_seed(rank)
    config = TokenDispatcher.Config(
        num_experts=2 * world, top_k=top_k, pad_multiple=4, max_tokens_per_rank=4, launch_shapes=launch_shapes,
        a2a=A2AConfig.preset("mxfp8", kernel="torch", transport=transport),
    )
    dispatcher = config.build(dist.group.WORLD, torch.device("cpu"))
    dispatcher.kernels = lambda _device: _Recording(symm_reference, calls)
    x = torch.randn(4, 64, requires_grad=True)
    scores = torch.rand(4, top_k, requires_grad=True)
    ids = torch.stack([torch.randperm(2 * world)[:top_k] for _ in range(4)])
    routed, _, meta = dispatcher.dispatch(x, scores, ids, torch.bincount(ids.reshape(-1), minlength=2 * world))
    dispatcher.combine(routed * 2, meta).sum().backward()


def _check_calls(rank, world):
    torch.set_num_threads(1)  # a forked rank: no intra-op thread pool inherited half-made
    overrides = _overrides()
    for top_k, transport in ((1, "symm"), (2, "symm"), (2, "nccl")):
        for launch_shapes in (overrides, {"mxfp8": overrides["mxfp8"]}, None):
            calls: list = []
            _record(rank, world, top_k, transport, launch_shapes, calls)
            kernels = {name for name, _, _ in calls}
            expected = {"symm": {1: {"push_rows", "receive_rows", "reduce_slots"}, 2: set(KERNELS) - {"push_rows"}},
                        "nccl": {2: {"push_rows", "receive_rows", "reduce_slots"}}}[transport][top_k]
            assert kernels == expected, (top_k, transport, kernels)
            assert {fmt for _, fmt, _ in calls} == {"bf16", "mxfp8"}  # preset mxfp8: both formats
            for name, fmt, shape in calls:
                want = (launch_shapes or {}).get(fmt, KernelShapes.default(fmt))
                assert shape == getattr(want, name), (top_k, transport, name, fmt, shape)


def test_dispatcher_gives_each_kernel_call_its_legs_shape():
    preload(titan=False)
    run_forked(2, _check_calls)
