"""The recipe's models on torchtitan 0.3.0 (``launch.titan.titan030.models``): the facts table the
checks before launch read (``launch.config.model_facts.MODELS_030``) is what torchtitan 0.3.0 builds, the
recipe's own models attend with sdpa and torchtitan's with flex, the job config carries the
library's override as ``--override.imports`` would and the recipe's FSDP reshard policy,
compute dtype and learning-rate schedule length; checkpoints are written whole through
0.3.0's checkpoint manager. Single process, seconds."""

from __future__ import annotations

import pytest

pytest.importorskip("mxfp8_ep.titan030", exc_type=ImportError)

from tests.test_checkpoints_whole import (  # noqa: E402,F401 (checkpoints written whole, on 0.3.0's manager)
    test_a_synchronous_save_is_renamed_once_whole,
    test_an_asynchronous_save_is_left_as_torchtitan_writes_it,
    test_the_wrapped_save_is_the_installed_torchtitans,
)
from tests.test_titan_runner import (  # noqa: E402,F401 (the 0.2.2 stack's job config tests, here on 0.3.0's)
    test_fsdp_reshard_policy_reaches_torchtitan,
    test_mixed_precision_param_reaches_torchtitan,
    test_the_learning_rate_schedule_spans_the_runs_length_not_the_launchs,
)

from launch.config.model_facts import MODELS_030 as MODELS  # noqa: E402
from launch.config.model_facts import models, resolve  # noqa: E402
from launch.titan.titan030.models import (  # noqa: E402
    OUR_FLAVORS,
    attention_of,
    facts_from_torchtitan,
    flavors_in_torchtitan,
    model_spec,
)


def test_model_facts_table_is_what_torchtitan_030_builds() -> None:
    """One row per MoE flavor torchtitan 0.3.0 ships for DeepSeek-V3 and Qwen3, plus ours, each
    equal to the model torchtitan builds (on the meta device); the table of the installed stack."""
    assert sorted(flavors_in_torchtitan()) == sorted(MODELS)
    for family, flavor in MODELS:
        assert facts_from_torchtitan(family, flavor) == MODELS[family, flavor], (family, flavor)
    assert models() is MODELS and resolve("qwen3", "30b-a3b") == ("qwen3", "30B-A3B")


def test_ours_attend_with_sdpa_torchtitans_with_flex() -> None:
    for family, flavor in MODELS:
        want = "sdpa" if (family, flavor) in OUR_FLAVORS else "flex"
        assert attention_of(model_spec(family, flavor).model) == want == MODELS[family, flavor].attention


def test_tiny_models_are_small_whole_mxfp8_blocks_and_split_over_two_ranks() -> None:
    for family in ("deepseek_v3", "qwen3"):
        m = MODELS[family, "tiny"]
        assert m.dim % 32 == 0 and m.moe_hidden_dim % 32 == 0 and m.num_experts % 2 == 0
        assert m.params < 1_000_000 and m.vocab_size == 512 and m.n_moe_layers == m.n_layers == 2


@pytest.mark.parametrize("a2a", ["bf16", "mxfp8"])
def test_the_job_config_carries_the_override_of_the_command_line(a2a, tmp_path) -> None:
    """The recipe's EP exchange is the library's override entry, the one ``--override.imports
    'mxfp8_ep.titan030.token_dispatcher={...}'`` makes: every A2AConfig field of ``cfg.a2a`` and
    the per-rank tokens; none at EP = 1 (torchtitan's own local path)."""
    from torchtitan.config.override import parse_cli_imports

    from launch.titan.a2a import a2a_config
    from launch.titan.titan030.job_config import build_job_config
    from tests.test_titan_runner import make_cfg

    cfg = make_cfg("deepseek_v3", a2a=a2a)
    config = build_job_config(cfg, str(tmp_path))
    (entry,) = config.override.imports
    a2a_fields = {k: v for k, v in entry[1].items() if k not in ("preset", "max_tokens_per_rank")}
    assert a2a_fields == a2a_config(cfg).__dict__
    cli = f"mxfp8_ep.titan030.token_dispatcher={{\"preset\": \"{a2a}\", \"max_tokens_per_rank\": 256}}"
    (parsed,) = parse_cli_imports([cli])
    assert parsed[0] == entry[0] and entry[1]["preset"] == a2a and entry[1]["max_tokens_per_rank"] == 4 * 64
    assert config.training.disable_cuda_graphs and not config.validator.enable
    assert config.checkpoint.last_save_model_only is False
    cfg.parallelism.ep = 1
    assert build_job_config(cfg, str(tmp_path)).override.imports == []
