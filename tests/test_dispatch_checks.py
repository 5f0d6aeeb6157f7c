"""mxfp8_ep/dispatcher/checks.py on its own: the device checks of a rank's routing (fault bits,
and a routing that is safe to index with whatever the input was), the host checks, the
messages that name the failing rank, debug mode, and the group agreement on gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.dispatcher import checks
from mxfp8_ep.dispatcher.checks import Fault
from tests.moe_harness import run_forked

E, K, T = 4, 2, 5
# Where the Triton kernels run: CPU tensors under the interpreter (tests/conftest.py sets it
# when there is no GPU), else compiled on the GPU.
KERNEL_DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def _valid():
    ids = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], dim=1)
    return ids, torch.bincount(ids.reshape(-1), minlength=E)


def _routing(ids, counts):
    checked = checks.check_routing(ids, counts, E)
    assert ((checked.expert_ids >= 0) & (checked.expert_ids < E)).all()
    # What the dispatcher routes by always agrees with itself: no kernel leaves its bounds.
    assert torch.equal(checked.counts, torch.bincount(checked.expert_ids, minlength=E))
    # The Triton kernels (the interpreter on CPU) give the same: ids, counts, fault word.
    fused = checks.check_routing(ids.to(KERNEL_DEVICE), counts.to(KERNEL_DEVICE), E, kernel="triton")
    for field in ("expert_ids", "counts", "fault"):
        assert torch.equal(getattr(fused, field).cpu(), getattr(checked, field)), field
    return Fault(int(checked.fault)), checked


def test_valid_routing_has_no_fault_and_routes_as_given():
    ids, counts = _valid()
    fault, checked = _routing(ids, counts)
    assert fault == Fault(0)
    assert torch.equal(checked.expert_ids, ids.reshape(-1)) and torch.equal(checked.counts, counts)
    # Counts as torchtitan's router makes them (histc: floats) are taken as they are.
    assert _routing(ids, counts.float())[0] == Fault(0)
    # No tokens.
    assert _routing(torch.zeros(0, K, dtype=torch.int64), torch.zeros(E, dtype=torch.int64))[0] == Fault(0)


@pytest.mark.parametrize("bad", [-1, E, 10**6])
def test_out_of_range_ids(bad):
    ids, counts = _valid()
    counts[ids[2, 1]] -= 1  # counted as torchtitan's histc counts: ids in range only
    ids[2, 1] = bad
    assert _routing(ids, counts)[0] == Fault.EXPERT_ID | Fault.COUNTS_SUM
    counts[0] += 1  # the sum agrees, the histogram does not
    assert _routing(ids, counts)[0] == Fault.EXPERT_ID | Fault.COUNTS


def test_counts_that_disagree_with_the_ids():
    ids, counts = _valid()
    assert _routing(ids, counts.roll(1))[0] == Fault.COUNTS  # same sum
    more = counts.clone()
    more[1] += T
    assert _routing(ids, more)[0] == Fault.COUNTS | Fault.COUNTS_SUM


def test_triton_kernels_equal_the_twin_over_many_blocks():
    """More ids than one program takes, ids piled on a few experts, E not a power of two."""
    g = torch.Generator().manual_seed(0)
    for num_experts, tokens in ((6, 700), (1, 300), (8, 0)):
        ids = torch.randint(-2, num_experts + 2, (tokens, 3), generator=g)
        ids[: tokens // 2] = 0  # a hot expert: many atomic adds into one bin
        for counts in (torch.bincount(ids.clamp(0, num_experts - 1).reshape(-1), minlength=num_experts)[:num_experts],
                       torch.zeros(num_experts, dtype=torch.int64)):
            want = checks.check_routing(ids, counts, num_experts)
            got = checks.check_routing(ids.to(KERNEL_DEVICE), counts.to(KERNEL_DEVICE), num_experts, kernel="triton")
            for field in ("expert_ids", "counts", "fault"):
                assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), (num_experts, tokens, field)


def test_repeated_ids_are_valid():
    ids = torch.zeros(T, K, dtype=torch.int64)
    assert _routing(ids, torch.bincount(ids.reshape(-1), minlength=E))[0] == Fault(0)


def test_host_checks():
    ids, counts = _valid()
    x, scores = torch.randn(T, 64), torch.rand(T, K)
    kw = dict(num_experts=E, top_k=K, rank=3)
    assert checks.host_fault(x, scores, ids, counts, **kw) is None
    cases = {
        "fp16 tokens": ((x.half(), scores, ids, counts), Fault.DTYPE, TypeError, "float16"),
        "float ids": ((x, scores, ids.float(), counts), Fault.DTYPE, TypeError, "integer expert ids"),
        "3-D tokens": ((x[None], scores, ids, counts), Fault.SHAPE, ValueError, r"x \(T, D\)"),
        "top_k": ((x, scores[:, :1], ids[:, :1], counts), Fault.SHAPE, ValueError, "top_k=2"),
        "scores": ((x, scores[:, :1], ids, counts), Fault.SHAPE, ValueError, "scores"),
        "counts E+1": ((x, scores, ids, torch.cat([counts, counts[:1]])), Fault.COUNTS_SHAPE, ValueError, r"\(4,\)"),
        "counts 2-D": ((x, scores, ids, counts.view(2, 2)), Fault.COUNTS_SHAPE, ValueError, "one count per expert"),
    }
    for name, (args, fault, error, match) in cases.items():
        found = checks.host_fault(*args, **kw)
        assert found is not None and found.fault == fault, name
        assert isinstance(found.error, error), name
        with pytest.raises(error, match=rf"rank 3: .*{match}"):
            raise found.error
    def dim_error(dim):
        return f"dispatch_fwd: needs a multiple of 32, got dim {dim}" if dim % 32 else None

    assert checks.host_fault(x, scores, ids, counts, dim_error=dim_error, **kw) is None
    found = checks.host_fault(x[:, :40], scores, ids, counts, dim_error=dim_error, **kw)
    assert found.fault == Fault.ROW_MULTIPLE
    with pytest.raises(ValueError, match=r"rank 3: dispatch_fwd: needs a multiple of 32, got dim 40 \(the model dim\)"):
        raise found.error


def test_messages_name_the_ranks_and_checks():
    assert checks.fault_message([0, 0, 0]) is None
    checks.raise_on_faults([0, 0])
    message = checks.fault_message([0, int(Fault.EXPERT_ID | Fault.COUNTS_SUM), 0, int(Fault.DTYPE)], num_experts=8)
    assert "rank 0" not in message and "rank 2" not in message
    assert "rank 1: expert ids outside [0, num_experts = 8); num_tokens_per_expert does not sum" in message
    assert "rank 3: tokens not bfloat16/float32" in message
    with pytest.raises(checks.DispatchInputError, match=r"rank 1: expert ids") as raised:
        checks.raise_on_faults([0, int(Fault.EXPERT_ID)])
    assert raised.value.faults == {1: Fault.EXPERT_ID}
    own = TypeError("mine")
    with pytest.raises(TypeError, match="mine"):  # a rank with a host fault raises its own error
        checks.raise_on_faults([0, int(Fault.DTYPE)], own=own)
    with pytest.raises(checks.DispatchInputError, match="rank 0: more tokens"):  # CPU: read at once
        checks.assert_no_faults(torch.tensor([int(Fault.TOKENS), 0]), debug=False)
    checks.assert_no_faults(torch.zeros(2, dtype=torch.int64), debug=False)
    assert all(f in checks._DESCRIPTIONS for f in Fault)  # every fault says what it is


def test_debug_mode(monkeypatch):
    monkeypatch.delenv(checks.DEBUG_ENV, raising=False)
    assert not checks.debug_mode()
    for value, on in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(checks.DEBUG_ENV, value)
        assert checks.debug_mode() is on, value
        assert checks.debug_mode(True) and not checks.debug_mode(False)  # the config wins
    try:  # set_debug wins over the environment, the config over both
        checks.set_debug(True)
        assert checks.debug_mode() and not checks.debug_mode(False)
        monkeypatch.setenv(checks.DEBUG_ENV, "1")
        checks.set_debug(False)
        assert not checks.debug_mode() and checks.debug_mode(True)
    finally:
        checks.set_debug(None)
    assert checks.debug_mode()  # the environment again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_device_checks_make_no_host_sync(kernel):
    """The device checks of a dispatch and the assert on every rank's fault word: no host sync
    (CUDA's sync debug mode raises on one)."""
    ids, counts = (t.cuda() for t in _valid())
    checks.check_routing(ids, counts, E, kernel)  # warm up (lazy CUDA init, compiling)
    torch.cuda.set_sync_debug_mode("error")
    try:
        checked = checks.check_routing(ids, counts, E, kernel)
        checks.assert_no_faults(checked.fault.view(1), debug=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(checked.fault) == 0


def _agree(rank, world):
    group = dist.group.WORLD
    facts = {"dim": 64, "num_experts": 8}
    assert checks.agree(group, "build", facts, local={"tokens": rank}) == [{"tokens": r} for r in range(world)]
    # A fact that differs: the same ValueError on every rank, naming the field and each rank.
    with pytest.raises(ValueError, match=r"differ.*dim: rank 0 = 64, rank 1 = 96, rank 2 = 64"):
        checks.agree(group, "dispatch", {"dim": 96 if rank == 1 else 64, "num_experts": 8})
    # A rank that failed a host check: its own error there, a named one on its peers.
    fault = None
    if rank == 2:
        fault = checks.HostFault(Fault.DTYPE, TypeError("dispatch on rank 2: takes bfloat16 or float32 tokens"))
    with pytest.raises(TypeError if rank == 2 else checks.DispatchInputError, match=r"rank 2\b.*bfloat16"):
        checks.agree(group, "dispatch", facts, fault)
    # Ranks at different points (one builds while another dispatches).
    with pytest.raises(ValueError, match=r"different points \(rank 0 in build, rank 1 in dispatch"):
        checks.agree(group, "build" if rank == 0 else "dispatch", facts)
    dist.barrier()


def test_agree_on_gloo():
    run_forked(3, _agree, timeout_s=10)


def _where_arguments() -> set[str]:
    """Every ``where=`` the library passes to ``assert_no_faults``, and its default."""
    import ast
    import inspect
    from pathlib import Path

    import mxfp8_ep

    found = {inspect.signature(checks.assert_no_faults).parameters["where"].default}
    for path in Path(mxfp8_ep.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "assert_no_faults":
                found |= {k.value.value for k in node.keywords if k.arg == "where"}
    return found


def test_device_assert_message_fits_cuda(monkeypatch):
    """CUDA's ``torch._assert_async`` refuses messages of 255 characters or more: the sync-free
    check must not raise that error instead of its own."""

    class CudaFaults:  # what the check reads of a CUDA tensor of fault words
        is_cuda = True

        def __eq__(self, other):
            return torch.tensor([True])

    messages = []
    monkeypatch.setattr(torch, "_assert_async", lambda flag, message: messages.append(message))
    wheres = _where_arguments()
    assert len(wheres) >= 2  # the default and the symm transport's
    for where in sorted(wheres):
        checks.assert_no_faults(CudaFaults(), debug=False, where=where)
    assert len(messages) == len(wheres)
    for message in messages:
        assert len(message) < checks.DEVICE_ASSERT_MESSAGE_LIMIT, message
        assert checks.DEBUG_ENV in message
