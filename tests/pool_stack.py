"""A stack of torchtitan 0.2.2 DeepSeek-V3-like MoE layers under EP through the library
(``install_expert_parallel``: grouped SwiGLU experts in bf16, scores after the experts, so
combine keeps its expert rows), trained a few steps through a ``ReplayGuard`` the ways a
training loop runs them, for the activation pool's and the replay scope's tests on gloo groups:

* where the backward runs: on the calling thread, or on another thread (``backward_thread``),
  as CUDA runs it on its device thread;
* activation checkpointing (``CHECKPOINTS``): full (non-reentrant, every layer, torchtitan's
  ``full``), reentrant, selective (non-reentrant every second layer: torchtitan's ``selective``
  default), op-level selective (matmuls saved, the rest recomputed), and reentrant on the middle
  layer only;
* schedules of a step's microbatches (``SCHEDULES``): each forward then its backward; every
  forward, then every backward (``forward_done`` after the forwards); 1F1B with two microbatches
  in flight (``forward_done`` after each forward), as a pipeline stage runs them;
* replay scopes around the guard: none, one per step, one around the run (``OUTER_SCOPES``).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from mxfp8_ep import elastic
from mxfp8_ep.pool import activation_pool
from mxfp8_ep.dispatcher import release_peer_buffers, symm
from tests.moe_harness import bits

TOKENS = 32  # per rank
DIM = 64
HIDDEN = 32
LAYERS = 3
TOP_K = 2
ALIGN = 8  # torchtitan's TOKEN_GROUP_ALIGN_SIZE_M on the bf16 grouped GEMM
CHECKPOINTS = (None, "full", "reentrant", "selective", "op_selective", "middle_reentrant")
SCHEDULES = ("sequential", "all_forwards_first", "1f1b")
OUTER_SCOPES = (None, "per_step", "run")


def stack(world, a2a, seed=0):
    """``LAYERS`` DeepSeek-V3-like MoE layers from one seed, EP over the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp
    from torchtitan.models.moe import MoE, MoEArgs

    from mxfp8_ep.titan022 import install_expert_parallel, uninstall_expert_parallel

    torch.manual_seed(seed)
    args = MoEArgs(num_experts=4 * world, num_shared_experts=1, top_k=TOP_K, score_func="sigmoid", route_norm=True,
                   score_before_experts=False, use_grouped_mm=True, load_balance_coeff=1e-2)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict()
    for i in range(LAYERS):
        block = torch.nn.Module()
        block.moe, block.moe_enabled = MoE(args, dim=DIM, hidden_dim=HIDDEN), True
        with torch.no_grad():
            block.moe.init_weights(0.02, torch.device("cpu"))
            for p in block.moe.parameters():  # outputs of order one (N(0, 1/fan_in))
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
        block.moe.to(torch.bfloat16)
        model.layers[str(i)] = block
    install_expert_parallel(a2a, max_tokens_per_rank=TOKENS)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=mesh, etp_mesh=None, ep_etp_mesh=None)
    finally:
        uninstall_expert_parallel()
    return [block.moe for block in model.layers.values()]


def skew(moes, on: bool, layers=None) -> None:
    """Every token's choice to experts 0 and 1 (rank 0's) in every layer (``layers``: those
    indices), or the router's own."""
    for i, moe in enumerate(moes):
        with torch.no_grad():
            moe.expert_bias.zero_()
            if on and (layers is None or i in layers):
                moe.expert_bias[:TOP_K] = 1e4


