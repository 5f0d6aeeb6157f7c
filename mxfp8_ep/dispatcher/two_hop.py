"""Transport ``two_hop`` (EP groups that span nodes): each token goes once to each other node
that holds at least one of its experts, over the *rail*, the ranks of its local index on every
node (``exchange.node_hop``: one all-to-all of fixed size, NCCL across nodes, gloo on CPU),
with its expert ids on that node and its router scores; there the rank that received it fans it
out to the ranks holding those experts over peer memory, as one of its own tokens, through the
symm transport (``_NodeFanOut``: the symm dispatcher over the node's ranks, a token's picks on
other nodes masked). Combine goes the reverse way: each node adds up a token's expert outputs
it holds (symm's top-k reduction, a partial sum per token), sends one row per (token, node)
back over the rail, and the token's rank adds those in fp32, its own node's first, then the
others' in node order. The backward legs mirror them; the score gradients come back beside the
dispatch's gradient rows.

Each leg travels in its ``A2AConfig`` format on both hops: an MXFP8 token is quantized once for
the node hop, and the fan-out's quantizing of the decoded row gives the same values again
(MXFP8 is a fixed point of decode -> encode; ``floor`` scale rounding excepts blocks under
2**-118), so it crosses both hops as one MXFP8 row.

Sync-free: the node hop's buffers hold ``capacity`` rows per node pair, an elastic capacity
(``capacity.node_hop_capacity``: ``A2AConfig.capacity_factor`` times the balanced case,
growing up to ``capacity_ceiling`` times it) held beside symm's (``symm.hold_capacity``).
Every rank's tokens per node travel in one small all-gather with its fault word, on the
device; inside a replay scope a dispatch that needs more rows than the capacity counts an
overflow there (``ReplayScope.record``) and its step runs again under the same
``mxfp8_ep.elastic`` rule as symm's; outside one it reads the rows on the host and takes
exactly those. The fan-out is symm's own sync-free path.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from mxfp8_ep.dispatcher import checks, symm
from mxfp8_ep.dispatcher.base import TokenDispatcher, register_transport
from mxfp8_ep.dispatcher.push import PushDispatchMetadata
from mxfp8_ep.dispatcher.symm import ElasticCapacity, SymmTokenDispatcher, dispatch_scopes, hold_capacity
from mxfp8_ep.exchange import node_hop
from mxfp8_ep.exchange.capacity import node_hop_capacity, remote_node_share
from mxfp8_ep.transport import Transport


# One tensor from every rank into one flat tensor (torch >= 2.13 names it all_gather_single).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class NodeLayout:
    """Where a rank sits in an EP group of ``nodes`` nodes of ``ranks_per_node`` consecutive
    ranks each: its ``node`` and its ``local`` index there (its rail)."""

    nodes: int
    ranks_per_node: int
    node: int
    local: int


def node_layout(hosts: list[str], rank: int, ranks_per_node: int | None = None) -> NodeLayout:
    """The layout of an EP group whose rank ``r`` runs on ``hosts[r]``: nodes of
    ``ranks_per_node`` consecutive ranks (``A2AConfig.ranks_per_node``), or, when None, the
    consecutive ranks that share a host name. A clear error where that is no layout of at
    least 2 equal nodes."""
    world = len(hosts)
    if ranks_per_node is None:
        runs: list[list] = []
        for host in hosts:
            if runs and runs[-1][0] == host:
                runs[-1][1] += 1
            else:
                runs.append([host, 1])
        names = [name for name, _ in runs]
        if len(set(names)) != len(names) or len({count for _, count in runs}) != 1:
            raise ValueError(f"a2a.transport={Transport.TWO_HOP} takes nodes of consecutive EP ranks, the same number "
                             f"on each; the EP group's ranks run on hosts {hosts}")
        ranks_per_node = runs[0][1]
    elif world % ranks_per_node:
        raise ValueError(f"a2a.ranks_per_node={ranks_per_node} does not divide the EP group's {world} ranks")
    nodes = world // ranks_per_node
    if nodes < 2:
        raise ValueError(f"a2a.transport={Transport.TWO_HOP} takes an EP group that spans at least 2 nodes; its "
                         f"{world} ranks are on one: use {Transport.SYMM} (or {Transport.AUTO}), or set "
                         f"a2a.ranks_per_node to run nodes of that many ranks on one host")
    return NodeLayout(nodes=nodes, ranks_per_node=ranks_per_node, node=rank // ranks_per_node,
                      local=rank % ranks_per_node)


def _subgroups(group: dist.ProcessGroup, layout: NodeLayout) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's node group and rail group (made by their members only: other EP groups of
    the job make theirs alike)."""
    ranks = dist.get_process_group_ranks(group)
    G, backend = layout.ranks_per_node, dist.get_backend(group)
    node = ranks[layout.node * G : (layout.node + 1) * G]
    rail = ranks[layout.local :: G]
    return (dist.new_group(node, backend=backend, use_local_synchronization=True),
            dist.new_group(rail, backend=backend, use_local_synchronization=True))


