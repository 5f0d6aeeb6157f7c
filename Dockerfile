# mxfp8-ep GPU image: torch 2.11.0 + CUDA 13.0 (the stack the 2xH200 results were measured on),
# the package (library + recipe) installed with its tested pins from pyproject.toml, and the
# recipe's configs. Two targets:
#
#   docker build -t mxfp8-ep:0.1.0 .                         # runtime: no test dependencies
#   docker build --target test -t mxfp8-ep:0.1.0-test \
#       --build-arg MXFP8EP_COMMIT=$(git rev-parse HEAD) .   # + tests (and the commit they record)
#   docker run --gpus all mxfp8-ep:0.1.0-test                # the suite (no SLURM or git tests)
#
#   # pyxis/enroot on SLURM: turn the image into a squashfs file once, on a login node
#   enroot import -o /shared/images/mxfp8-ep.sqsh dockerd://mxfp8-ep:0.1.0
#   python launch/train.py launcher=slurm launcher.container_image=/shared/images/mxfp8-ep.sqsh \
#       launcher.container_mounts=/shared/data:/shared/data ...
#
# BASE_IMAGE follows PyTorch's official tag scheme <torch>-cuda<X.Y>-cudnn9-runtime; change
# TORCH_VERSION with it (a test checks both stay inside pyproject's torch range). Any base with
# `python` and `pip` on PATH and that torch installed works: scripts/container_test.sh builds
# both targets on a CPU one and runs them.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
ARG TORCH_VERSION=2.11.0

FROM ${BASE_IMAGE} AS runtime
ARG TORCH_VERSION
WORKDIR /opt/mxfp8-ep
COPY pyproject.toml README.md LICENSE ./
COPY mxfp8_ep ./mxfp8_ep
COPY launch ./launch
# Keep the image's CUDA build of torch (pinning it stops pip from swapping it), then install
# the package, not editable, with exactly the pins in pyproject.toml: the torchtitan 0.2.2 stack.
RUN python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${TORCH_VERSION}')" \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" ".[titan022]" \
 && rm -rf build *.egg-info
# `python launch/train.py` reads its Hydra configs next to it.
COPY conf ./conf
COPY recipes ./recipes
ENV PYTHONUNBUFFERED=1
CMD ["python", "launch/train.py", "--help"]

FROM runtime AS test
ARG TORCH_VERSION
# The commit the image's checkout is: the benchmark rows its tests write record it, and without
# .git benchmarks/rows.py reads it from MXFP8EP_COMMIT.
ARG MXFP8EP_COMMIT
RUN test -n "${MXFP8EP_COMMIT}" || { echo "the test image needs --build-arg MXFP8EP_COMMIT=\$(git rev-parse HEAD)" >&2; exit 1; } \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" ".[test,titan022]" \
 && rm -rf build *.egg-info
ENV MXFP8EP_COMMIT=${MXFP8EP_COMMIT}
# The rest of the checkout that the tests read (tests/, scripts/, benchmarks/, docs/, this file;
# .dockerignore leaves out .git and local state). The tests of git history skip without git;
# the live SLURM tests skip, with this reason: a container starts no SLURM daemons.
COPY . ./
ENV MXFP8EP_SKIP_SLURM="the test image: the local SLURM cluster runs on a host, not in a container"
CMD ["python", "-m", "pytest", "tests"]
