"""How the two_hop transport's node-hop capacity would behave over a measured routing, at 2, 4
and 8 nodes of 8 GPUs, as rows (bench ``node_hop_capacity``).

    python -m benchmarks.node_hop_capacity ROUTING.jsonl[.gz] --out benchmarks/results [--model MODEL] \\
        [--source-ranks S] [--seed SEED] [--source "COMMAND"] [--extrapolate]

The node hop (``mxfp8_ep.dispatcher.two_hop``) sends each token once to each other node that
holds at least one of its experts, into a buffer of ``C`` rows per (source rank, destination
node) pair: ``capacity.node_hop_capacity(T, remote_node_share(E, K, N), factor)``, from
``A2AConfig.capacity_factor`` at the start, growing on overflow by ``capacity.next_capacity``
(its growth headroom) up to ``A2AConfig.capacity_ceiling`` times the balanced case, at most
every token (``T``, the worst case). Every MoE layer of a model shares that one capacity (its
key names the group, top-k, tokens and policy, not the layer), as the study of symm's capacity
(``benchmarks.capacity_study``) takes one capacity for every layer. A step needs the most
tokens one rank sends one other node in any layer; a step that needs more than the capacity
runs again once (growth or, past the ceiling, a spill at exactly its rows): ``reruns_per_1000``
counts them per 1,000 steps, the first steps included. These are the node hop's reruns alone;
a step that also overflows symm's capacity or pool reruns once for all of them.

The input is the routing telemetry ``benchmarks.capacity_study`` reads (``read_telemetry``):
per step and MoE layer, the tokens routed to each expert. It holds no token's set of experts,
so the study models them (``routing_model`` in every row): at each step and layer, each of a
rank's ``T`` tokens (the target recipe's tokens per rank, ``capacity_study.target``) takes
``K`` distinct experts drawn without replacement with chances proportional to the step's and
layer's per-expert counts (``sample_experts``, seeded), independently of the other tokens and
of the other layers. The model keeps each step's expert shares (its imbalance) and drops what
ties one token's experts together: a router that puts a token's experts on fewer nodes needs
fewer rows than the model's. Every rank of a step routes alike in the model, so the tokens of
``--source-ranks`` ranks (``SOURCE_RANKS`` by default) are sampled per step and layer, each
rank's count per node taken as a count to another node (every node has ranks on the others'
rails). The counts of a step's ranks differ only by sampling (a binomial count: a standard
deviation of at most ``sqrt(T) / 2`` rows, under 1% of ``T`` at the target's 8,192 tokens), far
less than the capacity's growth steps. Nodes of ``GPUS_PER_NODE`` GPUs, EP over all of them, experts on
consecutive ranks: node ``n`` of ``N`` holds experts ``[n E / N, (n + 1) E / N)``.

Rows: one ``need`` row per node count (the need over the balanced rows ``share x T``: its
largest, 99th percentile and largest over the second half; ``uniform_need_factor``: the same
ratio for a router that picks its experts uniformly at random, the mean over ``UNIFORM_STEPS``
steps, the sampling's own spread), and one ``policy`` row per node count and policy of ``GRID`` (``defaults``: the
library's ``DEFAULT_CAPACITY_FACTOR`` and ``DEFAULT_CAPACITY_CEILING``) with its reruns, where
the capacity started, ended and may grow to, and the node hop's send and receive buffers of
one leg at the ceiling (``capacity.node_hop_bytes``), the widest of the four legs of each a2a
preset (``ceiling_mib_<preset>``; the buffers come from the caching allocator per dispatch, one
leg's at a time).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass

import torch

from benchmarks.capacity_study import (TARGET_RERUNS_PER_1000, Target, _percentile, extrapolation, read_telemetry,
                                       refuse_extrapolation, source_of, target, telemetry_arguments, telemetry_bytes,
                                       write_study)
from benchmarks.internode_bytes import GPUS_PER_NODE, NODES
from benchmarks.rows import ResultsFile, this_machine
from mxfp8_ep.config import DEFAULT_CAPACITY_CEILING, DEFAULT_CAPACITY_FACTOR, LEGS, PRESETS
from mxfp8_ep.exchange.capacity import (GROWTH_HEADROOM, next_capacity, node_hop_bytes, node_hop_capacity,
                                        remote_node_share)
from mxfp8_ep.exchange.staging import staged_row_nbytes

# Source ranks sampled per step and layer (``--source-ranks``).
SOURCE_RANKS = 1
SEED = 0
# Steps of the uniform router behind ``uniform_need_factor``.
UNIFORM_STEPS = 20
ROUTING_MODEL = ("per step and MoE layer, each of a rank's tokens takes top-k distinct experts drawn without "
                 "replacement with chances proportional to the measured per-expert counts, independently")
MIB = 2**20


@dataclass(frozen=True)
class NodePolicy:
    """Where the node-hop capacity starts and the most it grows to, as multiples of the
    balanced case (``ceiling=None``: every token)."""

    factor: float
    ceiling: float | None


GRID = tuple(NodePolicy(f, c) for f in (1.0, 1.1, 1.25, 1.5) for c in (1.25, 1.5, 2.0, DEFAULT_CAPACITY_CEILING, None)
             if c is None or c >= f)
DEFAULTS = NodePolicy(DEFAULT_CAPACITY_FACTOR, DEFAULT_CAPACITY_CEILING)


def sample_experts(weights: torch.Tensor, tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """(..., tokens, top_k) expert ids: per row of ``weights`` (..., E), each of ``tokens``
    tokens' ``top_k`` distinct experts, drawn without replacement with chances proportional to
    the row (successive sampling). Drawn as ``torch.multinomial(replacement=False)`` draws
    them, by the exponential race (the ``top_k`` largest ``log(u) / w`` of uniform ``u``), here
    without a copy of the weights per token."""
    weights = weights.float()
    if (weights < 0).any() or ((weights > 0).sum(dim=-1) < top_k).any():
        raise ValueError(f"each row of the weights needs at least top_k={top_k} positive entries and no negative one")
    u = torch.rand((*weights.shape[:-1], tokens, weights.shape[-1]), generator=generator)
    keys = u.clamp_(min=torch.finfo(torch.float32).tiny).log_().div_(weights.unsqueeze(-2))
    return keys.topk(top_k, dim=-1, sorted=False).indices


def node_counts(expert_ids: torch.Tensor, experts: int, nodes: int) -> torch.Tensor:
    """(..., nodes): of the tokens ``expert_ids`` (..., tokens, top_k) holds, those with at least
    one expert on each node (node ``n`` holds experts ``[n E / N, (n + 1) E / N)``)."""
    if experts % nodes:
        raise ValueError(f"{experts} experts do not split over {nodes} nodes")
    node = expert_ids // (experts // nodes)
    hit = torch.zeros((*node.shape[:-1], nodes), dtype=torch.bool, device=node.device).scatter_(-1, node, True)
    return hit.sum(dim=-2)


def step_needs(steps: list[dict], tokens: int, top_k: int, node_counts_: tuple[int, ...] = NODES,
               source_ranks: int = SOURCE_RANKS, seed: int = SEED, progress=None) -> dict[int, list[int]]:
    """Per node count, each step's need: the most tokens one of ``source_ranks`` sampled ranks
    sends one node in any MoE layer (``sample_experts`` from the step's counts, ``tokens`` a
    rank). One draw serves every node count."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[int, list[int]] = {n: [] for n in node_counts_}
    for i, s in enumerate(steps):
        weights = torch.tensor(s["counts"], dtype=torch.float32)
        need = dict.fromkeys(node_counts_, 0)
        for _ in range(source_ranks):
            ids = sample_experts(weights, tokens, top_k, gen)
            for n in node_counts_:
                need[n] = max(need[n], int(node_counts(ids, weights.shape[-1], n).max()))
        for n in node_counts_:
            out[n].append(need[n])
        if progress is not None and (i + 1) % 100 == 0:
            progress(f"{i + 1:,} of {len(steps):,} steps sampled")
    return out


