"""Transport ``nccl`` with an MXFP8 leg: the symm transport's kernels around one
``all_to_all_single`` per leg (multi-node NCCL, and gloo). Same kernels, same rows, same
reduction order as symm without its partial sums: the same bits."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from mxfp8_ep.exchange import routing
from mxfp8_ep.telemetry import wire_stats
from mxfp8_ep.dispatcher import checks
from mxfp8_ep.dispatcher.base import register_transport
from mxfp8_ep.dispatcher.nccl import HostCopy
from mxfp8_ep.dispatcher.push import ExchangeSplits, ExpertRowRouting, PushTokenDispatcher
from mxfp8_ep.exchange.peer_memory import LocalBuffer
from mxfp8_ep.exchange.staging import staged_row_nbytes
from mxfp8_ep.transport import Transport

# torch 2.13 renamed funcol.all_gather_tensor to all_gather_single (the old name warns); the GPU
# machine's torch 2.11 may have only the old one.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@register_transport(Transport.NCCL)
class FusedNcclTokenDispatcher(PushTokenDispatcher):
    """All-to-all transport (multi-node NCCL, and gloo) for configs with an MXFP8 leg, on the
    symm transport's kernels: each leg is one ``push_rows`` into a rank-major send buffer
    (rows gathered by token and quantized in the same pass; rows that stay on this rank go
    unquantized straight into the expert-major output), ONE ``all_to_all_single`` of packed
    rows (MXFP8: ``D`` e4m3 bytes then ``D/32`` scale bytes per row, so the scales need no
    second exchange), and one receiving pass that dequantizes into the expert-major layout the
    grouped GEMM takes (``receive_rows``) or into the fp32 top-k reduction (``reduce_slots``).
    bf16 legs of the same config take the same path unquantized. The counts travel in one
    all-gather and their splits reach the host once per layer (the one device-to-host sync,
    as torchtitan); dispatch returns exactly the received rows plus per-expert padding.

    An expert-bound leg pushes the rows that leave first, starts the exchange, then pushes the
    rows that stay while the exchange runs. In dispatch's forward the host waits for the splits
    only after the first push is queued (into a send buffer sized for every sorted row), so
    the GPU stays busy through that wait."""

    @classmethod
    def serves(cls, config) -> bool:
        return config.a2a.any_quantized

    def _routing(self, x_TD, checked, fault):  # noqa: N803
        W, E, L, align = self.ep, self.config.num_experts, self.num_local_experts, self.config.pad_multiple
        sent = torch.cat([checked.counts, checked.fault.view(1)])  # the counts, then the fault word
        gathered = funcol.wait_tensor(_all_gather(sent, 0, self.group)).view(W, E + 1)
        if fault is not None:
            raise fault.error
        counts_WE, faults = gathered[:, :E].contiguous(), gathered[:, E]
        rows_WW = counts_WE.view(W, W, L).sum(dim=2)  # [s, d]: rows rank s sends rank d
        # The one device-to-host sync of this transport (torchtitan makes the same one). The
        # copy is queued now; the host waits for it only when the expert rows are first needed,
        # after the push of the rows that leave: that push keeps the GPU busy meanwhile. Every
        # rank's fault word comes with it: a rank whose input failed its checks fails every
        # rank there, before the exchange (the routing it pushed by is safe to index with).
        splits = HostCopy(torch.stack([rows_WW[self.rank], rows_WW[:, self.rank], faults]))
        tables = routing.exchange_tables(counts_WE, self.rank, align)
        kernels = self.kernels(x_TD.device)

        def expert_rows() -> ExpertRowRouting:
            send, recv, faults = splits.tolist()
            checks.raise_on_faults(faults, E)
            capacity = (sum(recv) + L * align + align - 1) // align * align
            send[self.rank] = recv[self.rank] = 0
            return ExpertRowRouting(capacity, *kernels.expert_row_routing(tables, self.rank, W, capacity),
                                    splits=ExchangeSplits(send=send, recv=recv))

        return tables, expert_rows

    def _push_to_experts(self, push, src, meta, leg, fmt, weight, dot_with, dot_out,  # noqa: ARG002
                         dot_with_expert_rows=False):  # noqa: ARG002 (push does the rows; dots: the token's rank)
        nbytes = staged_row_nbytes(src.shape[1], src.dtype, fmt)
        # Before the host has the splits (dispatch forward), the send buffer is sized for every
        # sorted row: the rows that leave this rank are at most all of them.
        rows = sum(meta.splits.send) if meta.expert_rows_known else meta.dst_rank.numel()
        send = LocalBuffer(torch.empty(rows * nbytes, dtype=torch.uint8, device=src.device), self.ep)
        staged = self._staged(send, rows, fmt)
        push(None, staged, "remote")
        splits = meta.splits  # (waits for the host copy of the splits on the first dispatch leg)
        num_send, num_recv = sum(splits.send), sum(splits.recv)
        wire_stats.record(leg, num_send * nbytes)  # a staged row is its wire size
        received = funcol.all_to_all_single(
            send.local[: num_send * nbytes].view(num_send, nbytes), splits.recv, splits.send, self.group
        )
        # The rows that stay go straight into the expert-major tensor while the exchange runs.
        out = src.new_empty((meta.capacity, src.shape[1]))
        push(out, staged, "local")
        received = funcol.wait_tensor(received)
        return out, self._staged(LocalBuffer(received.view(-1), self.ep), num_recv, fmt), meta.return_row, None

    def _send_buffer(self, src, meta, leg, fmt):
        rows = sum(meta.splits.recv)  # the token-bound direction sends what dispatch received
        nbytes = staged_row_nbytes(src.shape[1], src.dtype, fmt)
        wire_stats.record(leg, rows * nbytes)  # a staged row is its wire size
        return self._staged(LocalBuffer(torch.empty(rows * nbytes, dtype=torch.uint8, device=src.device), self.ep),
                            rows, fmt)

    def _exchange(self, sent, src, meta):
        send, recv = meta.splits.recv, meta.splits.send
        nbytes = staged_row_nbytes(src.shape[1], src.dtype, sent.fmt)
        received = funcol.wait_tensor(
            funcol.all_to_all_single(sent.staging.local.view(sent.rows, nbytes), recv, send, self.group)
        )
        return self._staged(LocalBuffer(received.view(-1), self.ep), sum(recv), sent.fmt), meta.dst_row
