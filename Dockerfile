# One image for workers, producers and the gateway.
# Default: the CPU-only torch wheel (~200 MB, not PyPI's ~2.5 GB CUDA build).
# GPU:  docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
# NPU / custom: build FROM an image with the matching torch (and torch_npu) preinstalled and pass
#       --build-arg TORCH_SPEC="" (keeps the preinstalled torch).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
# BATCHFLEET_CACHE_DIR: presets (models/) and the compiled CPU kernel (kernels/) live in the /cache volume,
# so a restarted or scaled-out worker reuses both instead of rebuilding them.
ENV PYTHONUNBUFFERED=1 BATCHFLEET_CACHE_DIR=/cache
WORKDIR /app
# gcc: the native engine compiles its CPU paged-attention kernel at first use (falls back without it)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_SPEC" ]; then pip install --no-cache-dir "$TORCH_SPEC" --index-url "$TORCH_INDEX"; fi
COPY pyproject.toml README.md ./
COPY common ./common
COPY producer ./producer
COPY worker ./worker
COPY gateway ./gateway
# the worker's stack and the gateway's: a plain `pip install .` is the client only (no torch);
# torch is already satisfied (2.13.0+cpu matches the ==2.13.0 pin), so this never pulls the CUDA wheel
RUN pip install --no-cache-dir ".[worker,serve]"
# not root (Kubernetes' restricted Pod Security; deploy/k8s runs it as this uid): a numeric USER, so
# runAsNonRoot can check it. /cache, /models and /files (the gateway's files API) are this user's: a fresh named
# volume mounted there takes that owner (compose); on Kubernetes fsGroup does
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/batchfleet batchfleet \
    && mkdir -p /cache /models /files && chown 10001:10001 /cache /models /files
USER 10001
VOLUME ["/cache", "/models"]
ENTRYPOINT ["batchfleet"]
CMD ["worker"]
