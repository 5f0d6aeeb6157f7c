"""The Dockerfile agrees with pyproject and keeps the runtime image free of test dependencies;
the test image carries what its suite reads. scripts/container_test.sh builds and runs both
(root, buildah); here, its refusals before anything starts and its answer to --tested."""

import hashlib
import re
import shutil
import subprocess
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
    assert '".[test,titan022]"' in test and "COPY . ./" in test
    assert 'CMD ["python", "-m", "pytest", "tests"]' in test
    assert re.search(r'^ENV MXFP8EP_SKIP_SLURM="[^"]+"$', test, flags=re.M)  # the reason the SLURM tests give
    # the commit that benchmark rows record without .git (benchmarks/rows.py), required
    assert "ARG MXFP8EP_COMMIT\n" in test and "ENV MXFP8EP_COMMIT=${MXFP8EP_COMMIT}" in test
    assert 'test -n "${MXFP8EP_COMMIT}" ||' in test
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv*", "outputs", "multirun", "wandb"} <= set(ignored)


def container_test(tmp_path: Path, uid: int, **env: str) -> subprocess.CompletedProcess:
    """scripts/container_test.sh where ``id -u`` says ``uid``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (bin_dir / "id").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "container_test.sh")], capture_output=True, text=True,
                          env=env, timeout=60)


def test_container_test_refuses_before_building(tmp_path):
    proc = container_test(tmp_path, 1000)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "container_test.sh: needs root (debootstrap, buildah --isolation chroot)\n"
    proc = container_test(tmp_path, 0, GIT_DIR=str(tmp_path / "no-git"))  # a tree that is no git checkout
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"container_test.sh: {ROOT} is not a git checkout: set MXFP8EP_COMMIT to the commit it "
                           f"was copied from\n")
    work = tmp_path / "work"
    (work / "storage-overlay").mkdir(parents=True)  # a stopped run's leftovers
    proc = container_test(tmp_path, 0, CONTAINER_TEST_DIR=str(work), MXFP8EP_COMMIT="0" * 40)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"container_test.sh: {work} exists (another run, or a stopped one's leftovers: "
                           f"remove it first)\n")
    assert list(work.iterdir()) == [work / "storage-overlay"]  # untouched


def test_tested_says_whether_the_inputs_are_those_of_the_last_pass(tmp_path):
    """``--tested`` (what .ci/run asks) against .ci/container_tested, in a copy of the inputs."""
    inputs = ["Dockerfile", ".dockerignore", "pyproject.toml", "scripts/install.sh", "scripts/torch_index.sh",
              "scripts/container_test.sh"]
    tree = tmp_path / "tree"
    for path in inputs:
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tree / path)

    def tested() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(tree / "scripts/container_test.sh"), "--tested"], capture_output=True,
                              text=True, timeout=60)

    proc = tested()  # never passed here
    assert proc.returncode == 1 and proc.stdout.endswith(" changed since the last pass (.ci/container_tested)\n")
    listing = "".join(f"{hashlib.sha256((tree / p).read_bytes()).hexdigest()}  {p}\n" for p in inputs)
    (tree / ".ci").mkdir()
    (tree / ".ci/container_tested").write_text(f"# a pass\n{hashlib.sha256(listing.encode()).hexdigest()}\n")
    proc = tested()
    assert proc.returncode == 0 and proc.stdout == (f"container_test.sh: {' '.join(inputs)} are as the last pass "
                                                    f"built them (.ci/container_tested)\n")
    (tree / "pyproject.toml").write_text((tree / "pyproject.toml").read_text() + "\n")
    assert tested().returncode == 1