def uniform_need(tokens: int, top_k: int, experts: int, layers: int, nodes: int, steps: int = UNIFORM_STEPS,
                 seed: int = SEED) -> float:
    """The mean over ``steps`` of the need (``step_needs``, one rank) of a router that picks
    every expert alike, over the balanced rows: the sampling's spread alone."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.ones(layers, experts)
    total = sum(int(node_counts(sample_experts(weights, tokens, top_k, gen), experts, nodes).max())
                for _ in range(steps))
    return round(total / steps / (tokens * remote_node_share(experts, top_k, nodes)), 4)


def simulate(needs: list[int], step_ids: list[int], start: int, ceiling: int, worst: int,
             headroom: float = GROWTH_HEADROOM) -> dict:
    """The elastic rule (``capacity.next_capacity``, rows of any count: align 1) over the steps'
    needs from ``start`` rows: a step that needs more than the capacity reruns once, grown
    (``replays``) or past the ceiling at its exact rows (``spills``)."""
    capacity, peak, replays, spills = start, start, [], []
    for step, need in zip(step_ids, needs, strict=True):
        took = next_capacity(need, capacity, ceiling, worst, 1, headroom)
        if took.kind == "grow":
            replays.append(step)
        elif took.kind == "spill":
            spills.append(step)
        capacity, peak = took.capacity, max(peak, took.capacity)
    reruns = sorted(replays + spills)
    return {"replays": len(replays), "spills": len(spills), "reruns": len(reruns),
            "reruns_per_1000": round(1000 * len(reruns) / len(needs), 2),
            "reruns_first_100": sum(step <= step_ids[0] + 99 for step in reruns),
            "last_rerun_step": reruns[-1] if reruns else None, "start_rows": start, "end_rows": capacity,
            "peak_rows": peak, "ceiling_rows": ceiling, "worst_rows": worst}


@dataclass(frozen=True)
class NodeHop:
    """The node hop of the target's shape on ``nodes`` nodes of ``GPUS_PER_NODE`` GPUs."""

    t: Target
    nodes: int

    @property
    def share(self) -> float:
        return remote_node_share(self.t.facts.num_experts, self.t.facts.top_k, self.nodes)

    @property
    def balanced(self) -> float:
        """Rows a rank sends one other node when every token picks its experts uniformly."""
        return self.share * self.t.tokens

    def rows(self, factor: float | None) -> int:
        return node_hop_capacity(self.t.tokens, self.share, factor)

    def ceiling(self, policy: NodePolicy) -> int:
        """As ``TwoHopTokenDispatcher._node_capacity_held``: never below the start."""
        return max(self.rows(policy.factor), self.rows(policy.ceiling))

    def mib(self, rows: int, preset: str) -> float:
        """The send and receive buffers of ``preset``'s widest leg at ``rows`` rows per node
        pair, each leg in its wire format."""
        dim, top_k = self.t.facts.dim, self.t.facts.top_k
        widest = max(node_hop_bytes(self.nodes, rows, staged_row_nbytes(dim, torch.bfloat16, PRESETS[preset][leg]),
                                    top_k, leg) for leg in LEGS)
        return round(widest / MIB, 1)


