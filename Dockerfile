# Qwen3-VL vision encoder service for NVIDIA Hopper (H100/H200) and Ampere GPUs.
#
# The base image brings CUDA, PyTorch and Triton; its torch and triton satisfy pyproject.toml's ranges,
# so the install step below adds only this project and its other dependencies, all wheels (PyAV's bundles
# the FFmpeg libraries it decodes videos with, so no system packages are needed). That step is the
# README's deployment install (`pip install .`), which CI also runs.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    QWEN3VL_HOST=0.0.0.0 \
    QWEN3VL_PORT=8000 \
    QWEN3VL_MODEL=/models/qwen3-vl \
    QWEN3VL_DEVICE=cuda \
    QWEN3VL_WARMUP=true \
    QWEN3VL_CACHE_DIR=/cache \
    HF_HUB_OFFLINE=1

WORKDIR /opt/qwen3vl-encoder
COPY pyproject.toml README.md ./
COPY service ./service
COPY kernels ./kernels
RUN pip install .

RUN useradd --create-home --uid 10001 encoder && mkdir /cache && chown encoder /cache
USER encoder

# Mount a Hugging Face Qwen3-VL checkpoint directory here (read-only is fine).
VOLUME /models
# Compiled kernels and the kernel tuner's choices: a volume here makes every start after the first skip both.
VOLUME /cache
EXPOSE 8000

# /health answers as soon as the process is up; /ready turns true after model load and kernel warm-up.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"

# Model load and kernel warm-up happen at start-up, before /ready turns true.
CMD ["qwen3vl-encoder", "serve"]
