"""The transport registry (``mxfp8_ep.dispatcher.register_transport``): every transport the config
names has a registered class, ``Config.build`` gives each config the class registered for its
transport that serves it, and a class registered from another file takes part like the
library's own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mxfp8_ep.config import PRESETS, TRANSPORTS, A2AConfig
from mxfp8_ep.dispatcher import (
    FusedNcclTokenDispatcher,
    NcclTokenDispatcher,
    TokenDispatcher,
    register_transport,
    registered_transports,
)
from mxfp8_ep.dispatcher import base as dispatcher_base
from tests.moe_harness import preload, run_forked


def test_every_configured_transport_is_registered():
    registered = registered_transports()
    assert set(registered) == set(TRANSPORTS) - {"auto"}
    for name, classes in registered.items():
        assert classes and all(issubclass(cls, TokenDispatcher) for cls in classes), name
    # nccl: each config is served by exactly one of its classes.
    for preset in PRESETS:
        config = TokenDispatcher.Config(num_experts=4, top_k=2, a2a=A2AConfig.preset(preset))
        assert sum(cls.serves(config) for cls in registered["nccl"]) == 1, preset


class _Loopback(TokenDispatcher):
    """A transport from outside the library (this test file) for configs with top_k = 3."""

    @classmethod
    def serves(cls, config) -> bool:
        return config.top_k == 3


def _build(rank, world):  # noqa: ARG001
    torch.set_num_threads(1)  # a forked rank: no intra-op thread pool inherited half-made
    def built(preset, top_k):
        config = TokenDispatcher.Config(num_experts=4, top_k=top_k, a2a=A2AConfig.preset(preset, transport="nccl"))
        return type(config.build(dist.group.WORLD, torch.device("cpu")))

    library = {(p, k): built(p, k) for p in ("bf16", "mxfp8") for k in (2, 3)}
    assert library == {("bf16", 2): NcclTokenDispatcher, ("bf16", 3): NcclTokenDispatcher,
                       ("mxfp8", 2): FusedNcclTokenDispatcher, ("mxfp8", 3): FusedNcclTokenDispatcher}
    # One path per transport: the all-bf16 nccl class refuses quantized legs.
    quantized = TokenDispatcher.Config(num_experts=4, top_k=2, a2a=A2AConfig.preset("mxfp8", transport="nccl"))
    with pytest.raises(ValueError, match="FusedNcclTokenDispatcher carries it"):
        NcclTokenDispatcher(quantized, dist.group.WORLD)
    # Registered after the library's classes: they serve every config first.
    register_transport("nccl")(_Loopback)
    assert {(p, k): built(p, k) for p in ("bf16", "mxfp8") for k in (2, 3)} == library
    # The only class of its name (this forked rank's registry): it serves its configs, and a
    # config no class serves is a clear error.
    dispatcher_base._TRANSPORTS["nccl"] = []
    register_transport("nccl")(_Loopback)
    assert built("bf16", 3) is _Loopback and built("mxfp8", 3) is _Loopback
    with pytest.raises(ValueError, match="no token dispatcher serves transport 'nccl'"):
        built("bf16", 2)


def test_build_picks_the_first_registered_class_that_serves_the_config():
    preload(titan=False)
    run_forked(1, _build)  # the registry changes stay in the forked rank
