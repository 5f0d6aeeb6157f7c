"""How much memory one training process needs: an estimate from the model's facts and the
parallel layout, for the check before launch (``launch/preflight/validate.py``).

Per process (rank):

* parameters, gradients, optimizer state: fp32 master weights (4 bytes), fp32 gradients (4)
  and AdamW's two moments (8), sharded over all ranks (FSDP x TP for dense weights, EP x
  FSDP for the experts: either way over the world size);
* working copies: FSDP gathers one block (and prefetches the next) as bf16 weights with fp32
  gradients before the reduce-scatter (every block's bf16 weights when they are kept from
  forward to backward, ``parallelism.fsdp_reshard_after_forward=never``);
* activations at the configured batch, kept for the backward pass (bf16): per token per
  layer, attention and norms (~15 x dim bytes: Korthikanti et al. 2022 without the attention
  matrix, which sdpa/flex never store) plus the FFN (MoE: input, w1/w3 outputs and their
  product for every routed and shared expert a token visits, and the dispatch / combine
  buffers); the logits in bf16 and fp32 with their gradient. Full activation checkpointing
  keeps only each layer's input (plus one layer being recomputed); selective keeps about half;
  TP splits what is left. The symm transport (``symm``) at an elastic capacity keeps each MoE
  layer's expert-side tensors (``pooled_row_bytes`` a routed row) in one activation pool per
  step at the rows the routing used: ``pool_rows``, a pool factor times the balanced rows of
  all MoE layers together (a rank's rows summed over the layers, far closer to balanced than
  its busiest layer's), kept like the rest of the layer under the checkpointing, less the last
  such layer (``activation_pool_size.pooled_layers``); only one layer's expert-side tensors
  live at its capacity (``mxfp8_ep.exchange.capacity``: ``a2a.capacity_factor x top_k`` rows per token
  plus padding, ``EP x top_k`` at the worst case): the layer being computed, or the last one,
  kept as it is for its backward. At ``capacity_factor=None`` (nothing grows, nothing reruns) every
  layer's tensors hold the worst case. The all-to-all (nccl) keeps the rows received, ``top_k``
  per token at an even routing (``routed_load`` times that where a rank's sum over the layers
  is above balanced), and a gathered copy for dispatch;
* the symm transport's peer buffers (a staging pair per buffer set, once per process; a step
  above the capacity's ceiling reruns at exact rows on memory this estimate counts);
* the two_hop transport (EP groups across ``N`` nodes of ``G`` ranks): inside each node a symm
  dispatcher over its ``G`` ranks, each relaying up to ``N x T`` tokens (its own and up to ``T``
  from each other node) into the flat EP group's expert-major capacity, so its expert rows are
  symm's at the flat EP degree and its staging buffers symm's for ``ep=G, max_tokens=N x T``
  (no activation pool: every layer keeps its rows at the capacity); plus the node hop's send
  and receive buffers (``capacity.node_hop_bytes``), rows per node pair at the same capacity
  factor of the balanced case (``capacity.node_hop_capacity``), rows of the widest leg's format;
* the runtime: CUDA context and communication buffers on a GPU, the imported libraries of a
  CPU process.

It is an estimate (allocator fragmentation, temporary buffers and compile are not in it);
``validate.memory=warn`` launches anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launch.config.model_facts import ModelFacts
from launch.config.two_hop_layout import two_hop_nodes
from mxfp8_ep.pool import activation_pool_size
from mxfp8_ep.exchange.capacity import (expert_major_capacity, node_hop_bytes, node_hop_capacity, remote_node_share,
                                        symm_staging_bytes)
from mxfp8_ep.config import (DEFAULT_CAPACITY_CEILING, DEFAULT_CAPACITY_FACTOR, DEFAULT_POOL_FACTOR, LEGS)
from mxfp8_ep.format.wire_format import WIRE_FORMATS, WireFormat
from mxfp8_ep.transport import TRANSPORTS, Transport, resolve

BF16, FP32 = 2, 4
ADAM_STATE = 2 * FP32
# Measured: a CPU worker of this recipe holds ~0.55 GiB before its model; CUDA context + NCCL.
RUNTIME_BYTES = {"cpu": int(0.6 * 1024**3), "cuda": int(1.5 * 1024**3)}
_KEPT = {"none": 1.0, "selective": 0.5}
# Each local expert's rows are padded to this (torchtitan's TOKEN_GROUP_ALIGN_SIZE_M for bf16).
EXPERT_ALIGN = 8


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    working_copies: int
    activations: int
    runtime: int
    peer_buffers: int = 0
    # symm at an elastic capacity: the activation pool (every MoE layer's kept expert-side
    # tensors at their routed rows) and one layer's expert-side tensors at the capacity.
    activation_pool: int = 0
    layer_transient: int = 0
    # two_hop: the node hop's send and receive buffers.
    node_hop: int = 0

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.working_copies
                + self.activations + self.runtime + self.peer_buffers + self.activation_pool
                + self.layer_transient + self.node_hop)

    def parts(self) -> list[tuple[str, int]]:
        """(label, bytes) of each part the estimate holds, in the order the messages give them
        (the sync-free transports' only where they run)."""
        return [(label, getattr(self, name)) for name, label in PART_LABELS
                if getattr(self, name) or name not in SYNC_FREE_PARTS]

    def breakdown(self, activations_note: str = "") -> str:
        """``parameters 7.3, gradients 7.3, ..., symm peer buffers 0.4`` (GiB, one decimal),
        ``activations_note`` after the activations' figure."""
        return ", ".join(f"{label} {gib(n)}" + (f" {activations_note}" if label == "activations" and activations_note
                                                else "") for label, n in self.parts())


# The parts of a MemoryEstimate as the messages name them; SYNC_FREE_PARTS are the symm
# transport's (two_hop's hop inside a node is a symm dispatcher) and two_hop's node hop.
PART_LABELS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
               ("working_copies", "FSDP working copies"), ("activations", "activations"), ("runtime", "runtime"),
               ("activation_pool", "symm activation pool"), ("layer_transient", "one layer's symm expert rows"),
               ("peer_buffers", "symm peer buffers"), ("node_hop", "two_hop node-hop buffers"))
