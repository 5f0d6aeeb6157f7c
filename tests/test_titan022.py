"""Our token dispatcher (transport nccl) inside torchtitan 0.2.2's real Llama4 and DeepSeek-V3 models (tiny
flavors), EP=2 on two gloo processes, parallelized by torchtitan's own ``apply_moe_ep_tp``.

* ``bf16`` preset: logits and every gradient equal torchtitan's ExpertParallel bit for bit.
* ``mxfp8`` / ``mxfp8_all``: within a tolerance derived from the format. Each quantized element
  moves by at most 2**-4 of its magnitude (e4m3 keeps 3 mantissa bits; RCEIL never clips) and
  by ~2**-5.6 in RMS for uniform rounding error; a quantized exchange on the way in (and/or
  the way back) adds that relative error once per leg to the expert path, and the experts'
  linear layers carry it to their outputs at the same order. Outputs and gradients are
  compared by relative Frobenius error, asserted below 2**-4 (the per-element worst case) and
  above zero (the legs really were quantized).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed import backends, rank_device, run_on_ranks

TOLERANCE = 2.0**-4


def _build(family: str, seed: int):
    from torchtitan.protocols import train_spec

    from launch.titan.models import model_args

    args = model_args(family, "tiny")
    args.moe_args.use_grouped_mm = False  # what torchtitan picks below SM90 (and on CPU)
    if family == "deepseek_v3":
        args.moe_impl = "standard"  # set by update_from_config in a real run
    torch.manual_seed(seed)
    model = train_spec.get_train_spec(family).model_cls(args)
    with torch.no_grad():
        model.init_weights()
    return model, args


def _run_model(family, preset, tokens, ep_mesh):
    device = tokens.device
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

    from mxfp8_ep import A2AConfig
    from mxfp8_ep.telemetry import wire_stats
    from mxfp8_ep.titan022 import install_expert_parallel, uninstall_expert_parallel

    model, args = _build(family, seed=0)
    model.to(device)
    if preset is None:
        uninstall_expert_parallel()
    else:
        # nccl: the transport that is torchtitan's math bit for bit (auto picks symm on GPUs).
        install_expert_parallel(A2AConfig.preset(preset, transport="nccl"))
    try:
        apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=ep_mesh, etp_mesh=None, ep_etp_mesh=None)
    finally:
        uninstall_expert_parallel()
    wire_stats.reset()
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.to_local() if hasattr(g, "to_local") else g
    return logits.detach(), grads, wire_stats.snapshot()


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _check(rank, world, family):
    from launch.titan.cpu_compat import apply_cpu_compat

    device = rank_device()
    if device.type == "cpu":
        apply_cpu_compat(force=True)  # gloo processes on a GPU machine are CPU runs too
    ep_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, 512, (2, 32), generator=g).to(device)

    ref_logits, ref_grads, ref_bytes = _run_model(family, None, tokens, ep_mesh)
    assert ref_bytes["total"] == 0, "torchtitan's own ExpertParallel does not go through our ops"

    logits, grads, wire = _run_model(family, "bf16", tokens, ep_mesh)
    assert wire["dispatch_fwd"] > 0 and wire["combine_bwd"] > 0, "our ExpertParallel was not used"
    assert torch.equal(logits, ref_logits), f"{family}: bf16 preset logits differ from torchtitan"
    for name, g_ref in ref_grads.items():
        assert torch.equal(grads[name], g_ref), f"{family}: bf16 preset grad of {name} differs"

    for preset in ("mxfp8", "mxfp8_all"):
        logits, grads, wire = _run_model(family, preset, tokens, ep_mesh)
        err = _rel_err(logits, ref_logits)
        assert 0 < err < TOLERANCE, f"{family}/{preset}: logits rel err {err:.3g}"
        worst = max(_rel_err(grads[n], g) for n, g in ref_grads.items() if g.norm() > 0)
        assert worst < TOLERANCE, f"{family}/{preset}: worst grad rel err {worst:.3g}"
        expert_grad_err = max(_rel_err(grads[n], g) for n, g in ref_grads.items() if ".experts." in n)
        assert expert_grad_err > 0, f"{family}/{preset}: expert grads unchanged, nothing quantized"
        if rank == 0:
            print(f"{family} {preset}: logits rel err {err:.2e}, worst grad rel err {worst:.2e}")
    dist.barrier()


@pytest.mark.parametrize("backend", backends(2))
@pytest.mark.parametrize("family", ["llama4", "deepseek_v3"])
def test_expert_parallel_in_torchtitan_models(family, backend):
    run_on_ranks(2, _check, family, backend=backend)


def test_install_rebinds_and_uninstall_restores():
    import torchtitan.models.llama4.infra.parallelize as parallelize
    from torchtitan.distributed.expert_parallel import ExpertParallel

    from mxfp8_ep import A2AConfig
    from mxfp8_ep.titan022 import DispatcherExpertParallel, install_expert_parallel, uninstall_expert_parallel

    install_expert_parallel(A2AConfig.preset("mxfp8"))
    try:
        plan = parallelize.ExpertParallel()
        assert isinstance(plan, DispatcherExpertParallel) and isinstance(plan, ExpertParallel)
        assert plan.a2a == A2AConfig.preset("mxfp8")
    finally:
        uninstall_expert_parallel()
    assert parallelize.ExpertParallel is ExpertParallel
