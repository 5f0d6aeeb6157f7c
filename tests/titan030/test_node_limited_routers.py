"""Node-limited routing on torchtitan 0.3.0: the recipe's groups in the routers of the model its
job config builds (tests/test_node_limited.py's test, on 0.3.0's stack). Seconds."""

from __future__ import annotations

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from tests.test_node_limited import test_node_limited_routing_reaches_torchtitans_routers  # noqa: E402,F401
