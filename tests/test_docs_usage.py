"""docs/usage.md's commands as written: the folder layout for your own data and the commands
that train on it, and the wandb online command, pass every check before launch (a folder built
exactly as the page describes it; nothing is trained or uploaded)."""

from __future__ import annotations

import gzip
import json
import re
import shlex
import shutil

import pytest

from tests.hydra_compose import REPO, compose_cfg, no_slurm_cluster  # noqa: F401 (autouse)

from launch.launchers.machine import GIB, Machine
from launch.titan.data import TOKENIZER_DIR
from launch.preflight.validate import validate

USAGE = (REPO / "docs" / "usage.md").read_text()
# Two GPUs: the default parallelism=ep2 uses them all (on more, the validator says which option would).
GPU_BOX = Machine(ram_bytes=512 * GIB, cpu_count=32, gpu_memory_bytes=(141 * GIB,) * 2)


def section(title: str) -> str:
    return USAGE.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def train_commands(text: str) -> list[list[str]]:
    """The overrides of every `python launch/train.py` command in the section's code blocks."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command)
            if words[:2] == ["python", "launch/train.py"]:
                out.append([w for w in words[2:] if not w.startswith("--")])
    return out


def test_your_own_data_as_the_page_lays_it_out(tmp_path):
    text = section("Training on your own data")
    layout = re.search(r"```\n(<folder>/.*?)```", text, flags=re.S).group(1)
    files = [line.split()[0].removeprefix("<folder>/") for line in layout.splitlines()]
    assert files == ["train.jsonl.gz", "validation.jsonl.gz", "tokenizer/", "manifest.json"]
    folder = tmp_path / "mycorpus"
    folder.mkdir()
    for split, docs in (("train", 400), ("validation", 200)):
        with gzip.open(folder / f"{split}.jsonl.gz", "wt") as f:
            for i in range(docs):
                f.write(json.dumps({"text": f"document {i}: " + "words of a document " * 40}) + "\n")
    shutil.copytree(TOKENIZER_DIR, folder / "tokenizer")
    (folder / "manifest.json").write_text(json.dumps(
        {"splits": {"train": {"tokens": 2_000_000}, "validation": {"tokens": 400_000}}}))

    (command,) = train_commands(text)
    command = [w.replace("/data/mycorpus", str(folder)) for w in command]
    assert validate(compose_cfg(*command), machine=GPU_BOX) == []

    single = re.search(r"`(training.dataset=mxfp8ep_tiny [^`]*)`", text).group(1).split()
    (tmp_path / "my.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(50)))
    single = [w.replace("/data/my.jsonl", str(tmp_path / "my.jsonl")).replace("<dir>", str(TOKENIZER_DIR))
              for w in single]
    assert validate(compose_cfg(*single), machine=GPU_BOX) == []


def test_the_wandb_online_command(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # what `wandb login` gives (checked before launch)
    (command,) = train_commands(section("wandb"))
    (sweep,) = [o for o in command if o.startswith("a2a=")]
    for a2a in sweep.removeprefix("a2a=").split(","):  # each point of the --multirun sweep
        cfg = compose_cfg(*[f"a2a={a2a}" if o == sweep else o for o in command])
        assert (cfg.logging.wandb_mode, cfg.logging.entity, cfg.logging.project) == (
            "online", "my-team", "moe-a2a")
        assert validate(cfg, machine=GPU_BOX) == []


def test_the_symm_capacity_command_passes_the_checks_on_two_gpus():
    (command,) = train_commands(section("The symm transport's capacity"))
    cfg = compose_cfg(*command)
    assert (cfg.a2a.transport, cfg.a2a.capacity_factor) == ("symm", 0.5)
    assert validate(cfg, machine=GPU_BOX) == []


def test_where_the_flags_go_is_said_once_and_holds_for_hydra():
    """docs/usage.md says where --multirun goes, recipes/README.md points there, and Hydra's own
    parser takes the documented commands and refuses a flag between overrides as the page says."""
    from hydra._internal.utils import get_args_parser

    rule = "`--multirun` and the other `--` flags go before or after the overrides, never between them"
    recipes = (REPO / "recipes" / "README.md").read_text()
    assert rule in section("Runs and sweeps").replace("\n", " ")
    assert rule in recipes.replace("\n", " ") and "before** the overrides" not in recipes
    parser = get_args_parser()
    for text in (USAGE, recipes, (REPO / "README.md").read_text()):
        for words in re.findall(r"python launch/train\.py ([^#`\n]*)", text.replace("\\\n", " ")):
            args = shlex.split(words.replace("<", "").replace(">", ""))
            flags = [i for i, a in enumerate(args) if a.startswith("-")]
            overrides = [i for i, a in enumerate(args) if "=" in a and not a.startswith("-")]
            if flags and overrides:  # the documented order: no flag between two overrides
                assert not any(overrides[0] < f < overrides[-1] for f in flags), words
    assert parser.parse_args(["a2a=bf16,mxfp8", "--multirun"]).overrides == ["a2a=bf16,mxfp8"]
    with pytest.raises(SystemExit):
        parser.parse_args(["a2a=bf16,mxfp8", "--multirun", "training.steps=50"])


def test_the_capacity_line_shown_is_the_one_its_command_prints():
    """The console's capacity line quoted under the symm capacity's command is what the code
    prints for that command's config (a ceiling past the worst case named as the worst case, with
    its own multiple, and each end's own memory figure)."""
    from launch.titan.a2a import a2a_config, capacity_line

    before, quoted = USAGE.split("\na2a capacity  starts at ", 1)
    command = train_commands(before.rsplit("```bash\n", 1)[1].split("```")[0].join(["```bash\n", "```"]))[-1]
    cfg = compose_cfg(*command)
    assert "a2a capacity  starts at " + quoted.split("\n", 1)[0] == capacity_line(cfg, a2a_config(cfg))


def test_slurm_md_says_what_launcher_wait_does_to_a_sweep():
    """``launcher.wait=true`` with ``--multirun`` runs the points' jobs one after another (each
    point's launch waits for its job): the page says so where it introduces the field."""
    from launch.launchers.slurm import SlurmLauncherConfig

    intro = (REPO / "docs" / "slurm.md").read_text().split("\n## ", 1)[0].replace("\n", " ")
    assert SlurmLauncherConfig.wait is False and "(the default, `false`)" in intro
    assert "With `--multirun`, `launcher.wait=true` waits for each point's job to end before it submits the next" \
        in intro and "one at a time" in intro
