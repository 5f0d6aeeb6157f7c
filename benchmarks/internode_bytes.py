"""Inter-node bytes per token of the EP exchange, sent flat (one row per token and expert) or
node-deduplicated (one row per token and node), from DeepSeek-V3 16B routing, with and without
node-limited routing, and the speed model's time for them (bench ``internode_bytes``).

    python -m benchmarks.internode_bytes --out benchmarks/results

A byte count, not a measurement: the routing is a CPU run of the real router, the bytes follow
from it and the wire formats, the time is a model.

Routing: torchtitan 0.2.2's ``TokenChoiceTopKRouter`` built from ``deepseek_v3/16B``'s MoE args
(64 routed experts, top-6, softmax scores), one gate per MoE layer of the 16B (26), each at
torchtitan's init for that layer (``0.02 / sqrt(2 (layer + 1))``, seed ``--seed``), routing
``--tokens`` synthetic tokens: each a token type drawn from a Zipf law over ``TOKEN_TYPES``
types (a text's word frequencies), its type's fixed random direction plus a per-token random
context of the same size, RMS-normalised (the router reads the block's RMSNorm output). No trained
weights: an untrained router spreads a token's experts about uniformly over the nodes. The flat
counts do not depend on that (a token's top-k pairs leave its node (N - 1) / N of the time on N
nodes, whatever the routing); the deduplicated ones would fall with a router that learned to keep
a token's experts on fewer nodes. Node-limited routing: the same gates
with torchtitan's ``num_expert_groups`` = the nodes and ``num_limited_groups`` = half of them
(the DeepSeek-V3 paper's 4 of 8), ``node_limited`` in the rows.

Layout: ``nodes`` x ``GPUS_PER_NODE`` GPUs, EP over all of them (experts on consecutive ranks,
as torchtitan places them), each rank holding an equal block of the tokens. Per token, leg and
MoE layer, rows crossing between nodes:

* flat (``nccl`` and torchtitan's all-to-all): one row per (token, expert) pair whose expert sits
  on another node;
* dedup (the node-deduplicated dispatch): one row per other node holding at least one of the
  token's experts (combine: one partial sum per (token, node) back).

The dedup rows also give what the two_hop transport sends for them (``two_hop_*``,
``two_hop_fields``): its node hop's fixed-size blocks at the starting capacity, every row padded
and with its side columns, full or not, for the 2-node recipe's tokens per GPU.

Each leg's backward carries its forward rows' gradients, so all four legs cross the same rows; a
leg's bytes per row are its wire format's (``A2AConfig`` presets; ``WireFormat.row_bytes``:
bf16 2 x dim, MXFP8 dim + dim / 32). ``bytes_per_token``: the four legs' inter-node bytes of one
token in one MoE layer, the mean over tokens and layers. The rows inside a node (flat: pairs whose
expert is on another GPU of the token's node; dedup: the fan-out from the receiving GPU, the one
of the same local index, to the other GPUs holding the token's experts on each node, and the
token's own node's GPUs) give the time model's NVLink share.

Time model (``benchmarks.speed_model``'s links): every GPU sends the mean of ``tokens_per_gpu``
tokens (the 2-node recipe's local batch, ``TIME_RECIPE``) per leg; flat: NCCL's all-to-all
moves the inter-node and NVLink pieces at once (the slower sets the leg's time, NVLink at
``speed_model.NVLINK``); dedup: the inter-node hop, then the NVLink hop (``NVLINK_SYMM``), in
sequence; the inter-node link ``speed_model.IB50`` (50 GB/s per GPU); latency per leg and hop;
no HBM passes, no overlap with compute.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from benchmarks.rows import ResultsFile, this_machine
from benchmarks.speed_model import GB, IB50, NVLINK, NVLINK_SYMM, LinkParams
from mxfp8_ep.config import DEFAULT_CAPACITY_FACTOR, LEGS, PRESETS
from mxfp8_ep.exchange.capacity import node_hop_capacity, node_hop_row_bytes, remote_node_share
from mxfp8_ep.format.wire_format import WireFormat

NODES = (2, 4, 8)
GPUS_PER_NODE = 8
MODEL = ("deepseek_v3", "16B")
TIME_RECIPE = "recipes/dsv3_16b_2nodes_sweep.yaml"
TOKEN_TYPES = 8192
ZIPF_EXPONENT = 1.0
SENDS = ("flat", "dedup")
ARMS = tuple(f"{send}_{preset}" for send in SENDS for preset in PRESETS)
BASELINE = "flat_bf16"
MOE_LAYERS = 26  # deepseek_v3/16B: 27 layers, the first dense
ACTIVATION_BYTES = 2  # bf16 activations


@dataclass(frozen=True)
class Layout:
    """``nodes`` x ``gpus_per_node`` EP ranks, ``num_experts`` on consecutive ranks."""

    nodes: int
    gpus_per_node: int
    num_experts: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def __post_init__(self) -> None:
        if self.num_experts % self.ranks:
            raise ValueError(f"{self.num_experts} experts do not split over {self.ranks} EP ranks")

    def rank_of(self, expert: torch.Tensor) -> torch.Tensor:
        return expert // (self.num_experts // self.ranks)

    def source_ranks(self, tokens: int) -> torch.Tensor:
        """Each token's rank: equal consecutive blocks, as data parallelism splits a batch."""
        if tokens % self.ranks:
            raise ValueError(f"{tokens} tokens do not split over {self.ranks} ranks")
        return torch.arange(tokens) // (tokens // self.ranks)


