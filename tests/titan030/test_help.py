"""``python launch/train.py --help`` on the torchtitan 0.3.0 stack names the models it trains,
and its examples, the plain default first, pass the checks here: the default model follows the
stack (tiny DeepSeek-V3; 0.3.0 has no Llama4)."""

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
    assert first.split("#")[0].split() == ["python", "launch/train.py"], first
    assert "tiny DeepSeek-V3" in first


@pytest.mark.parametrize("example", [[], ["a2a=mxfp8"], ["--multirun", "a2a=bf16,mxfp8"]],
                         ids=["default", "a2a=mxfp8", "the sweep example"])
def test_the_default_and_helps_examples_pass_the_checks_on_this_stack(tmp_path, example):
    run = run_train(tmp_path, *example, "--cfg", "job", timeout=120)
    assert run.returncode == 0, run.stderr
    assert "name: tiny_dsv3" in run.stdout and "llama4" not in run.stdout
