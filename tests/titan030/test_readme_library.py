"""The README's library snippets on the torchtitan 0.3.0 stack: its 0.3.0 form puts the
dispatcher on every MoE layer of a parsed job config, and the 0.2.2 form says which form works
here instead of failing on a missing torchtitan module."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

titan030 = pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
(SNIPPET,) = [s for s in re.findall(r"```python\n(.*?)```", README, flags=re.S) if "install_expert_parallel(" in s]
# The snippet's two forms: torchtitan 0.2.2's, then from its "# torchtitan 0.3.0" comment 0.3.0's.
FORM_022, FORM_030 = SNIPPET.split("# torchtitan 0.3.0")


def test_the_030_snippet_puts_the_dispatcher_on_every_moe_layer():
    job_config = ConfigManager().parse_args(["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
                                             "--parallelism.expert_parallel_degree", "2",
                                             "--training.disable_cuda_graphs"])
    exec("#" + FORM_030, {"job_config": job_config})  # noqa: S102 - the README's own lines
    dispatchers = [c for _, c, _, _ in job_config.model_spec.model.traverse(LocalTokenDispatcher.Config)]
    assert dispatchers and all(type(c) is titan030.A2ATokenDispatcher.Config for c in dispatchers)


def test_the_022_snippet_names_the_030_form():
    with pytest.raises(ImportError, match=r"torchtitan 0\.3\.0.*mxfp8_ep\.titan030 import token_dispatcher"):
        exec(FORM_022, {})  # noqa: S102
