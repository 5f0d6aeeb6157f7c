"""A torchtitan 0.2.2 MoE layer without expert parallelism (the reference) next to the same layer
under EP through our ``TokenDispatcher``, for tests on gloo process groups.

* The reference is torchtitan's own ``MoE`` (router, shared expert, gather / scatter / bmm
  math), identical on every rank: built from one seed, run on the rank's own tokens.
* The EP layer is a copy of it whose experts hold only this rank's slice
  ``[rank * L, (rank + 1) * L)`` and whose forward is the library's ``dispatcher_moe_forward``
  (router -> dispatch -> local experts -> shared expert -> combine), with a dispatcher the
  test builds (so the test picks transport, legs, padding and buffer size).
* Routing can be forced with the real router: ``expert_bias`` is the router's own
  choice-only bias (``topk(scores + expert_bias)``; the gate values still come from the
  scores), so a per-token ``(T, E)`` bias of +1e4 on the wanted experts makes torchtitan's
  router pick exactly them while its scores, score function, route_norm and gradients stay
  torchtitan's.
* Expert weight gradients: an EP rank's local experts see the rows of every rank, so the
  reference's full-expert gradients are summed over ranks (all_reduce) and sliced.

Two expert implementations, same parameters (``w1``, ``w2``, ``w3`` of torchtitan's
``GroupedExperts``):

* ``grouped``: torchtitan's ``GroupedExperts`` (``use_grouped_mm=False``, its for-loop of
  matmuls). CPU GEMMs block differently for different row counts (MKL sgemm gives different
  last bits for 18 of 79 batch sizes of a 64-wide fp32 product here), and an EP expert
  multiplies a different batch (rows of every rank, plus padding) than the reference expert
  (this rank's rows): results agree to rounding, not bit for bit.
* ``rowwise``: the same SwiGLU expert computed row by row (elementwise products and
  last-dim sums in fp32), so a row's output and input gradient do not depend on which other
  rows share its batch. With it, every difference between EP and reference is the
  dispatcher's own arithmetic, and the transport whose arithmetic is torchtitan's (nccl)
  must agree bit for bit. ``check_rowwise_is_batch_independent`` proves that premise on the
  machine running the test.

``WireLegs`` turns the reference into what EP should compute with an ``A2AConfig``: the rows
that would cross a rank boundary pass each leg's format (quantize + dequantize with the format
reference), forward and backward.

Ranks are forked from the test process (``run_forked``), which imported torch / torchtitan
once (``preload``): spawning them costs ~10 s of imports per rank on the CI machine.
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mxfp8_ep.dispatcher import symm
from mxfp8_ep.elastic import ReplayGuard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPERT_KINDS = ("rowwise", "grouped")
# Per-token choice bias: far above any score (softmax / sigmoid scores lie in [0, 1]).
FORCE_BIAS = 1e4


@dataclass(frozen=True)
class LayerSpec:
    """One MoE layer: torchtitan ``MoEArgs`` fields plus dims, activation dtype and experts."""

    dim: int = 64
    hidden: int = 32
    num_experts: int = 4
    top_k: int = 2
    score_before_experts: bool = False
    score_func: str = "softmax"
    route_norm: bool = False
    experts: str = "rowwise"
    dtype: str = "float32"
    seed: int = 0


def _rowwise_experts_cls():
    from torchtitan.models.moe.moe import GroupedExperts

    class RowwiseExperts(GroupedExperts):
        """torchtitan's SwiGLU experts ``w2 @ (silu(w1 @ x) * (w3 @ x))`` one row at a time:
        elementwise products and last-dim sums in fp32, rounded once to the activation dtype.
        Same parameters and same input layout (expert segments, padding rows at the end)."""

        def forward(self, x, num_tokens_per_expert):
            counts = num_tokens_per_expert.tolist()
            n = sum(counts)
            expert = torch.repeat_interleave(
                torch.arange(len(counts), device=x.device), torch.tensor(counts, device=x.device)
            )
            w1, w2, w3 = self.w1.float(), self.w2.float(), self.w3.float()
            rows = x[:n].float().unsqueeze(1)
            h = F.silu((rows * w1[expert]).sum(-1)) * (rows * w3[expert]).sum(-1)
            out = (h.unsqueeze(1) * w2[expert]).sum(-1).to(x.dtype)
            return torch.vstack((out, out.new_zeros((x.shape[0] - n, out.shape[1]))))

    return RowwiseExperts


def _experts_module(spec: LayerSpec, num_experts: int):
    from torchtitan.models.moe.moe import GroupedExperts

    cls = _rowwise_experts_cls() if spec.experts == "rowwise" else GroupedExperts
    return cls(dim=spec.dim, hidden_dim=spec.hidden, num_experts=num_experts, use_grouped_mm=False)


def build_reference(spec: LayerSpec, device="cpu"):
    """torchtitan's MoE (one shared expert) with every parameter drawn from ``spec.seed``
    (N(0, 1/fan_in): outputs of order one, the same values on every device) in the activation
    dtype, on ``device``."""
    from torchtitan.models.moe.moe import MoE, MoEArgs

    if spec.experts not in EXPERT_KINDS:
        raise ValueError(f"experts must be one of {EXPERT_KINDS}, got {spec.experts!r}")
    args = MoEArgs(
        num_experts=spec.num_experts, num_shared_experts=1, score_func=spec.score_func,
        route_norm=spec.route_norm, score_before_experts=spec.score_before_experts,
        top_k=spec.top_k, use_grouped_mm=False,
    )
    moe = MoE(args, dim=spec.dim, hidden_dim=spec.hidden)
    moe.experts = _experts_module(spec, spec.num_experts)
    g = torch.Generator().manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    for _, p in sorted(moe.named_parameters()):
        p.data = (torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5).to(dtype)
    return moe.to(device)


def build_ep_layer(reference, spec: LayerSpec, dispatcher, rank: int):
    """A copy of ``reference`` whose experts are this rank's slice and whose forward goes
    through ``dispatcher`` (``mxfp8_ep.titan022.dispatcher_moe_forward``)."""
    from mxfp8_ep.titan022 import ExpertParallelPlan

    L = dispatcher.num_local_experts
    ep = copy.deepcopy(reference)
    local = _experts_module(spec, L).to(reference.experts.w1.device)
    for name in ("w1", "w2", "w3"):
        full = getattr(reference.experts, name)
        getattr(local, name).data = full.data[rank * L : (rank + 1) * L].clone()
    ep.experts = local
    # What DispatcherExpertParallel records; the dispatcher is ours (token_dispatcher_for
    # returns a MoE's existing dispatcher).
    local.expert_parallel_plan = ExpertParallelPlan(
        dispatcher.group, dispatcher.config.a2a, dispatcher.config.max_tokens_per_rank
    )
    ep.token_dispatcher = dispatcher
    return ep


def ep_forward(moe, x):
    from mxfp8_ep.titan022 import dispatcher_moe_forward

    return dispatcher_moe_forward(moe, x)


def reference_forward(moe, x):
    from mxfp8_ep.titan022 import _ORIGINAL
    from torchtitan.models.moe.moe import MoE

    # torchtitan's forward even where install_expert_parallel patched MoE.forward.
    return _ORIGINAL.get("MoE.forward", MoE.forward)(moe, x)


def choice_bias(choice, num_experts: int, dtype=torch.float32) -> torch.Tensor:
    """``(T, E)`` expert_bias that makes torchtitan's router pick ``choice[t]`` for token t."""
    bias = torch.zeros((len(choice), num_experts), dtype=dtype)
    for t, experts in enumerate(choice):
        bias[t, list(experts)] = FORCE_BIAS
    return bias