def _saves_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = (torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default)
    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(moe, h, how: str, index: int):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if how == "full" or (how == "selective" and index % 2 == 0):
        return checkpoint(moe, h, use_reentrant=False)
    if how == "reentrant" or (how == "middle_reentrant" and index == LAYERS // 2):
        return checkpoint(moe, h, use_reentrant=True)
    if how == "op_selective":
        return checkpoint(moe, h, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(_saves_matmuls))
    return moe(h)


def forward(moes, x, checkpoint=None):
    h = x
    for i, moe in enumerate(moes):
        h = moe(h) if checkpoint is None else _checkpointed(moe, h, checkpoint, i)
    return h


def on_another_thread(fn) -> None:
    """``fn()`` on another thread, the caller waiting (as a training thread waits for CUDA's
    device thread to run its backward); what it raises is raised here."""
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (raised again on the caller's thread)
            errors.append(e)

    thread = threading.Thread(target=run, name="backward")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def backward(loss, on_thread: bool, **kwargs) -> None:
    """``loss.backward(**kwargs)``, on another thread where ``on_thread``."""
    if on_thread:
        on_another_thread(lambda: loss.backward(**kwargs))
    else:
        loss.backward(**kwargs)


def _order(schedule: str, microbatches: int) -> list[tuple[str, int]]:
    """The step's passes in order: ("F", i) forward of microbatch i, ("B", i) its backward."""
    if schedule == "sequential":
        return [(p, i) for i in range(microbatches) for p in "FB"]
    if schedule == "all_forwards_first":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    in_flight = 2
    order = [("F", i) for i in range(min(in_flight, microbatches))]
    for i in range(microbatches):
        order.append(("B", i))
        if i + in_flight < microbatches:
            order.append(("F", i + in_flight))
    return order


def run_step(moes, x, guard, *, checkpoint=None, microbatches=1, schedule="sequential", backward_thread=False,
             after_forward=None, retain_graph=False):
    """One attempt's passes (``schedule``): each microbatch's forward of ``x``, then (where the
    schedule checks) ``guard.forward_done()``; an overflowed attempt skips what is left. Returns
    the last loss."""
    checks = guard is not None and schedule != "sequential"
    losses = {}
    for kind, i in _order(schedule, microbatches):
        if kind == "F":
            losses[i] = (forward(moes, x, checkpoint).float() ** 2).mean()
            if after_forward is not None:
                after_forward(moes)
            if checks and not guard.forward_done():
                return losses[i]
        else:
            backward(losses[i], backward_thread, retain_graph=retain_graph)
    return losses[microbatches - 1]


def steps(world, rank, a2a, routings, *, guarded=True, fresh_pools=True, outer_scope=None, **step):
    """Per routing (``"balanced"`` / ``"skewed"``, each on its own tokens): the loss, every
    gradient (input included) and the replays of one step (``run_step`` with ``step``) through
    a ``ReplayGuard`` (without ``guarded``: none; ``outer_scope``: inside replay scopes of the
    caller, ``OUTER_SCOPES``). ``fresh_pools``: start from no activation pool (else an earlier
    run's, its depth known)."""
    release_peer_buffers()
    if fresh_pools:
        activation_pool.release_pools()
    moes = stack(world, a2a)
    params = [p for moe in moes for p in moe.parameters() if p.requires_grad]
    guard = elastic.ReplayGuard([m for moe in moes for m in moe.modules()])
    out = []
    run_scope = symm.replay_scope() if outer_scope == "run" else contextlib.nullcontext()
    try:
        with run_scope:
            for n, routing in enumerate(routings):
                g = torch.Generator().manual_seed(100 * n + rank)
                x_in = torch.randn(1, TOKENS, DIM, generator=g).to(torch.bfloat16)
                skew(moes, routing == "skewed")
                before = guard.replays
                with symm.replay_scope() if outer_scope == "per_step" else contextlib.nullcontext():
                    for _ in guard.attempts() if guarded else (0,):
                        for p in params:
                            p.grad = None
                        x = x_in.clone().requires_grad_(True)
                        loss = run_step(moes, x, guard if guarded else None, **step)
                grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
                out.append((loss.detach(), [x.grad, *grads], guard.replays - before))
                for moe in moes:
                    moe.tokens_per_expert.zero_()
    finally:
        release_peer_buffers()
    return out


def assert_same(got, want, where):
    for n, ((loss, grads, _), (want_loss, want_grads, _)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(bits(loss), bits(want_loss)), (where, n, loss, want_loss)
        for i, (a, b) in enumerate(zip(grads, want_grads, strict=True)):
            assert a is not None and b is not None, (where, n, i)
            assert torch.equal(bits(a), bits(b)), (where, n, i)