def need_row(hop: NodeHop, needs: list[int], step_ids: list[int], layers: int, source_ranks: int) -> dict:
    t, half = hop.t, len(needs) // 2
    factors = [n / hop.balanced for n in needs]
    top = max(range(len(needs)), key=needs.__getitem__)
    return {"kind": "need", "target": t.model, "nodes": hop.nodes, "gpus_per_node": GPUS_PER_NODE,
            "ep": hop.nodes * GPUS_PER_NODE, "tokens_per_rank": t.tokens, "steps": len(needs),
            "source_ranks": source_ranks, "share": round(hop.share, 4), "balanced_rows": round(hop.balanced, 1),
            "max_need": needs[top], "max_need_step": step_ids[top], "max_need_factor": round(factors[top], 4),
            "p99_need_factor": _percentile(factors, 0.99),
            "max_need_factor_second_half": round(max(factors[half:]), 4),
            "uniform_need_factor": uniform_need(t.tokens, t.facts.top_k, t.facts.num_experts, layers, hop.nodes)}


def study_rows(steps: list[dict], t: Target, node_counts_: tuple[int, ...] = NODES, grid=GRID,
               source_ranks: int = SOURCE_RANKS, seed: int = SEED, progress=None) -> list[dict]:
    """The ``need`` and ``policy`` rows (module docstring) of ``steps`` at ``t``'s shape."""
    step_ids, layers = [s["step"] for s in steps], len(steps[0]["counts"])
    needs = step_needs(steps, t.tokens, t.facts.top_k, node_counts_, source_ranks, seed, progress)
    rows = []
    for nodes in node_counts_:
        hop = NodeHop(t, nodes)
        rows.append(need_row(hop, needs[nodes], step_ids, layers, source_ranks))
        for policy in grid if DEFAULTS in grid else (*grid, DEFAULTS):
            ceiling = hop.ceiling(policy)
            sim = simulate(needs[nodes], step_ids, hop.rows(policy.factor), ceiling, t.tokens)
            rows.append({"kind": "policy", "target": t.model, "nodes": nodes, "gpus_per_node": GPUS_PER_NODE,
                         "ep": nodes * GPUS_PER_NODE, "tokens_per_rank": t.tokens, "steps": len(steps),
                         "source_ranks": source_ranks, "capacity_factor": policy.factor, "headroom": GROWTH_HEADROOM,
                         "capacity_ceiling": policy.ceiling, "defaults": policy == DEFAULTS, **sim,
                         "end_factor": round(sim["end_rows"] / hop.balanced, 4),
                         **{f"ceiling_mib_{preset}": hop.mib(ceiling, preset) for preset in PRESETS}})
    return rows