class _NodeFanOut(SymmTokenDispatcher):
    """The symm transport over one node's ranks, for the tokens a rank holds after the node
    hop: its own and those the other nodes sent it, each with its picks on this node (the ids
    of the node's experts, ``num_experts`` of them) and the others masked (id ``num_experts``).
    The ids come from the two_hop dispatcher, which checked its input: no checks here. Its
    expert-major capacity is that of the whole EP group's ranks (``nodes`` times this
    group's) at a ``nodes``-th of its tokens per rank: the rows a rank's experts receive do
    not depend on the way they travel."""

    def __init__(self, config: TokenDispatcher.Config, group: dist.ProcessGroup, nodes: int):
        super().__init__(config, group)
        self.nodes = nodes

    def _capacity_shape(self, max_tokens: int) -> tuple[int, int, int, int, int]:
        cfg = self.config
        return max_tokens // self.nodes, cfg.top_k, self.ep * self.nodes, self.num_local_experts, cfg.pad_multiple

    def _checked_routing(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E):  # noqa: ARG002, N803
        self._shape = (x_TD.shape[1], x_TD.dtype)
        ids = topk_expert_ids_TK.reshape(-1)
        E = self.config.num_experts
        counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
        return checks.CheckedRouting(expert_ids=ids, counts=counts[:E],
                                     fault=torch.zeros((), dtype=torch.int64, device=ids.device)), None


@dataclass(frozen=True)
class _Hop:
    """A dispatch's node hop, for its combine and both backwards."""

    rows: node_hop.NodeRows
    node_of: torch.Tensor  # (T, K) the node of each pick
    tokens: int


@dataclass
class TwoHopMetadata:
    """What ``TwoHopTokenDispatcher.combine`` takes: the fan-out's metadata and the node hop."""

    fan_out: PushDispatchMetadata
    hop: _Hop


