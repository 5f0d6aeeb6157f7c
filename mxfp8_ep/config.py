"""Which legs of the expert-parallel all-to-all travel as MXFP8.

An MoE layer under expert parallelism makes four all-to-all exchanges per step:

* ``dispatch_fwd``  – routed tokens to the ranks that own their experts (forward),
* ``dispatch_bwd``  – the gradient of that exchange (backward of dispatch),
* ``combine_fwd``   – expert outputs back to the tokens' home ranks (forward),
* ``combine_bwd``   – the gradient of that exchange (backward of combine).

Each leg travels in one of the wire formats of ``mxfp8_ep.format.wire_format``: in the tensor's own
dtype (``"bf16"``: what torchtitan does) or as MXFP8 (``"mxfp8"``: e4m3 values + one e8m0 scale
per 32 elements).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from mxfp8_ep.transport import TRANSPORTS, Transport
from mxfp8_ep.format.wire_format import WIRE_FORMATS, WireFormat, quantized_formats

# The four exchanges, in the order above (the field names of A2AConfig and of the recipe's
# ``a2a`` config, the keys of ``mxfp8_ep.telemetry.wire_stats``).
LEGS = ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd")
LEG_FORMATS = WIRE_FORMATS
# The numerics telemetry's statistics of an MXFP8 leg (``mxfp8_ep.telemetry.numerics`` defines them), the
# last part of the recipe's ``numerics/`` metric names.
NUMERICS_STATS = ("rel_l2_err", "saturated_block_frac", "flushed_frac", "scale_exp_min", "scale_exp_max")
SCALE_ROUNDINGS = ("rceil", "floor")
KERNELS = ("auto", "triton", "torch")
# The values each of A2AConfig's named fields takes (the recipe's validation checks its a2a
# group against them too).
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    **{leg: LEG_FORMATS for leg in LEGS}, "scale_rounding": SCALE_ROUNDINGS, "kernel": KERNELS, "transport": TRANSPORTS,
}
# The symm transport's expert-major rows per balanced case: where they start
# (``A2AConfig.capacity_factor``) and the most they grow to (``A2AConfig.capacity_ceiling``).
# Only the layer being computed holds them (the kept rows live in the activation pool), so the
# ceiling sits high: the routing study's busiest layer at EP=8 stays below it
# (benchmarks/capacity_study.py, docs/design.md "The activation pool").
DEFAULT_CAPACITY_FACTOR = 1.25
DEFAULT_CAPACITY_CEILING = 6.0
# The activation pool that keeps every MoE layer's expert-side tensors for the backward at the
# rows the routing used: its rows per balanced case of all MoE layers together (the T x top_k x
# layers rows a rank keeps when every rank routes alike), where it starts and the most it grows
# to (docs/design.md, "The activation pool").
DEFAULT_POOL_FACTOR = 1.25
DEFAULT_POOL_CEILING = 2.0


@dataclass(frozen=True)
class A2AConfig:
    """Wire format of each all-to-all leg, plus how MXFP8 scales are chosen."""

    dispatch_fwd: str = "bf16"
    dispatch_bwd: str = "bf16"
    combine_fwd: str = "bf16"
    combine_bwd: str = "bf16"
    # "rceil": scale exponent = ceil(log2(amax / 448)) (cuBLAS / torchao default);
    # "floor": OCP MX spec, floor(log2(amax)) - 8 (can saturate, can diverge in training).
    scale_rounding: str = "rceil"
    # "auto": Triton kernels on CUDA, torch reference elsewhere.
    kernel: str = "auto"
    # ``mxfp8_ep.transport.Transport``: how rows travel between EP ranks.
    transport: str = Transport.AUTO.value
    # symm, router scores after the experts, top-k > 1: combine's forward sends one weighted
    # fp32 partial sum per token and rank instead of each row (at top-8 on 2 ranks a quarter
    # of the rows), and keeps the expert outputs for the score gradients: the drop-free
    # capacity's rows, EP x tokens x top_k, instead of each token's top_k
    # rows (EP times the memory: 1.9 vs 0.94 GB per layer at DeepSeek-V3-like shapes on 2
    # GPUs, 7.5 vs 0.94 GB on 8). False: combine's forward goes row by row.
    symm_combine_partial_sums: bool = True
    # Rows that stay on their rank go through the same MXFP8 quantize -> dequantize on every
    # MXFP8 leg as the rows that cross: the numerics of every row crossing (a study option: EP=1
    # on one GPU then trains as an EP degree with no local rows would). False: rows that stay
    # are never quantized.
    quantize_local_rows: bool = False
    # symm: the rows of the expert-major tensors (and of what scales with them), as a multiple
    # of the balanced case, the T x top_k rows a rank receives when every rank routes alike
    # (``capacity.expert_major_capacity``). A step whose routing needs more is flagged on the
    # device and runs again at a grown capacity (``mxfp8_ep.elastic``): no token is dropped
    # and no host sync is added per layer. None: the worst case, EP x T x top_k rows.
    capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR
    # symm: the most rows the capacity grows to, as the same multiple (the capacity grows to
    # the larger of this and ``capacity_factor``). A step that needs more runs once more with
    # each dispatch at exactly the rows it needs (a spill, ``capacity.next_capacity``). None: no
    # ceiling below the worst case.
    capacity_ceiling: float | None = DEFAULT_CAPACITY_CEILING
    # symm: the activations the MoE layers keep for their backward at expert-major rows, packed
    # down to the rows their routing filled, in one pool per step (``mxfp8_ep.pool.activation_pool``)
    # of this many rows: the multiple of the balanced case (as ``capacity_factor``) summed over
    # the MoE layers. A step whose layers need more is flagged on the device and runs again at a
    # grown pool, as a capacity overflow does. None: no pool (each layer keeps them at the
    # capacity, which never overflows a pool).
    activation_pool_factor: float | None = DEFAULT_POOL_FACTOR
    # symm: the most rows the pool grows to, as the same multiple (at least
    # ``activation_pool_factor``: a lower one is a problem); a step that needs more spills (runs
    # again keeping exactly its routed rows). None: no ceiling below every layer's worst case.
    activation_pool_ceiling: float | None = DEFAULT_POOL_CEILING
    # two_hop: the EP ranks of one node, ``ranks_per_node`` consecutive ranks per node (the
    # layout torchrun and SLURM give). None: the ranks that share a host name.
    ranks_per_node: int | None = None

    def problems(self) -> list[str]:
        """What is wrong with this config, one line per field (empty: nothing). Not checked at
        construction: ``TokenDispatcher.Config.build`` checks it on every rank of the group at
        once (a rank whose config is wrong then fails every rank, naming itself and the
        problem); elsewhere ``check`` does."""
        found = [f"A2AConfig.{name}={getattr(self, name)!r}: expected one of {allowed}"
                 for name, allowed in FIELD_CHOICES.items() if getattr(self, name) not in allowed]
        for name in ("symm_combine_partial_sums", "quantize_local_rows"):
            if not isinstance(getattr(self, name), bool):
                found.append(f"A2AConfig.{name}={getattr(self, name)!r}: expected true or false")
        for name in ("capacity_factor", "capacity_ceiling", "activation_pool_factor", "activation_pool_ceiling"):
            error = capacity_factor_error(getattr(self, name))
            if error is not None:
                found.append(f"A2AConfig.{name}={getattr(self, name)!r}: {error}")
        if self.ranks_per_node is not None and not (isinstance(self.ranks_per_node, int)
                                                    and not isinstance(self.ranks_per_node, bool)
                                                    and self.ranks_per_node >= 1):
            found.append(f"A2AConfig.ranks_per_node={self.ranks_per_node!r}: expected an integer >= 1 or None "
                         f"(the ranks that share a host name)")
        if pool_ceiling_error(self.activation_pool_factor, self.activation_pool_ceiling) is not None:
            found.append(f"A2AConfig.activation_pool_ceiling={self.activation_pool_ceiling!r}: "
                         f"{pool_ceiling_error(self.activation_pool_factor, self.activation_pool_ceiling)}")
        if self.quantize_local_rows is True and not quantized_formats(getattr(self, leg) for leg in LEGS):
            found.append(
                "A2AConfig.quantize_local_rows=True quantizes the rows that stay on their rank on the "
                "MXFP8 legs, but every leg is bf16: choose MXFP8 legs (a2a=mxfp8 or mxfp8_all) or "
                "drop quantize_local_rows"
            )
        return found

    def check(self) -> A2AConfig:
        """This config, or a ``ValueError`` listing its ``problems``."""
        found = self.problems()
        if found:
            raise ValueError("; ".join(found))
        return self

    @staticmethod
    def legs() -> tuple[str, str, str, str]:
        return LEGS

    def wire_format(self, leg: str) -> WireFormat:
        """The format ``leg`` travels in."""
        return WireFormat(getattr(self, leg))

    @property
    def any_quantized(self) -> bool:
        return any(self.wire_format(leg).quantized for leg in LEGS)

    @classmethod
    def preset(cls, name: str, **overrides) -> "A2AConfig":
        try:
            legs = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown a2a preset {name!r}; known: {sorted(PRESETS)}") from None
        return cls(**{**legs, **overrides})

    @classmethod
    def from_dict(cls, values: dict) -> "A2AConfig":
        """Build from a mapping that may carry extra keys (e.g. a Hydra group's ``name``)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def capacity_factor_error(factor) -> str | None:
    """Why ``factor`` is no ``A2AConfig.capacity_factor``, or None."""
    if factor is None or (isinstance(factor, (int, float)) and not isinstance(factor, bool)
                          and 0 < factor < float("inf")):
        return None
    return ("expected a finite number > 0 (the expert rows as a multiple of the balanced case's; below 1 the "
            "first steps replay until the capacity has grown to what the routing needs) or None / null (the "
            "worst case, EP x tokens x top_k rows)")


def pool_ceiling_error(factor, ceiling) -> str | None:
    """Why ``ceiling`` is no ``A2AConfig.activation_pool_ceiling`` for the pool starting at
    ``factor`` (both valid numbers, the ceiling below the start: the pool could never hold what
    it starts with), or None."""
    if (factor is None or ceiling is None or capacity_factor_error(factor) is not None
            or capacity_factor_error(ceiling) is not None or ceiling >= factor):
        return None
    return (f"below activation_pool_factor={factor!r}, where the pool starts: use a ceiling >= the factor "
            f"(e.g. {factor!r}) or None / null (every layer's worst case), or a smaller activation_pool_factor")


_BF16 = {leg: "bf16" for leg in LEGS}
PRESETS: dict[str, dict[str, str]] = {
    # Exactly torchtitan's ExpertParallel.
    "bf16": _BF16,
    # torchao's choice: quantize the two exchanges whose receivers feed a matmul in low
    # precision anyway (tokens into the experts, and gradients into the experts' backward).
    "mxfp8": {**_BF16, "dispatch_fwd": "mxfp8", "combine_bwd": "mxfp8"},
    "mxfp8_all": {leg: "mxfp8" for leg in _BF16},
}