class _Leg(torch.autograd.Function):
    """Identity whose forward / backward pass the rows marked ``crossing`` through the leg
    formats: what an EP rank boundary does to them (rows that stay are never quantized).
    Where ``fwd`` / ``bwd`` is a tensor instead of a format, the crossing rows take its rows
    (a weighted leg that crosses as tokens: ``WireLegs.scores_after_dequantize``); where it is
    a function, it maps the rows (partial sums: ``WireLegs.partial_sums``)."""

    @staticmethod
    def forward(ctx, rows, crossing, fwd, bwd, rounding):
        ctx.crossing, ctx.bwd, ctx.rounding = crossing, bwd, rounding
        return _through(rows, crossing, fwd, rounding)

    @staticmethod
    def backward(ctx, grad):
        return _through(grad, ctx.crossing, ctx.bwd, ctx.rounding), None, None, None, None


def symm_quantizes_partial_sums(config) -> bool:
    """Whether the symm transport of a ``TokenDispatcher.Config`` sends a token-bound leg as
    quantized partial sums (``SymmTokenDispatcher.Config.dispatch_bwd_partial_sums`` /
    ``combine_fwd_partial_sums`` on an MXFP8 leg): other values on the wire than the fused nccl
    transport's rows, not only another rounding."""
    from mxfp8_ep.dispatcher import SymmTokenDispatcher

    symm = SymmTokenDispatcher.Config.of(config)
    return ((symm.dispatch_bwd_partial_sums and symm.a2a.dispatch_bwd == "mxfp8")
            or (symm.combine_fwd_partial_sums and symm.a2a.combine_fwd == "mxfp8"))


