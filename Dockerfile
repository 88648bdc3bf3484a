# phalanx in a container, for the Kubernetes and Slurm examples (examples/k8s, examples/slurm).
#
#   make image                                      # CPU torch: phalanx:<version>
#   make image TORCH_INDEX=https://download.pytorch.org/whl/cu128   # CUDA torch (needs the NVIDIA runtime)
#
# The repository lands at /workspace (the working directory), so `phalanx train examples/shakespeare.yaml`
# works as in a checkout; data and run folders belong on mounted volumes, not in the image.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# torch comes from this index, at this version: the CPU or one CUDA build (the PyPI default would pull
# a CUDA build whatever the target). TORCH_SPEC follows TORCH_SPEC in the Makefile.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0
# Optional extras, comma-separated: e.g. --build-arg EXTRAS=tensorboard,wandb
ARG EXTRAS=

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /workspace

# A C/C++ compiler: train.compile needs one (inductor writes C++ on CPU; Triton builds its launcher in C
# on CUDA), and the slim image has none.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: code changes rebuild only the layers below.
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

COPY . .
# torch is already satisfied, so this installs phalanx and the other dependencies only.
RUN pip install ".${EXTRAS:+[${EXTRAS}]}" \
    && phalanx --help > /dev/null

ENTRYPOINT ["phalanx"]
CMD ["--help"]
