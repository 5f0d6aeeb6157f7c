"""The transport registry (``mxfp8_ep.dispatcher.register_transport``): every transport the config
names has a registered class, ``Config.build`` gives each config the class registered for its
transport that serves it, and a class registered from another file takes part like the
library's own. And the transport seam: ``mxfp8_ep.transport`` is the only code in the library,
the recipe and the benchmarks that spells transport names (``tests.seam_scan``)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.config import PRESETS, A2AConfig
from mxfp8_ep.dispatcher import (
    FusedNcclTokenDispatcher,
    NcclTokenDispatcher,
    SymmTokenDispatcher,
    TokenDispatcher,
    register_transport,
    registered_transports,
)
from mxfp8_ep.dispatcher import base as dispatcher_base
from mxfp8_ep.transport import Transport
from tests.moe_harness import preload, run_forked
from tests.seam_scan import ROOT, found_in, scanned_files, transport_branches


def test_every_configured_transport_is_registered():
    registered = registered_transports()
    assert set(registered) == set(Transport.named())
    for name, classes in registered.items():
        assert classes and all(issubclass(cls, TokenDispatcher) for cls in classes), name
    # Each config is served by exactly one of its transport's classes.
    for transport in Transport.named():
        for preset in PRESETS:
            config = TokenDispatcher.Config(num_experts=4, top_k=2, a2a=A2AConfig.preset(preset))
            assert sum(cls.serves(config) for cls in registered[transport]) == 1, (transport, preset)


def test_only_the_transport_module_spells_transport_names():
    """Code outside ``mxfp8_ep/transport.py`` asks ``Transport``: no comparison of a transport with
    its name, no hand-made list of names, no name given to ``register_transport``."""
    found = found_in(scanned_files(ROOT / "mxfp8_ep" / "transport.py"), transport_branches)
    assert found == {}, f"transport names outside mxfp8_ep/transport.py (ask Transport): {found}"


def test_the_transport_scan_finds_each_kind_of_branch():
    assert transport_branches('if a2a.transport == "symm":\n    pass\n') == [1]
    assert transport_branches('if transport not in ("symm", "nccl"):\n    pass\n') == [1]
    assert transport_branches('TRANSPORTS = ("auto", "symm", "nccl")\n') == [1]
    assert transport_branches('cls = {"symm": A, "nccl": B}[name]\n') == [1]
    assert transport_branches('match self.transport:\n    case "nccl":\n        pass\n') == [2]
    assert transport_branches('@register_transport("nccl")\nclass A:\n    pass\n') == [1]
    # Other things named alike: a process-group backend, a kernel choice.
    assert transport_branches('if dist.get_backend(group) == "nccl":\n    pass\n') == []
    assert transport_branches('if kernel == "auto":\n    pass\n') == []
    assert transport_branches("if transport is Transport.SYMM:\n    pass\n") == []


# The template hooks a transport class fills in (``PushTokenDispatcher``'s docstring).
HOOKS = ("_routing", "_push_to_experts", "_send_buffer", "_exchange", "_push_to_tokens")


def test_every_transport_class_keeps_its_bases_hook_signatures():
    """A hook a transport overrides takes what its base's takes, named alike: the base calls it
    for every transport."""
    for classes in registered_transports().values():
        for cls in classes:
            for hook in HOOKS:
                defined = [base for base in cls.__mro__ if hook in vars(base)]
                signatures = {base.__name__: _parameters(vars(base)[hook]) for base in defined}
                assert len(set(signatures.values())) <= 1, (cls.__name__, hook, signatures)


def _parameters(fn) -> tuple:
    """``fn``'s parameters: name, kind and default of each (annotations left out)."""
    return tuple((p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values())


def test_a_class_registers_under_a_transport_only():
    for name in ("auto", "nvshmem"):
        with pytest.raises(ValueError):
            register_transport(name)


class _Loopback(TokenDispatcher):
    """A transport from outside the library (this test file) for configs with top_k = 3."""

    @classmethod
    def serves(cls, config) -> bool:
        return config.top_k == 3


def _build(rank, world):  # noqa: ARG001
    torch.set_num_threads(1)  # a forked rank: no intra-op thread pool inherited half-made
    def built(preset, top_k):
        config = TokenDispatcher.Config(num_experts=4, top_k=top_k, a2a=A2AConfig.preset(preset, transport="nccl"))
        dispatcher = config.build(dist.group.WORLD, torch.device("cpu"))
        assert type(dispatcher.config) is type(dispatcher).Config, "a dispatcher reads the config as its own class"
        return type(dispatcher)

    library = {(p, k): built(p, k) for p in ("bf16", "mxfp8") for k in (2, 3)}
    # symm reads the config as its own class, which says how it sends each leg.
    symm_config = TokenDispatcher.Config(num_experts=4, top_k=2, a2a=A2AConfig.preset("mxfp8", transport="symm"))
    symm = symm_config.build(dist.group.WORLD, torch.device("cpu"))
    assert type(symm) is SymmTokenDispatcher and type(symm.config) is SymmTokenDispatcher.Config
    assert symm.config.dispatch_bwd_partial_sums and symm.config.combine_fwd_partial_sums
    assert symm.config.scores_after_dequantize  # combine_bwd is MXFP8, top-k > 1
    assert library == {("bf16", 2): NcclTokenDispatcher, ("bf16", 3): NcclTokenDispatcher,
                       ("mxfp8", 2): FusedNcclTokenDispatcher, ("mxfp8", 3): FusedNcclTokenDispatcher}
    # One path per transport: the all-bf16 nccl class refuses quantized legs.
    quantized = TokenDispatcher.Config(num_experts=4, top_k=2, a2a=A2AConfig.preset("mxfp8", transport="nccl"))
    with pytest.raises(ValueError, match="FusedNcclTokenDispatcher carries it"):
        NcclTokenDispatcher(quantized, dist.group.WORLD)
    # Registered after the library's classes: they serve every config first.
    register_transport(Transport.NCCL)(_Loopback)
    assert {(p, k): built(p, k) for p in ("bf16", "mxfp8") for k in (2, 3)} == library
    # The only class of its name (this forked rank's registry): it serves its configs, and a
    # config no class serves is a clear error.
    dispatcher_base._TRANSPORTS[Transport.NCCL] = []
    register_transport(Transport.NCCL)(_Loopback)
    assert built("bf16", 3) is _Loopback and built("mxfp8", 3) is _Loopback
    with pytest.raises(ValueError, match="no token dispatcher serves transport 'nccl'"):
        built("bf16", 2)


def test_build_picks_the_first_registered_class_that_serves_the_config():
    preload(titan=False)
    run_forked(1, _build)  # the registry changes stay in the forked rank