def _token_groups(crossing, ids, num_local) -> list[list[int]]:
    """The crossing expert-sorted rows grouped by (token, owner rank), each group in sorted
    order (the owner's expert-major order)."""
    flat = ids.reshape(-1)
    slot = torch.argsort(flat, stable=True)
    token, owner = slot // ids.shape[1], flat[slot] // num_local
    groups: dict[tuple[int, int], list[int]] = {}
    for j in torch.nonzero(crossing).squeeze(1).tolist():
        groups.setdefault((int(token[j]), int(owner[j])), []).append(j)
    return list(groups.values())


class _PartialCombine(torch.autograd.Function):
    """Combine's legs as symm sends them with partial sums (``WireLegs.combine_partial_sums``,
    scores after the experts), on the expert-sorted output rows ahead of torchtitan's bmm.

    Forward: each (token, owner) group of crossing rows becomes one row, ``P / s_max`` in the
    row of the group's largest score ``s_max`` (zeros in the others), where ``P`` is the fp32
    sum of ``score * row``, rounded to the activation dtype and, on an MXFP8 leg, quantized:
    the bmm gives back ``P`` (to one more rounding of the quotient). A bf16 leg keeps the rows
    (its regrouping is within the bf16 order tolerance). Backward: the rows' gradient as
    ``bwd`` says (``_Leg``); the score gradient of every crossing slot becomes
    ``<output gradient through combine's backward format, expert output>``, by adding that
    minus what the bmm took against the rows it saw."""

    @staticmethod
    def forward(ctx, rows, top_scores, crossing, ids, num_local, grad_out, fwd, bwd, bwd_fmt, rounding):
        K = ids.shape[1]
        slot = torch.argsort(ids.reshape(-1), stable=True)
        score = top_scores.detach().reshape(-1)[slot].float()
        out = rows.clone()
        if fwd == "mxfp8":
            for group in _token_groups(crossing, ids, num_local):
                total = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
                for j in group:
                    total = total + rows[j].float() * score[j]
                summed = mxfp8_round_trip(total.to(rows.dtype).unsqueeze(0), rounding)[0]
                carrier = group[int(torch.argmax(score[group]))]
                out[group] = 0
                if score[carrier] != 0:
                    out[carrier] = (summed.float() / score[carrier]).to(rows.dtype)
        ctx.save_for_backward(rows, out)
        ctx.slot, ctx.K, ctx.crossing, ctx.grad_out = slot, K, crossing, grad_out
        ctx.bwd, ctx.bwd_fmt, ctx.rounding, ctx.scores_like = bwd, bwd_fmt, rounding, top_scores.detach()
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, out = ctx.saved_tensors
        slot, crossing = ctx.slot, ctx.crossing
        g = ctx.grad_out[slot // ctx.K].float()
        crossed = mxfp8_round_trip(ctx.grad_out, ctx.rounding)[slot // ctx.K].float() if ctx.bwd_fmt == "mxfp8" else g
        fix = torch.zeros(slot.numel(), dtype=torch.float32, device=rows.device)
        want = (crossed * rows.float()).sum(dim=1)
        took = (g * out.float()).sum(dim=1)
        fix[slot[crossing]] = (want - took)[crossing]
        grad_scores = fix.view(ctx.scores_like.shape).to(ctx.scores_like.dtype)
        return _through(grad, crossing, ctx.bwd, ctx.rounding), grad_scores, *([None] * 8)


def mxfp8_round_trip(rows: torch.Tensor, rounding: str) -> torch.Tensor:
    """``rows`` through one MXFP8 quantize + dequantize (the format reference)."""
    from mxfp8_ep.format.mxfp8 import dequantize_reference, quantize_reference

    return dequantize_reference(quantize_reference(rows, rounding), rows.dtype)


def _scored_tokens(tokens, ids, top_scores, rounding) -> torch.Tensor:
    """Per expert-sorted row: ``score * dequant(quant(token))`` in fp32, rounded once (what
    a weighted leg gives when its tokens cross in MXFP8 and the receiver multiplies)."""
    slot = torch.argsort(ids.reshape(-1), stable=True)
    decoded = mxfp8_round_trip(tokens, rounding)
    return (decoded[slot // ids.shape[1]].float() * top_scores.reshape(-1)[slot].unsqueeze(1)).to(tokens.dtype)


def _partial_sums(grad, crossing, ids, num_local, rounding) -> torch.Tensor:
    """Per expert-sorted row, dispatch's backward as it crosses in partial sums: each token's
    crossing rows with one owner added in fp32 (in sorted order, the owner's expert-major
    order), rounded once, quantized and dequantized, in place of the first; zeros in the
    others. Rows that stay: as they are."""
    out = grad.clone()
    for rows in _token_groups(crossing, ids, num_local):
        total = torch.zeros(grad.shape[1], dtype=torch.float32, device=grad.device)
        for j in rows:
            total = total + grad[j].float()
        out[rows[0]] = mxfp8_round_trip(total.to(grad.dtype).unsqueeze(0), rounding)[0]
        out[rows[1:]] = 0
    return out


def _through(rows, crossing, fmt, rounding):
    if callable(fmt):
        return fmt(rows)
    out = rows.clone()
    if isinstance(fmt, torch.Tensor):
        out[crossing] = fmt[crossing]
    elif fmt == "mxfp8" and bool(crossing.any()):
        out[crossing] = mxfp8_round_trip(rows[crossing], rounding)
    return out


@dataclass(frozen=True)
class WireLegs:
    """The four legs of an A2AConfig applied in a non-EP layer run by ``run_layer``: the
    experts' (expert-sorted) input rows whose expert lives on another rank of an EP group
    (``rank``, ``num_local`` experts per rank) pass the dispatch legs, their output rows the
    combine legs.

    ``scores_after_dequantize`` (the symm transport with top-k > 1,
    ``SymmTokenDispatcher.Config.scores_after_dequantize``): on the weighted expert-bound leg
    (dispatch's forward when the scores come first, combine's backward when they come after),
    a crossing row is ``score * dequant(quant(token))``, rounded once, instead of
    ``dequant(quant(score * token))``: the token crosses once and its score multiplies on
    the experts' rank.

    ``partial_sums`` (the symm transport, ``SymmTokenDispatcher.Config.dispatch_bwd_partial_sums``) and
    ``combine_partial_sums`` (``combine_fwd_partial_sums``): dispatch's backward, and
    combine's forward, cross as one partial sum per token and rank, each sum (fp32, rounded
    once) quantized instead of each row on an MXFP8 leg. Dispatch's backward: the sum takes the
    place of the group's first row, zeros the others' (the x gradient adds them all). Combine's
    forward: the weighted sum of the group's rows, divided by the largest score of the group,
    takes the place of that score's row (torchtitan's bmm multiplies it back). The score
    gradients of crossing rows are then taken on the experts' rank: ``<output gradient as it
    crossed (combine's backward format), expert output>``."""

    a2a: object  # mxfp8_ep.config.A2AConfig
    rank: int
    num_local: int
    scores_after_dequantize: bool = False
    partial_sums: bool = False
    combine_partial_sums: bool = False


def crossing_rows(ids: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
    """Per expert-sorted row of a rank's routing (torchtitan's stable argsort order): does its
    expert live on another rank?"""
    flat = ids.reshape(-1)
    return flat[torch.argsort(flat, stable=True)] // num_local != rank


@contextlib.contextmanager
def host_sync_check(waits: list):
    """CUDA: inside, every synchronizing CUDA operation raises
    (``torch.cuda.set_sync_debug_mode("error")``), and every explicit host wait, which that mode
    does not see (``Event`` / ``Stream`` / device ``synchronize``), is appended to ``waits``
    with the file and line that made it."""
    import traceback

    def counted(name, original):
        def wait(*args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            waits.append(f"{name} at {caller.filename}:{caller.lineno}")
            return original(*args, **kwargs)

        return wait

    previous = torch.cuda.get_sync_debug_mode()
    with contextlib.ExitStack() as stack:
        for owner, name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                            (torch.cuda, "synchronize")):
            label = f"{getattr(owner, '__name__', owner)}.{name}"
            stack.enter_context(mock.patch.object(owner, name, counted(label, getattr(owner, name))))
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def run_layer(moe, forward, x, grad_out, expert_bias=None, legs: WireLegs | None = None, sync_check: bool = False,
              replay: bool = False):
    """``forward(moe, x)`` on ``x`` (T, D), then backward of ``<out, grad_out>``. Returns the
    output, the gradients (``"x"`` and every parameter by name; zeros where none flowed) and
    what hooks saw: the gradient of the router's top scores (``"scores"``, (T, K)), and the
    experts' input gradient / output rows (``"rows_grad"``, ``"rows_out"``, expert-sorted).
    With ``legs`` (a non-EP layer only), the rows that would cross ranks pass the legs.
    With ``sync_check`` (CUDA), forward and backward run under ``host_sync_check`` (its host
    waits in ``"host_waits"``) except the experts' forward: these test experts read their
    counts on the host (torchtitan's for-loop experts do too; its grouped-GEMM experts and the
    library's do not). With ``replay``, forward and backward run through
    ``mxfp8_ep.elastic.ReplayGuard``: again after a dispatch overflowed its capacity (how
    often: ``"replays"``); a spill's rerun, whose dispatches read their rows on the host by
    design, runs without ``host_sync_check``. Several layers: ``run_stack``."""
    seen = {"host_waits": [], "replays": 0}

    def on_router(_module, args, outputs):
        seen["ids"] = outputs[1]
        seen["tokens"], seen["top_scores"] = args[0].detach(), outputs[0].detach()
        seen["top_scores_live"] = outputs[0]
        outputs[0].register_hook(lambda g: seen.__setitem__("scores", g))

    def scored(fmt, tokens):
        """The weighted expert-bound leg's format, or its crossing rows as tokens that crossed
        (``WireLegs.scores_after_dequantize``)."""
        if not (legs.scores_after_dequantize and fmt == "mxfp8"):
            return fmt
        return _scored_tokens(tokens, seen["ids"], seen["top_scores"], legs.a2a.scale_rounding)

    def on_experts(_module, args, output):
        seen["rows_out"] = output.detach()
        args[0].register_hook(lambda g: seen.__setitem__("rows_grad", g))

    def dispatch_legs(_module, args):
        a2a, seen["crossing"] = legs.a2a, crossing_rows(seen["ids"], legs.rank, legs.num_local)
        fwd = scored(a2a.dispatch_fwd, seen["tokens"]) if moe.score_before_experts else a2a.dispatch_fwd
        bwd = a2a.dispatch_bwd
        if legs.partial_sums and bwd == "mxfp8":
            crossing, ids = seen["crossing"], seen["ids"]
            bwd = lambda grad: _partial_sums(grad, crossing, ids, legs.num_local, a2a.scale_rounding)  # noqa: E731
        return (_Leg.apply(args[0], seen["crossing"], fwd, bwd, a2a.scale_rounding), *args[1:])

    def combine_legs(_module, _args, output):
        a2a = legs.a2a
        # The experts' output gradient is the layer's (torchtitan adds the shared experts'
        # output to the combined one) times each row's score.
        bwd = (a2a.combine_bwd if moe.score_before_experts
               else scored(a2a.combine_bwd, grad_out.view(-1, grad_out.shape[-1])))
        if legs.combine_partial_sums and not moe.score_before_experts:
            return _PartialCombine.apply(
                output, seen["top_scores_live"], seen["crossing"], seen["ids"], legs.num_local,
                grad_out.view(-1, grad_out.shape[-1]), a2a.combine_fwd, bwd, a2a.combine_bwd, a2a.scale_rounding,
            )
        return _Leg.apply(output, seen["crossing"], a2a.combine_fwd, bwd, a2a.scale_rounding)

    moe.expert_bias = expert_bias
    hooks = [moe.router.register_forward_hook(on_router), moe.experts.register_forward_hook(on_experts)]
    if legs is not None:
        hooks += [moe.experts.register_forward_pre_hook(dispatch_legs), moe.experts.register_forward_hook(combine_legs)]
    if sync_check:
        hooks += [moe.experts.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode(0)),
                  moe.experts.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode("error"))]
    guard = ReplayGuard(moe.modules()) if replay else None
    x_in = x
    try:
        for attempt in guard.attempts() if guard is not None else (0,):
            moe.zero_grad(set_to_none=True)
            x = x_in.detach().clone().requires_grad_(True)
            seen["host_waits"].clear()
            # A spill's rerun (an exact scope) reads each dispatch's rows on the host by design;
            # a scoped attempt reads nothing.
            scope = symm.innermost_scope()
            checked = sync_check and not (scope is not None and scope.exact)
            with host_sync_check(seen["host_waits"]) if checked else contextlib.nullcontext():
                out = forward(moe, x.view(1, *x.shape)).view(x.shape)
                out.backward(grad_out)
            seen["replays"] = attempt
    finally:
        for h in hooks:
            h.remove()
    grads = {"x": x.grad if x.grad is not None else torch.zeros_like(x)}
    for name, p in moe.named_parameters():
        grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
    return out.detach(), grads, seen


def run_stack(layers, forward, x, grad_out):
    """Layers one after the other (forward of all, then one backward): output and gradients,
    ``"x"`` and ``"<layer index>.<parameter name>"``."""
    x = x.detach().clone().requires_grad_(True)
    h = x.view(1, *x.shape)
    for layer in layers:
        layer.expert_bias = None
        layer.zero_grad(set_to_none=True)
        h = forward(layer, h)
    h.backward(grad_out.view(h.shape))
    grads = {"x": x.grad}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            grads[f"{i}.{name}"] = p.grad if p.grad is not None else torch.zeros_like(p)
    return h.detach().view(x.shape), grads


def reference_expert_grads(grads: dict, rank: int, num_local: int, group=None) -> None:
    """In place: the reference's full expert gradients (every ``experts.w1/w2/w3`` entry, with
    any prefix) -> summed over ranks (in fp32, one rounding to the parameter dtype), this
    rank's slice."""
    for name in sorted(n for n in grads if re.fullmatch(r"(\d+\.)?experts\.w[123]", n)):
        total = grads[name].float()
        dist.all_reduce(total, group=group)
        grads[name] = total[rank * num_local : (rank + 1) * num_local].to(grads[name].dtype)


def rel_err(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Relative Frobenius error ``|got - ref| / |scale|`` (``scale`` defaults to ``ref``);
    0 for empty tensors, inf for a nonzero difference against a zero scale."""
    diff = (got.float() - ref.float()).norm().item()
    norm = (ref if scale is None else scale).float().norm().item()
    if norm == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / norm


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_rowwise_is_batch_independent(dtype: torch.dtype, dim: int = 64, hidden: int = 32) -> None:
    """The premise of the exact comparisons: a ``rowwise`` expert gives each row the same
    output and the same input gradient whether it is computed alone or in a batch (on the CPU;
    CUDA splits the reductions by the batch's shape)."""
    spec = LayerSpec(dim=dim, hidden=hidden, num_experts=2, dtype=next(k for k, v in DTYPES.items() if v == dtype))
    experts = _experts_module(spec, 2)
    g = torch.Generator().manual_seed(5)
    for p in experts.parameters():
        p.data = torch.randn(p.shape, generator=g).to(dtype)
    x = torch.randn(37, dim, generator=g).to(dtype).requires_grad_(True)
    gy = torch.randn(37, dim, generator=g).to(dtype)
    counts = torch.tensor([20, 13])
    y = experts(x, counts)
    (gx,) = torch.autograd.grad(y, x, gy)
    for lo, hi, e in ((0, 1, 0), (5, 9, 0), (20, 21, 1), (25, 33, 1)):
        xs = x.detach()[lo:hi].clone().requires_grad_(True)
        c = torch.tensor([hi - lo, 0] if e == 0 else [0, hi - lo])
        ys = experts(xs, c)
        (gxs,) = torch.autograd.grad(ys, xs, gy[lo:hi])
        assert torch.equal(bits(ys), bits(y[lo:hi].detach())), "rowwise expert output depends on the batch"
        assert torch.equal(bits(gxs), bits(gx[lo:hi])), "rowwise expert input gradient depends on the batch"


def setup_rank() -> None:
    """Per rank: one intra-op thread (ranks share a few cores; one thread also keeps CPU
    reductions in one order) and torchtitan's CPU patch for the router's integer histc (the
    only one of launch.titan.cpu_compat's patches a bare MoE layer needs; the others import
    most of torchtitan)."""
    from launch.titan.cpu_compat import _patch_histc

    torch.set_num_threads(1)
    _patch_histc()


def preload(titan: bool = True) -> None:
    """Import what the ranks use (torchtitan's MoE alone takes seconds), so forked ranks
    inherit it instead of importing it once per rank."""
    import mxfp8_ep.dispatcher  # noqa: F401
    import mxfp8_ep.titan022  # noqa: F401

    if titan:
        import torchtitan.models.moe.moe  # noqa: F401


def _forked_entry(rank: int, world_size: int, port: int, timeout_s: float, fn, args) -> None:
    import os
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_forked(world_size: int, fn, *args, timeout_s: float = 120) -> None:
    """``tests.distributed.run_on_ranks`` on gloo (same bounded collective timeout), but the
    ranks are forked from this process (after ``preload``), not spawned: a spawned rank
    re-imports torch and torchtitan, which costs more than the checks. Falls back to spawning
    where CUDA is initialized here (a forked process cannot use it)."""
    import torch.multiprocessing as mp

    from tests.distributed import free_port, run_on_ranks

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        run_on_ranks(world_size, fn, *args, timeout_s=timeout_s)
        return
    mp.start_processes(
        _forked_entry, args=(world_size, free_port(), timeout_s, fn, args), nprocs=world_size, join=True,
        start_method="fork",
    )