@register_transport(Transport.TWO_HOP)
class TwoHopTokenDispatcher(TokenDispatcher):
    """Node-deduplicated dispatch across nodes (module docstring): the node hop over the rail,
    then symm's fan-out inside the node."""

    def __init__(self, config: TokenDispatcher.Config, group: dist.ProcessGroup):
        super().__init__(config, group)
        cfg = self.config
        gathered = checks.agree(group, "two_hop layout", {"ranks_per_node": cfg.a2a.ranks_per_node},
                                local={"host": socket.gethostname()})
        self.layout = node_layout([g["host"] for g in gathered], self.rank, cfg.a2a.ranks_per_node)
        self.node_group, self.rail_group = _subgroups(group, self.layout)
        self.experts_per_node = self.num_local_experts * self.layout.ranks_per_node
        self.max_tokens: int | None = None  # tokens per rank the buffers hold (the first dispatch's, group-wide)
        self._fan_out: _NodeFanOut | None = None

    # -- the node hop's capacity

    def _capacity_key(self) -> tuple:
        a2a = self.config.a2a
        return ("node_hop", id(self.group), self.config.top_k, self.max_tokens, a2a.capacity_factor,
                a2a.capacity_ceiling)

    def _node_capacity_held(self) -> ElasticCapacity:
        cfg, T = self.config, self.max_tokens
        share = remote_node_share(cfg.num_experts, cfg.top_k, self.layout.nodes)

        def make() -> ElasticCapacity:
            start = node_hop_capacity(T, share, cfg.a2a.capacity_factor)
            ceiling = max(start, node_hop_capacity(T, share, cfg.a2a.capacity_ceiling))
            return ElasticCapacity(rows=start, ceiling=ceiling, worst=T, align=1, max_tokens=T)

        return hold_capacity(self._capacity_key(), make)

    def _node_capacity(self, needed: torch.Tensor) -> int:
        """The rows per node pair of this dispatch: the elastic capacity inside a replay scope
        (an overflow counted on the device), else exactly the rows ``needed`` ((1,) int64, the
        same on every rank), read on the host (the worst case needs no read)."""
        cap = self._node_capacity_held()
        scopes = dispatch_scopes(self)
        if scopes and not scopes[-1].exact:
            for scope in scopes:
                scope.record(self._capacity_key(), needed, cap.rows)
            return cap.rows
        if cap.rows >= cap.worst:
            return cap.worst
        if not scopes:
            symm.announce_unguarded()
        return max(1, min(cap.worst, int(needed[0])))

    # -- the dispatcher

    def _fan_out_for(self, tokens: int) -> _NodeFanOut:
        """The fan-out dispatcher, built at the first dispatch for the group's largest token
        count (or ``max_tokens_per_rank``): it holds ``nodes`` times that many tokens per rank."""
        if self._fan_out is None:
            cfg = self.config
            gathered = checks.agree(self.group, "two_hop buffers", {"max_tokens_per_rank": cfg.max_tokens_per_rank},
                                    local={"tokens": tokens})
            self.max_tokens = cfg.max_tokens_per_rank or max(g["tokens"] for g in gathered)
            fan_out = replace(cfg, num_experts=self.experts_per_node,
                              max_tokens_per_rank=self.layout.nodes * self.max_tokens)
            self._fan_out = _NodeFanOut(fan_out, self.node_group, self.layout.nodes)
        return self._fan_out

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E):  # noqa: N803
        cfg, layout = self.config, self.layout
        checked, fault = self._checked_routing(x_TD, topk_scores_TK, topk_expert_ids_TK, num_tokens_per_expert_E)
        tokens = checked.expert_ids.numel() // cfg.top_k
        fan_out = self._fan_out_for(tokens)
        device = checked.counts.device
        if fault is None and tokens > self.max_tokens:
            fault = checks.HostFault(checks.Fault.TOKENS, ValueError(
                f"two_hop dispatch: rank {self.rank} got {tokens} tokens, more than the buffers hold "
                f"({self.max_tokens} per rank); raise TokenDispatcher.Config.max_tokens_per_rank"))
            checked = checks.host_fault_routing(cfg.num_experts, fault.fault, device)
        node_of = checked.expert_ids.view(-1, cfg.top_k) // self.experts_per_node
        bound = node_hop.node_bound(node_of, layout.nodes, layout.node)
        # Every rank's tokens per node and fault word, to every rank: a rank whose input failed
        # a check fails every rank here, before any row moves.
        mine = torch.cat([bound.sum(dim=0), checked.fault.view(1)])
        table = torch.empty(self.ep * (layout.nodes + 1), dtype=torch.int64, device=device)
        _ALL_GATHER(table, mine, group=self.group)
        table = table.view(self.ep, layout.nodes + 1)
        if fault is not None:
            raise fault.error
        checks.assert_no_faults(table[:, layout.nodes], self.debug, cfg.num_experts, where="two_hop dispatch")
        needed = table[:, : layout.nodes].max().view(1)
        rows = node_hop.node_rows(bound, layout.node, self._node_capacity(needed))
        hop = _Hop(rows=rows, node_of=node_of, tokens=tokens)
        ids = checked.expert_ids.view(-1, cfg.top_k)
        x2, scores2, ids2 = _ToNodes.apply(x_TD, topk_scores_TK, ids, hop, self)
        routed, tokens_per_local_expert, meta = fan_out.dispatch(x2, scores2, ids2, None)
        return routed, tokens_per_local_expert, TwoHopMetadata(fan_out=meta, hop=hop)

    def combine(self, routed_output, metadata: TwoHopMetadata):
        partial = self._fan_out.combine(routed_output, metadata.fan_out)
        return _ToSources.apply(partial, metadata.hop, self)

    # -- what the node hop carries

    def _ids_on(self, ids: torch.Tensor, node_of: torch.Tensor, node: int) -> torch.Tensor:
        """``ids`` as node ``node``'s fan-out takes them: its experts' ids there, the others
        masked (``experts_per_node``)."""
        return torch.where(node_of == node, ids - node * self.experts_per_node, self.experts_per_node)

    def _leg(self, leg: str) -> tuple:
        a2a = self.config.a2a
        return a2a.wire_format(leg), a2a.scale_rounding, leg


