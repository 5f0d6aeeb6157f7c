"""The Dockerfile cannot be built here (no Docker daemon); check it agrees with pyproject and
keeps the runtime image free of test dependencies."""

import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "Dockerfile").read_text()


def _stages() -> dict[str, str]:
    """Stage name -> its instructions."""
    parts = re.split(r"^FROM \S+ AS (\w+)$", TEXT, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_dockerfile_torch_matches_pyproject_range_and_base_image():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", TEXT, flags=re.M))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_spec = SpecifierSet(next(d for d in deps if d.startswith("torch")).removeprefix("torch"))
    assert args["TORCH_VERSION"] in torch_spec
    base_torch = re.match(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda", args["BASE_IMAGE"]).group(1)
    assert base_torch == args["TORCH_VERSION"], "base image and TORCH_VERSION must move together"


def test_runtime_image_is_a_plain_install_without_tests():
    runtime = _stages()["runtime"]
    (install,) = re.findall(r"pip install [^\n]*", runtime)
    # The package itself with its torchtitan 0.2.2 stack, not editable, no test extras; no second
    # hand-written list of pins.
    assert " -e " not in install and "test" not in install and re.search(r' "\.\[titan022\]"( \\)?$', install)
    assert re.findall(r"[\w-]+==[\w.${}]+", install) == ['torch==${TORCH_VERSION}']
    for needed in ("mxfp8_ep", "launch", "conf", "recipes"):
        assert re.search(rf"^COPY {needed} ", runtime, flags=re.M), needed
    assert "COPY tests" not in runtime and "pytest" not in runtime


def test_test_stage_adds_the_test_extras_and_runs_the_suite():
    test = _stages()["test"]
    assert '".[test,titan022]"' in test and "COPY tests ./tests" in test
    assert 'CMD ["python", "-m", "pytest", "-q", "tests"]' in test