def meets_target(row: dict) -> bool:
    return row["reruns_per_1000"] <= TARGET_RERUNS_PER_1000


def verdict(rows: list[dict]) -> list[str]:
    """Per node count: the defaults' reruns and need, whether they meet the target, and where
    they do not, the policies of the grid that do, least ceiling first."""
    needs = {r["nodes"]: r for r in rows if r["kind"] == "need"}
    lines = []
    for r in (r for r in rows if r["kind"] == "policy" and r["defaults"]):
        need = needs[r["nodes"]]
        lines.append(f"{r['nodes']} nodes (EP={r['ep']}) defaults: {r['reruns_per_1000']:g} reruns per 1,000 steps "
                     f"({r['replays']} replays, {r['spills']} spills); need up to {need['max_need_factor']:.2f}x the "
                     f"balanced {need['balanced_rows']:,.0f} rows ({need['max_need']:,} of {r['tokens_per_rank']:,} "
                     f"tokens); capacity {r['start_rows']:,} -> {r['end_rows']:,} rows, ceiling "
                     f"{r['ceiling_rows']:,}; the widest leg's buffers there: "
                     + ", ".join(f"{r[f'ceiling_mib_{preset}']:g} MiB a2a={preset}" for preset in PRESETS))
        lines.append(f"{r['nodes']} nodes target (<= {TARGET_RERUNS_PER_1000} reruns per 1,000 steps): "
                     f"{'met' if meets_target(r) else 'NOT met'} at the defaults")
        if not meets_target(r):
            same = (p for p in rows if p["kind"] == "policy" and p["nodes"] == r["nodes"])
            fitting = sorted(filter(meets_target, same), key=lambda p: (p["ceiling_rows"], p["start_rows"]))
            meeting = ", ".join(f"capacity_factor={p['capacity_factor']} capacity_ceiling={p['capacity_ceiling']}"
                                for p in fitting)
            lines.append(f"  policies meeting it, least ceiling first: {meeting or 'none of the grid'}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    telemetry_arguments(parser, "write rows and a verdict from a short input, an unknown model or another family's")
    parser.add_argument("--source-ranks", type=int, default=SOURCE_RANKS,
                        help=f"ranks sampled per step and layer (default {SOURCE_RANKS})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the sampling's seed (default {SEED})")
    args = parser.parse_args(argv)
    if args.source_ranks < 1:
        parser.error(f"--source-ranks takes at least 1 rank, not {args.source_ranks}")
    steps = read_telemetry(args.telemetry)
    if not steps:
        parser.error(f"{args.telemetry}: no steps")
    if any("counts" not in s for s in steps):
        parser.error(f"{args.telemetry}: a step without per-expert counts (`counts`): the node hop's need is "
                     f"sampled from them")
    t = target()
    experts = len(steps[0]["counts"][0])
    if experts != t.facts.num_experts or any(experts % (n * GPUS_PER_NODE) for n in NODES):
        parser.error(f"{args.telemetry}: {experts} experts per layer; the node hop is studied at {t.model}'s "
                     f"{t.facts.num_experts}, on {', '.join(map(str, NODES))} nodes of {GPUS_PER_NODE} GPUs")
    src = source_of(args.telemetry, steps, args.model)
    print(src.line())
    why = extrapolation(src, t)
    if not args.extrapolate:
        refuse_extrapolation(parser, why, f"{t.model}'s node hop", t.model)
    telemetry = {"telemetry": str(args.telemetry),
                 "telemetry_sha256": hashlib.sha256(telemetry_bytes(steps)).hexdigest(),
                 "telemetry_source": args.source, "study_model": src.model, "seed": args.seed,
                 "routing_model": ROUTING_MODEL}
    # The provenance (commit, a dirty tree) of the tree the rows start from.
    results = ResultsFile("node_hop_capacity", args.out, machine=this_machine(count=1, link="none"))
    rows = study_rows(steps, t, source_ranks=args.source_ranks, seed=args.seed,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    write_study(results, rows, telemetry, why, verdict(rows))


if __name__ == "__main__":
    main()
