# mxfp8-ep GPU image: torch 2.11.0 + CUDA 13.0 (the stack the 2xH200 results were measured on),
# the package and its tested pins from pyproject.toml, configs and recipes (the tiny assets are package data of launch).
#
#   docker build -t mxfp8-ep:0.1.0 .
#   # pyxis/enroot on SLURM: turn the image into a squashfs file once, on a login node
#   enroot import -o /shared/images/mxfp8-ep.sqsh dockerd://mxfp8-ep:0.1.0
#   python launch/train.py launcher=slurm launcher.container_image=/shared/images/mxfp8-ep.sqsh \
#       launcher.container_mounts=/shared/data:/shared/data ...
#
# BASE_IMAGE follows PyTorch's official tag scheme <torch>-cuda<X.Y>-cudnn9-runtime; change
# TORCH_VERSION with it (a test checks both stay inside pyproject's torch range).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.11.0

WORKDIR /opt/mxfp8-ep
COPY pyproject.toml README.md ./
COPY mxfp8_ep ./mxfp8_ep
COPY launch ./launch
COPY conf ./conf
COPY recipes ./recipes
COPY scripts ./scripts
COPY benchmarks ./benchmarks

# Keep the image's CUDA build of torch (pinning it stops pip from swapping it), then install
# the package with exactly the pins in pyproject.toml.
RUN python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${TORCH_VERSION}')" \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" -e ".[test]"

ENV PYTHONUNBUFFERED=1
CMD ["python", "launch/train.py", "--help"]
