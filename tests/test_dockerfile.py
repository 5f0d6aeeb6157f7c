"""The Dockerfile cannot be built here (no Docker daemon); check it agrees with pyproject."""

import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def _dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))


def test_dockerfile_torch_matches_pyproject_range_and_base_image():
    args = _dockerfile_args()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_spec = SpecifierSet(next(d for d in deps if d.startswith("torch")).removeprefix("torch"))
    assert args["TORCH_VERSION"] in torch_spec
    base_torch = re.match(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda", args["BASE_IMAGE"]).group(1)
    assert base_torch == args["TORCH_VERSION"], "base image and TORCH_VERSION must move together"


def test_dockerfile_installs_the_package_with_pyproject_pins():
    text = (ROOT / "Dockerfile").read_text()
    install = re.search(r"pip install [^\n]*", text).group(0)
    # The package itself (pins from pyproject), not a second hand-written list of versions.
    assert '-e ".[test]"' in install
    assert re.findall(r"[\w-]+==[\w.${}]+", install) == ['torch==${TORCH_VERSION}']
    for needed in ("mxfp8_ep", "launch", "conf", "recipes", "assets"):
        assert re.search(rf"^COPY {needed} ", text, flags=re.M), needed