class _ToNodes(torch.autograd.Function):
    """The node hop of dispatch: ``(x, scores)`` -> the fan-out's tokens (this rank's, then
    those the other nodes sent it), their scores and ids on this node."""

    @staticmethod
    def forward(ctx, x, scores, ids, hop, disp):
        ctx.hop, ctx.disp, ctx.scores_dtype = hop, disp, scores.dtype
        nodes, K = disp.layout.nodes, disp.config.top_k
        side = torch.cat([
            torch.stack([disp._ids_on(ids, hop.node_of, n) for n in range(nodes)], dim=1).to(torch.int32),
            scores.float().unsqueeze(1).expand(-1, nodes, -1).contiguous().view(torch.int32),
        ], dim=2)
        # A row no token filled reaches the fan-out with every pick masked: no expert takes it.
        fill = torch.cat([torch.full((K,), disp.experts_per_node, dtype=torch.int32, device=x.device),
                          torch.zeros(K, dtype=torch.int32, device=x.device)])
        received, received_side = node_hop.to_nodes(x.contiguous(), hop.rows, disp.rail_group,
                                                     *disp._leg("dispatch_fwd"), side=side, side_fill=fill)
        x2 = torch.cat([x, received])
        scores2 = torch.cat([scores, received_side[:, K:].contiguous().view(torch.float32).to(scores.dtype)])
        ids2 = torch.cat([disp._ids_on(ids, hop.node_of, disp.layout.node), received_side[:, :K].to(torch.int64)])
        ctx.mark_non_differentiable(ids2)
        return x2, scores2, ids2

    @staticmethod
    def backward(ctx, grad_x2, grad_scores2, _grad_ids):
        hop, disp = ctx.hop, ctx.disp
        T, node = hop.tokens, disp.layout.node
        if grad_scores2 is None:
            grad_scores2 = torch.zeros((grad_x2.shape[0], disp.config.top_k), dtype=torch.float32,
                                       device=grad_x2.device)
        side = grad_scores2[T:].float().contiguous().view(torch.int32)
        back, back_side = node_hop.to_sources(grad_x2[T:].contiguous(), hop.rows, disp.rail_group,
                                              *disp._leg("dispatch_bwd"), side=side)
        grad_x = grad_x2[:T].float()
        for n in hop.rows.blocks:
            grad_x = grad_x + back[:, n].float()
        returned = back_side.view(torch.float32)  # (T, N, K): the score gradients each node sent back
        theirs = returned.gather(1, hop.node_of.clamp(0, disp.layout.nodes - 1).unsqueeze(1)).squeeze(1)
        grad_scores = torch.where(hop.node_of == node, grad_scores2[:T].float(), theirs)
        return grad_x.to(grad_x2.dtype), grad_scores.to(ctx.scores_dtype), None, None, None


class _ToSources(torch.autograd.Function):
    """The node hop of combine: the fan-out's output (a partial sum per token it holds) -> each
    of this rank's tokens, its own node's partial sum plus those the other nodes sent back."""

    @staticmethod
    def forward(ctx, partial, hop, disp):
        ctx.hop, ctx.disp = hop, disp
        T = hop.tokens
        back, _ = node_hop.to_sources(partial[T:].contiguous(), hop.rows, disp.rail_group, *disp._leg("combine_fwd"))
        out = partial[:T].float()
        for n in hop.rows.blocks:
            out = out + back[:, n].float()
        return out.to(partial.dtype)

    @staticmethod
    def backward(ctx, grad):
        hop, disp = ctx.hop, ctx.disp
        received, _ = node_hop.to_nodes(grad.contiguous(), hop.rows, disp.rail_group, *disp._leg("combine_bwd"))
        return torch.cat([grad, received]), None, None