@dataclass(frozen=True)
class Crossings:
    """Rows of one leg per token: between nodes and inside a node (sums over the tokens)."""

    inter: int
    intra: int
    tokens: int


def flat_crossings(expert_ids: torch.Tensor, source: torch.Tensor, layout: Layout) -> Crossings:
    """One row per (token, expert) pair: between nodes where the expert is on another node, on
    NVLink where it is on another GPU of the token's node."""
    rank = layout.rank_of(expert_ids)
    node, home = rank // layout.gpus_per_node, (source // layout.gpus_per_node)[:, None]
    inter = (node != home).sum()
    intra = ((node == home) & (rank != source[:, None])).sum()
    return Crossings(int(inter), int(intra), expert_ids.shape[0])


def dedup_crossings(expert_ids: torch.Tensor, source: torch.Tensor, layout: Layout) -> Crossings:
    """One row per (token, other node holding one of its experts) between nodes; inside each node
    one row per GPU holding the token's experts other than the GPU the row arrives on (the
    token's own GPU on its node, the GPU of its local index on the others)."""
    tokens, g = expert_ids.shape[0], layout.gpus_per_node
    hit = torch.zeros(tokens, layout.ranks, dtype=torch.bool)
    hit[torch.arange(tokens)[:, None], layout.rank_of(expert_ids)] = True
    node_hit = hit.view(tokens, layout.nodes, g).any(dim=2)
    home = source // g
    remote = node_hit.clone()
    remote[torch.arange(tokens), home] = False
    arrives = torch.arange(layout.nodes)[None, :] * g + (source % g)[:, None]  # (tokens, nodes)
    arrives[torch.arange(tokens), home] = source  # the token's own GPU on its own node
    landed = hit.gather(1, arrives) & node_hit  # the GPU a row arrives on holds an expert itself
    intra = hit.sum() - landed.sum()
    return Crossings(int(remote.sum()), int(intra), tokens)


def crossings(send: str, expert_ids: torch.Tensor, layout: Layout) -> Crossings:
    source = layout.source_ranks(expert_ids.shape[0])
    return (flat_crossings if send == "flat" else dedup_crossings)(expert_ids, source, layout)


def leg_row_bytes(preset: str, dim: int) -> dict[str, int]:
    """Wire bytes of one row of ``dim`` elements on each leg of an a2a preset."""
    return {leg: WireFormat(PRESETS[preset][leg]).row_bytes(dim, ACTIVATION_BYTES) for leg in LEGS}


def split_arm(arm: str) -> tuple[str, str]:
    send, preset = arm.split("_", 1)
    return send, preset


def leg_ms(inter_bytes: float, intra_bytes: float, send: str, inter: LinkParams = IB50) -> float:
    """The time model of one leg on one GPU (module docstring)."""
    inter_ms = inter.latency_ms + inter_bytes / (inter.gbps * GB) * 1e3 if inter_bytes else 0.0
    if send == "flat":
        intra_ms = NVLINK.latency_ms + intra_bytes / (NVLINK.gbps * GB) * 1e3 if intra_bytes else 0.0
        return max(inter_ms, intra_ms)
    intra_ms = NVLINK_SYMM.latency_ms + intra_bytes / (NVLINK_SYMM.gbps * GB) * 1e3 if intra_bytes else 0.0
    return inter_ms + intra_ms


