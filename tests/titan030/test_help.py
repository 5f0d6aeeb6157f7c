"""``python launch/train.py --help`` on the torchtitan 0.3.0 stack names the models it trains
and starts its examples with a run that trains here (0.3.0 has no Llama4)."""

from __future__ import annotations

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from tests.train_cli import run_train  # noqa: E402


def test_help_names_this_stacks_models(tmp_path):
    proc = run_train(tmp_path, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    intro, examples = proc.stdout.split("== Config groups")[0], proc.stdout.split("== Examples ==")[1]
    assert intro.startswith("mxfp8ep: train torchtitan 0.3.0's MoE models (DeepSeek-V3, Qwen3 MoE) with expert\n")
    assert "Llama4" not in intro + examples, intro + examples
    first = examples.strip().splitlines()[0]
    assert first.split("#")[0].split() == ["python", "launch/train.py", "model=tiny_dsv3"], first
    run = run_train(tmp_path, *first.split("#")[0].split()[2:], "--cfg", "job", timeout=120)
    assert run.returncode == 0, run.stderr  # the example passes the checks on this stack