SYNC_FREE_PARTS = ("activation_pool", "layer_transient", "peer_buffers", "node_hop")
# The transports that run on peer memory at an elastic capacity, their steps under the replay
# guard (``mxfp8_ep.elastic``): symm, and two_hop, whose hop inside a node is a symm dispatcher.
SYNC_FREE = (Transport.SYMM, Transport.TWO_HOP)


def gib(n: float) -> str:
    """Bytes as GiB with one decimal (``59.3``), as every memory message gives them."""
    return f"{n / 1024**3:,.1f}"


def activation_bytes_per_token(m: ModelFacts, routed_rows: float | None = None,
                               kept_rows: float | None = None) -> tuple[float, float]:
    """Bytes kept for the backward per token: (all layers, one layer at most). Per token of an
    MoE layer: ``routed_rows`` expert rows (default top-k) and ``kept_rows`` rows the
    dispatcher keeps beside them (default: top-k for dispatch and top-k for combine)."""
    def ffn(hidden: int, copies: float) -> float:
        return copies * (m.dim + 4 * hidden) * BF16  # input, w1 and w3 outputs, act, product

    routed = m.top_k if routed_rows is None else routed_rows
    kept = 2 * m.top_k if kept_rows is None else kept_rows
    attention = 15 * m.dim
    moe_layer = attention + ffn(m.moe_hidden_dim, routed + m.num_shared_experts) + kept * m.dim * BF16
    dense_layer = attention + ffn(m.dense_hidden_dim, 1)
    layers = m.n_moe_layers * moe_layer + (m.n_layers - m.n_moe_layers) * dense_layer
    return layers, max(moe_layer, dense_layer if m.n_layers > m.n_moe_layers else 0)


