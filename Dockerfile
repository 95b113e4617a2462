# llmstack for cloud GPU instances: CUDA PyTorch, DeepSpeed with its fused Adam and CPU Adam
# ops prebuilt, llmstack installed, running as a non-root user.
#
#   docker build -t llmstack .
#   docker run --gpus all --rm llmstack doctor
#   docker run --gpus all --rm --shm-size 16g -v "$PWD/runs:/workspace/runs" llmstack \
#     train --config configs/quickstart.yaml
#
# The base image must be a CUDA *devel* image: building DeepSpeed's ops needs nvcc.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel
FROM ${BASE_IMAGE}

# GPU generations the prebuilt ops are compiled for: V100, A100, A10/3090, L4/4090, H100.
ARG TORCH_CUDA_ARCH_LIST="7.0;8.0;8.6;8.9;9.0"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}

# pdsh and ssh: the deepspeed launcher's multi-node transport; ninja and libaio: building ops.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential libaio-dev ninja-build openssh-client pdsh \
    && rm -rf /var/lib/apt/lists/*

# Build the ops against the image's torch and CUDA (no build isolation, so the build sees them).
RUN DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 pip install --no-build-isolation "deepspeed==0.19.8" \
    && python -c "from deepspeed.git_version_info import installed_ops as ops; assert ops['fused_adam'] and ops['cpu_adam'], ops"

WORKDIR /opt/llmstack
COPY pyproject.toml setup.cfg README.md ./
COPY llmstack ./llmstack
RUN pip install .

# Runs, checkpoints and the JIT-op cache belong to a non-root user; match UID to the host user
# that owns mounted run directories (docker build --build-arg UID=$(id -u)).
ARG UID=1000
RUN useradd --create-home --uid "${UID}" --shell /bin/bash llmstack \
    && mkdir /workspace \
    && chown llmstack:llmstack /workspace
WORKDIR /workspace
COPY --chown=llmstack:llmstack configs ./configs
COPY --chown=llmstack:llmstack ds_configs ./ds_configs
COPY --chown=llmstack:llmstack launch ./launch
USER ${UID}

ENTRYPOINT ["llmstack"]
CMD ["--help"]
