"""All-to-all-v whose forward and backward legs each travel as bf16 (the input's dtype) or MXFP8.

An MXFP8 leg: quantize the rows bound for other ranks, launch two asynchronous exchanges with
the same row splits (e4m3 payload viewed as uint8, e8m0 scales as uint8 – NCCL and gloo send
neither float8 dtype), wait on both, dequantize to the input dtype. Rows a rank sends to
itself skip the wire and the quantizer and come back bit-exact.

Splits are host lists (as torchtitan already has them), so the ops make no device-to-host
sync: no ``.item()``, ``.tolist()`` or host copies. The same code runs on NCCL and gloo.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from mxfp8_ep.telemetry import wire_stats
from mxfp8_ep.format.mxfp8 import MXFP8Tensor, check_quantizable
from mxfp8_ep.kernels.quantize import dequantize, encodes, quantize
from mxfp8_ep.format.wire_format import wire_format


def _check_splits(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> None:
    world = dist.get_world_size(group)
    if len(input_splits) != world or len(output_splits) != world:
        raise ValueError(
            f"all_to_all_v needs one split per rank (world size {world}), got "
            f"input_splits={list(input_splits)} output_splits={list(output_splits)}"
        )
    if any(s < 0 for s in input_splits) or any(s < 0 for s in output_splits):
        raise ValueError(f"negative split in input={list(input_splits)} output={list(output_splits)}")
    if sum(input_splits) != x.shape[0]:
        raise ValueError(
            f"input_splits sum to {sum(input_splits)} rows but the input has {x.shape[0]} "
            f"(shape {tuple(x.shape)})"
        )
    rank = dist.get_rank(group)
    if input_splits[rank] != output_splits[rank]:
        raise ValueError(
            f"rank {rank} sends itself {input_splits[rank]} rows but expects {output_splits[rank]}"
        )


def exchange(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    fmt: str = "bf16",
    rounding: str = "rceil",
    kernel: str = "auto",
    leg: str = "a2a",
) -> torch.Tensor:
    """One all-to-all-v (no autograd): row block ``i`` of ``x`` (``input_splits[i]`` rows)
    goes to rank ``i``; the result stacks the blocks received from each rank in rank order."""
    output_splits, input_splits = [int(s) for s in output_splits], [int(s) for s in input_splits]
    _check_splits(x, output_splits, input_splits, group)
    wire = wire_format(fmt)
    if wire.quantized and not encodes(wire):
        raise ValueError(f"all_to_all_v quantizes with mxfp8_ep.kernels.quantize (e4m3 elements, e8m0 scales), which "
                         f"does not encode {wire}")
    if wire.quantized:
        # Fail on every rank before any collective starts: no rank is left waiting.
        check_quantizable(x)
    x = x.contiguous()
    rank = dist.get_rank(group)
    remote_rows = sum(input_splits) - input_splits[rank]
    wire_stats.record(leg, remote_rows * wire_stats.row_bytes(math.prod(x.shape[1:]), x.element_size(), fmt))

    if not wire.quantized:
        out = funcol.all_to_all_single(x, output_splits, input_splits, group)
        return funcol.wait_tensor(out)

    # Rows kept on this rank never cross the wire: exchange only the others.
    send_start = sum(input_splits[:rank])
    send_end = send_start + input_splits[rank]
    local_rows = x[send_start:send_end]
    remote = torch.cat([x[:send_start], x[send_end:]]) if input_splits[rank] else x
    send_splits = list(input_splits)
    recv_splits = list(output_splits)
    send_splits[rank] = 0
    recv_splits[rank] = 0

    q = quantize(remote, rounding, kernel)
    # Both exchanges are in flight before either is waited on.
    data = funcol.all_to_all_single(q.data.view(torch.uint8), recv_splits, send_splits, group)
    scale = funcol.all_to_all_single(q.scale, recv_splits, send_splits, group)
    received = MXFP8Tensor(funcol.wait_tensor(data).view(torch.float8_e4m3fn), funcol.wait_tensor(scale))
    remote_out = dequantize(received, x.dtype, kernel)

    recv_start = sum(output_splits[:rank])
    return torch.cat([remote_out[:recv_start], local_rows, remote_out[recv_start:]])


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, fwd_fmt, bwd_fmt, rounding, kernel, legs):
        ctx.splits = (output_splits, input_splits)
        ctx.group, ctx.bwd_fmt, ctx.rounding, ctx.kernel, ctx.bwd_leg = group, bwd_fmt, rounding, kernel, legs[1]
        return exchange(x, output_splits, input_splits, group, fwd_fmt, rounding, kernel, legs[0])

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        # The gradient flows back along the transposed exchange.
        grad_in = exchange(
            grad_out, input_splits, output_splits, ctx.group,
            ctx.bwd_fmt, ctx.rounding, ctx.kernel, ctx.bwd_leg,
        )
        return grad_in, None, None, None, None, None, None, None, None


def all_to_all_v(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    forward_format: str = "bf16",
    backward_format: str = "bf16",
    rounding: str = "rceil",
    kernel: str = "auto",
    legs: tuple[str, str] = ("a2a_fwd", "a2a_bwd"),
) -> torch.Tensor:
    """Differentiable all-to-all-v; ``forward_format`` / ``backward_format`` choose the wire
    format of the forward exchange and of its gradient. ``legs`` name them in ``wire_stats``."""
    return _AllToAllV.apply(
        x, list(output_splits), list(input_splits), group,
        forward_format, backward_format, rounding, kernel, legs,
    )