def symm_capacity(m: ModelFacts, tokens: int, ep: int, capacity_factor: float | None) -> int:
    """Rows of the symm transport's expert-major tensors (``mxfp8_ep.exchange.capacity``)."""
    return expert_major_capacity(tokens, m.top_k, ep, m.num_experts // ep, EXPERT_ALIGN, capacity_factor)


def expert_row_bytes(m: ModelFacts) -> int:
    """Bytes of one routed row's expert-side tensors kept for the backward, as
    ``activation_bytes_per_token`` counts them: the expert's input, the w1 and w3 outputs, the
    activation and the product (``dim + 4 x moe_hidden_dim``), and combine's kept expert output
    (``dim``), bf16."""
    return (2 * m.dim + 4 * m.moe_hidden_dim) * BF16


def pool_rows(m: ModelFacts, tokens: int, ep: int, pool_factor: float) -> int:
    """Rows the symm transport's activation pool holds per rank and step
    (``mxfp8_ep.pool.activation_pool_size.pool_rows``): ``pool_factor`` times one layer's balanced
    rows (``tokens x top_k``, plus each local expert's padding), summed over the MoE layers."""
    return activation_pool_size.pool_rows(tokens, m.top_k, ep, m.num_experts // ep, EXPERT_ALIGN, m.n_moe_layers,
                                          pool_factor)


def pooled_row_bytes(m: ModelFacts, combine_partial_sums: bool) -> int:
    """Bytes the pool holds per routed row of one MoE layer
    (``mxfp8_ep.pool.activation_pool_size.pooled_row_bytes``, bf16)."""
    return activation_pool_size.pooled_row_bytes(m.dim, m.moe_hidden_dim, BF16, m.top_k > 1 and combine_partial_sums)


def symm_rows_per_token(m: ModelFacts, tokens: int, ep: int, combine_partial_sums: bool,
                        capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR) -> tuple[float, float]:
    """The symm transport's (routed rows, kept rows) per token of an MoE layer: its expert-side
    tensors hold its capacity; combine keeps that many expert-output rows with partial sums
    (top-k > 1: the models here put their scores after the experts exactly when top-k > 1),
    else each token's top-k rows; dispatch keeps no gathered copy."""
    routed = symm_capacity(m, tokens, ep, capacity_factor) / max(tokens, 1)
    partial = m.top_k > 1 and combine_partial_sums
    return routed, routed if partial else m.top_k


def symm_peer_buffer_bytes(m: ModelFacts, tokens: int, ep: int, combine_partial_sums: bool) -> int:
    """The symm transport's two staging buffers (``capacity.symm_staging_bytes``: rows of the
    widest format, bf16, then a token map and row weights of the worst case's rows): sized once,
    whatever the capacity, so growth and spills allocate no symmetric memory."""
    return symm_staging_bytes(ep, tokens, m.top_k, m.num_experts // ep, EXPERT_ALIGN,
                              m.top_k > 1 and combine_partial_sums, m.dim * BF16)


def two_hop_buffer_bytes(m: ModelFacts, tokens: int, ep: int, nodes: int, combine_partial_sums: bool,
                         capacity_factor: float | None, wire_row_bytes: int) -> tuple[int, int]:
    """The two_hop transport's (staging, node hop) bytes on an EP group of ``ep`` ranks over
    ``nodes`` nodes: the symm staging pair of its hop inside a node (``ep // nodes`` ranks,
    ``nodes x tokens`` tokens each), and the node hop's send and receive buffers at
    ``capacity_factor`` (None: every token) of the balanced rows per node pair, rows of
    ``wire_row_bytes``: the widest leg's, since each leg's buffers live only through its own
    exchange, one leg after another, and the caching allocator hands the largest one's memory
    to the others."""
    staging = symm_staging_bytes(ep // nodes, nodes * tokens, m.top_k, m.num_experts // ep, EXPERT_ALIGN,
                                 m.top_k > 1 and combine_partial_sums, m.dim * BF16)
    rows = node_hop_capacity(tokens, remote_node_share(m.num_experts, m.top_k, nodes), capacity_factor)
    return staging, node_hop_bytes(nodes, rows, wire_row_bytes, m.top_k)


def widest_row_bytes(m: ModelFacts, formats: list[str]) -> int:
    """Bytes of one row of the widest of the legs' wire ``formats`` (bf16 activations)."""
    known = [WireFormat(f) for f in formats if f in WIRE_FORMATS]
    return max((f.row_bytes(m.dim, BF16) for f in known), default=m.dim * BF16)


def estimate(m: ModelFacts, *, world: int, ep: int, tp: int, local_batch_size: int, seq_len: int,
             activation_checkpoint: str, device: str, symm: bool = False,
             combine_partial_sums: bool = True,
             capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR,
             pool_factor: float | None = DEFAULT_POOL_FACTOR,
             reshard_after_forward: bool = True, routed_load: float = 1.0,
             two_hop_nodes: int = 0, wire_row_bytes: int | None = None) -> MemoryEstimate:
    """Bytes one process of a ``world``-process run needs (``device``: "cpu" or "cuda";
    ``symm``: the EP layers run the symm transport, ``combine_partial_sums`` its setting,
    ``capacity_factor`` the capacity (None: the worst case) and ``pool_factor`` the activation
    pool's rows, each a multiple of the balanced case (``pool_factor=None``: no pool, every
    layer keeps its tensors at the capacity, as at ``a2a.capacity_factor=null``);
    ``two_hop_nodes``: the EP layers run the two_hop transport over that many nodes instead
    (no pool; ``wire_row_bytes``: the bytes of a row of its widest leg, default bf16);
    ``routed_load``: without symm, the rows a rank keeps over all MoE layers as a multiple of
    the balanced case; ``reshard_after_forward=False``: FSDP keeps every block's gathered bf16
    weights from forward to backward)."""
    shard = max(1, world)
    dense_params = m.params - m.expert_params
    block = (dense_params - 2 * m.vocab_size * m.dim) / m.n_layers / tp
    if m.n_moe_layers:
        block += m.expert_params / m.n_moe_layers / ep

    tokens = local_batch_size * seq_len
    two_hop = two_hop_nodes >= 2 and ep > 1 and m.n_moe_layers > 0
    symm = (symm or two_hop) and ep > 1 and m.n_moe_layers > 0
    pooled = symm and not two_hop and pool_factor is not None
    if pooled:  # the routed experts' rows live in the pool and the one layer's transient
        rows: tuple[float | None, float | None] = (0, 0)
    elif symm:
        rows = symm_rows_per_token(m, tokens, ep, combine_partial_sums, capacity_factor)
    else:
        rows = (m.top_k * routed_load, m.top_k * (1 + routed_load))
    all_layers, one_layer = activation_bytes_per_token(m, *rows)
    if activation_checkpoint == "full":
        kept = m.n_layers * m.dim * BF16 + one_layer
    else:
        kept = all_layers * _KEPT.get(activation_checkpoint, 1.0)
    logits = m.vocab_size * (BF16 + 2 * FP32)
    pool = transient = node_hop = 0
    peers = symm_peer_buffer_bytes(m, tokens, ep, combine_partial_sums) if symm else 0
    if two_hop:
        peers, node_hop = two_hop_buffer_bytes(m, tokens, ep, two_hop_nodes, combine_partial_sums, capacity_factor,
                                               m.dim * BF16 if wire_row_bytes is None else wire_row_bytes)
    if pooled:
        if activation_checkpoint != "full":  # full: only each layer's input is kept across layers
            layers = activation_pool_size.pooled_layers(m.n_moe_layers * _KEPT.get(activation_checkpoint, 1.0))
            pool = int(pool_rows(m, tokens, ep, pool_factor)  # type: ignore[arg-type]
                       * pooled_row_bytes(m, combine_partial_sums) * layers / m.n_moe_layers / tp)
        transient = int(symm_capacity(m, tokens, ep, capacity_factor) * expert_row_bytes(m) / tp)
    return MemoryEstimate(
        parameters=int(m.params * FP32 / shard),
        gradients=int(m.params * FP32 / shard),
        optimizer=int(m.params * ADAM_STATE / shard),
        working_copies=int((2 if reshard_after_forward else m.n_layers) * block * BF16 + 2 * block * FP32),
        activations=int(tokens * (kept + logits) / tp),
        runtime=RUNTIME_BYTES.get(device, RUNTIME_BYTES["cuda"]),
        peer_buffers=peers,
        activation_pool=pool,
        layer_transient=transient,
        node_hop=node_hop,
    )


def ep_transport(cfg: Any, device: str) -> Transport | None:
    """The transport the EP layers of ``cfg`` on ``device`` ("cuda" or "cpu") will run
    (``mxfp8_ep.transport.resolve``, as the dispatcher resolves it; None: ``a2a.transport``
    names none). EP groups are consecutive ranks, so one node holds them when they fit its
    processes, else they span ``parallelism.ep // procs_per_node`` nodes. A symm asked for
    across nodes counts as symm (the check before launch refuses it)."""
    a, p = cfg.a2a, cfg.parallelism
    if a.transport not in TRANSPORTS:
        return None
    span = two_hop_nodes(ep=p.ep, nodes=p.nodes, procs_per_node=p.procs_per_node, ranks_per_node=None)
    hosts = span if span else (1 if p.nodes == 1 or p.procs_per_node % p.ep == 0 else 2)
    try:
        return resolve(a.transport, cuda=device == "cuda", ranks=p.ep, hosts=lambda: hosts)
    except ValueError:
        return Transport.SYMM


def runs_sync_free(cfg: Any, device: str) -> bool:
    """Whether the EP layers of ``cfg`` on ``device`` run a transport of ``SYNC_FREE``
    (peer memory, an elastic capacity, the replay guard): symm or two_hop."""
    return ep_transport(cfg, device) in SYNC_FREE


def run_two_hop_nodes(cfg: Any, device: str) -> int:
    """The nodes two_hop splits the EP group of ``cfg`` into where its EP layers run it on
    ``device`` (``launch.config.two_hop_layout``; 2 where the layout is refused, the least it
    takes), else 0."""
    if ep_transport(cfg, device) is not Transport.TWO_HOP:
        return 0
    p = cfg.parallelism
    nodes = two_hop_nodes(ep=p.ep, nodes=p.nodes, procs_per_node=p.procs_per_node,
                          ranks_per_node=cfg.a2a.ranks_per_node)
    return nodes or 2


def pool_factors(a2a: Any, ep: int, two_hop: bool = False) -> tuple[float | None, float | None]:
    """The activation pool's (start, ceiling) factors of the ``a2a`` config
    (``activation_pool_factor``, ``activation_pool_ceiling``; a ceiling of None is every
    layer's worst case, ``ep`` times the balanced rows); (None, None) without a pool, at
    ``capacity_factor=None``, which keeps every layer at the worst case, or on two_hop
    (``two_hop``), which runs none."""
    start = a2a.activation_pool_factor
    if a2a.capacity_factor is None or start is None or two_hop:
        return None, None
    ceiling = a2a.activation_pool_ceiling
    return start, max(start, float(ep) if ceiling is None else ceiling)


def run_estimate(cfg: Any, facts: ModelFacts, device: str, symm: bool, capacity_factor: float | None,
                 at_ceiling: bool = False) -> MemoryEstimate:
    """``estimate`` of one process of the recipe config ``cfg`` (its parallelism, batch and
    checkpointing) on ``device``, the EP layers on a sync-free transport when ``symm`` (two_hop
    where ``cfg`` resolves to it there, else symm), its capacity at ``capacity_factor`` (the
    config's starting factor, or a ceiling; two_hop's node hop at the same factor) and its
    activation pool where it starts, or at its ceiling (``at_ceiling``)."""
    p, t = cfg.parallelism, cfg.training
    nodes = run_two_hop_nodes(cfg, device) if symm else 0
    pool = pool_factors(cfg.a2a, cfg.parallelism.ep, two_hop=bool(nodes))[1 if at_ceiling else 0]
    return estimate(facts, world=p.nodes * p.procs_per_node, ep=p.ep, tp=p.tp, local_batch_size=t.local_batch_size,
                    seq_len=t.seq_len, activation_checkpoint=t.activation_checkpoint, device=device, symm=symm,
                    combine_partial_sums=bool(cfg.a2a.symm_combine_partial_sums), capacity_factor=capacity_factor,
                    pool_factor=pool, reshard_after_forward=p.fsdp_reshard_after_forward != "never",
                    two_hop_nodes=nodes, wire_row_bytes=widest_row_bytes(facts, [str(cfg.a2a[leg]) for leg in LEGS]))


# ``a2a.capacity_ceiling`` in the recipe: the library's default ceiling where its estimate fits
# the memory, else the largest below it that does.
AUTO_CEILING = "auto"
# Ceilings ``fitting_ceiling`` picks are rounded down to this step of the balanced case.
CEILING_STEP = 0.05


def fitting_ceiling(cfg: Any, facts: ModelFacts, device: str, memory_bytes: int, procs: int,
                    most: float | None = DEFAULT_CAPACITY_CEILING) -> float | None:
    """The ``a2a.capacity_ceiling`` that ``auto`` stands for: ``most`` (the library's default
    ceiling; None: the worst case) where its estimate (the activation pool at its ceiling too),
    times ``procs`` processes sharing ``memory_bytes``, fits it, else the largest multiple of
    ``CEILING_STEP`` below it that fits; the starting factor when nothing above it does (the
    check of the start itself reports that). A sync-free transport (symm, two_hop) at an
    elastic capacity only."""
    start = cfg.a2a.capacity_factor
    if start is None:
        return None

    def fits(factor: float | None) -> bool:
        return run_estimate(cfg, facts, device, True, factor, at_ceiling=True).total * procs <= memory_bytes

    if fits(most):
        return most if most is None else max(float(start), most)
    low = int(math.ceil(min(start, cfg.parallelism.ep) / CEILING_STEP))
    # A factor past EP is the worst case (``capacity.expert_major_capacity``): search up to it.
    high = int(min(cfg.parallelism.ep, cfg.parallelism.ep if most is None else most) / CEILING_STEP) + 1
    if not fits(low * CEILING_STEP):
        return float(start)
    while high - low > 1:  # fits(low), not fits(high): the estimate grows with the factor
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * CEILING_STEP) else (low, mid)
    return round(max(start, low * CEILING_STEP), 4)
