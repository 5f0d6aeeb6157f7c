"""The routing telemetry on torchtitan 0.3.0's trainer (its MoE layers count their tokens in
``tokens_per_expert_E``): the 0.2.2 stack's tests themselves (tests/test_routing_telemetry.py),
an EP=1 run reporting every degree and an EP=2 symm run whose replayed step counts once, through
``run_training`` on 2 gloo processes. About 2 minutes on 2 cores."""

from __future__ import annotations

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from tests.test_routing_telemetry import (  # noqa: E402,F401
    test_an_ep1_run_reports_every_degree_from_all_ranks_tokens,
    test_an_ep2_symm_run_counts_a_replayed_step_once,
)