def arm_fields(arm: str, rows: Crossings, dim: int, tokens_per_gpu: int) -> dict:
    """A row's byte counts and modelled time for ``arm`` from its crossings."""
    send, preset = split_arm(arm)
    per_row = leg_row_bytes(preset, dim)
    inter = {leg: rows.inter * b / rows.tokens for leg, b in per_row.items()}
    intra = {leg: rows.intra * b / rows.tokens for leg, b in per_row.items()}
    ms = {leg: leg_ms(inter[leg] * tokens_per_gpu, intra[leg] * tokens_per_gpu, send) for leg in LEGS}
    return {"bytes_per_token": sum(inter.values()), "leg_bytes_per_token": inter,
            "inter_rows_per_token": rows.inter / rows.tokens, "intra_rows_per_token": rows.intra / rows.tokens,
            "intra_bytes_per_token": sum(intra.values()), "modelled_ms": sum(ms.values()),
            "modelled_fwd_ms": ms["dispatch_fwd"] + ms["combine_fwd"]}


# ------------------------------------------------------------------------------ routing
def synthetic_inputs(tokens: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Router inputs (module docstring): Zipf-drawn token types plus per-token context, RMS 1."""
    ranks = torch.arange(1, TOKEN_TYPES + 1, dtype=torch.float64)
    types = torch.multinomial(ranks ** -ZIPF_EXPONENT, tokens, replacement=True, generator=generator)
    directions = torch.randn(TOKEN_TYPES, dim, generator=generator)
    x = directions[types] + torch.randn(tokens, dim, generator=generator)
    return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True))


def route(x: torch.Tensor, layers: int, seed: int, groups: Optional[int] = None,
          limited: Optional[int] = None) -> tuple[torch.Tensor, list[int]]:
    """Each MoE layer's top-k expert ids of ``x`` (layers, tokens, top_k) through torchtitan's
    router of ``MODEL``, its gates drawn per layer from ``seed`` (the same gates with and without
    groups); and the MoE layer ids."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    from launch.titan.cpu_compat import apply_cpu_compat
    from launch.titan.models import model_args

    apply_cpu_compat()  # on CPU: the router's histc of its expert ids
    args = model_args(*MODEL)
    moe = args.moe_args
    ids = list(range(args.n_dense_layers, args.n_layers))[:layers]
    out = []
    for layer in ids:
        router = TokenChoiceTopKRouter(dim=args.dim, num_experts=moe.num_experts, num_expert_groups=groups,
                                       num_limited_groups=limited, top_k=moe.top_k, score_func=moe.score_func,
                                       route_norm=moe.route_norm, route_scale=moe.route_scale,
                                       gate_bias=moe.gate_bias)
        torch.manual_seed(seed * 1000 + layer)
        with torch.no_grad():
            router.init_weights(0.02 / (2 * (layer + 1)) ** 0.5)  # torchtitan's DeepSeek-V3 layer init
            _, expert_ids, _ = router(x)
        out.append(expert_ids)
    return torch.stack(out), ids


def max_expert_load(expert_ids: torch.Tensor, num_experts: int) -> float:
    """The busiest expert's picks over the mean, the worst layer."""
    counts = torch.stack([torch.bincount(e.reshape(-1), minlength=num_experts) for e in expert_ids]).double()
    return float((counts.max(dim=1).values / counts.mean(dim=1)).max())


def routing_source(tokens: int, layers: int, seed: int) -> str:
    return (f"CPU run of torchtitan's TokenChoiceTopKRouter with {MODEL[0]}/{MODEL[1]}'s MoE args (64 routed "
            f"experts, top-6, softmax), {layers} MoE layers' gates at torchtitan's init (seed {seed}), {tokens:,} "
            f"synthetic tokens (Zipf-drawn types over {TOKEN_TYPES:,} + per-token context, RMS-normalised); "
            f"node-limited: num_expert_groups = nodes, num_limited_groups = node_limited")


def time_model() -> str:
    return (f"model: every GPU sends tokens_per_gpu tokens' rows per leg; inter-node {IB50.gbps:g} GB/s per GPU "
            f"({IB50.latency_ms} ms latency); flat: NCCL all-to-all, NVLink {NVLINK.gbps:g} GB/s at once with it; "
            f"dedup: the inter-node hop, then NVLink {NVLINK_SYMM.gbps:g} GB/s; four legs (fwd: dispatch_fwd + "
            f"combine_fwd); no HBM passes, no overlap")


def two_hop_fields(preset: str, rows: Crossings, layout: Layout, dim: int, top_k: int, tokens_per_gpu: int,
                   factor: float | None = DEFAULT_CAPACITY_FACTOR) -> dict:
    """What the two_hop transport puts on the inter-node network per token: its node hop sends
    fixed-size blocks of ``capacity`` rows to each other node, filled or not (``capacity``:
    ``factor`` times the balanced case for ``tokens_per_gpu`` tokens per rank,
    ``capacity.node_hop_capacity``; the default capacity factor unless told), each row padded
    and with its side columns (``capacity.node_hop_row_bytes``). ``two_hop_fill``: the rows
    this routing needs over the rows sent."""
    T, N = tokens_per_gpu, layout.nodes
    capacity = node_hop_capacity(T, remote_node_share(layout.num_experts, top_k, N), factor)
    per_row = leg_row_bytes(preset, dim)
    sent = {leg: (N - 1) * capacity * node_hop_row_bytes(b, top_k, leg) / T for leg, b in per_row.items()}
    return {"two_hop_bytes_per_token": sum(sent.values()), "two_hop_capacity_rows": capacity,
            "two_hop_capacity_factor": factor, "two_hop_fill": rows.inter / rows.tokens / ((N - 1) * capacity / T)}


def measure(tokens: int, layers: int, seed: int, nodes: tuple = NODES) -> list[dict]:
    """Every row's fields: per node count, node-limited off and on, per arm."""
    from launch.config.node_limited import node_limited_problems
    from launch.titan.models import model_args

    from benchmarks.capacity_study import target

    args = model_args(*MODEL)
    moe = args.moe_args
    tokens_per_gpu = target(TIME_RECIPE).tokens
    generator = torch.Generator().manual_seed(seed)
    x = synthetic_inputs(tokens, args.dim, generator)
    source = routing_source(tokens, layers, seed)
    free, layer_ids = route(x, layers, seed)
    out = []
    for n in nodes:
        layout = Layout(n, GPUS_PER_NODE, moe.num_experts)
        limited = n // 2
        errors, _ = node_limited_problems(n, limited, num_experts=moe.num_experts, top_k=moe.top_k,
                                          ep=layout.ranks, procs_per_node=GPUS_PER_NODE, model=f"{MODEL[0]}/{MODEL[1]}")
        if errors:
            raise ValueError("; ".join(errors))
        for node_limited, expert_ids in ((None, free), (limited, route(x, layers, seed, n, limited)[0])):
            counted = {send: [crossings(send, e, layout) for e in expert_ids] for send in SENDS}
            totals = {send: Crossings(sum(c.inter for c in cs), sum(c.intra for c in cs), sum(c.tokens for c in cs))
                      for send, cs in counted.items()}
            fields = {arm: arm_fields(arm, totals[split_arm(arm)[0]], args.dim, tokens_per_gpu) for arm in ARMS}
            base = fields[BASELINE]["bytes_per_token"]
            for arm in ARMS:
                send, preset = split_arm(arm)
                if send == "dedup":
                    built = two_hop_fields(preset, totals[send], layout, args.dim, moe.top_k, tokens_per_gpu)
                    fields[arm] |= built | {"two_hop_of_flat_bf16": built["two_hop_bytes_per_token"] / base}
            for arm in ARMS:
                out.append({"nodes": n, "gpus_per_node": GPUS_PER_NODE, "ep": layout.ranks, "arm": arm,
                            "node_limited": node_limited, "num_expert_groups": n if node_limited else None,
                            **fields[arm], "of_flat_bf16": fields[arm]["bytes_per_token"] / base,
                            "model": f"{MODEL[0]}/{MODEL[1]}", "dim": args.dim, "top_k": moe.top_k,
                            "num_experts": moe.num_experts, "tokens_per_gpu": tokens_per_gpu,
                            "time_model": time_model(), "routing": source, "tokens": tokens,
                            "moe_layers": len(layer_ids), "seed": seed,
                            "max_expert_load": round(max_expert_load(expert_ids, moe.num_experts), 3)})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the rows file")
    p.add_argument("--tokens", type=int, default=16384, help="synthetic tokens routed (a multiple of 64)")
    p.add_argument("--layers", type=int, default=MOE_LAYERS, help="MoE layers of the 16B routed (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ranks = max(NODES) * GPUS_PER_NODE
    if args.tokens <= 0 or args.tokens % ranks:
        p.error(f"--tokens {args.tokens}: a positive multiple of {ranks} (each of the {ranks} ranks of "
                f"{max(NODES)} nodes holds an equal block)")
    if not 1 <= args.layers <= MOE_LAYERS:
        p.error(f"--layers {args.layers}: 1 to {MOE_LAYERS} (the MoE layers of {MODEL[0]}/{MODEL[1]})")
    results = ResultsFile("internode_bytes", args.out, machine=this_machine(count=1, link="none"))
    for row in measure(args.tokens, args.layers, args.seed):
        results.write(**row)
        print(f"{row['nodes']} nodes  node_limited={row['node_limited']!s:5}  {row['arm']:16}  "
              f"{row['bytes_per_token']:9.0f} B/token  {row['of_flat_bf16']:.3f} of flat_bf16  "
              f"modelled {row['modelled_ms']:.2f} ms")
    print(f"rows: {results.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
