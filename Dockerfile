# One image for workers and producers. CPU torch by default; for CUDA/NPU hosts build FROM an image
# with the matching torch (and torch_npu) preinstalled and pass --build-arg TORCH_SPEC="".
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
# e.g. --build-arg PIP_ARGS="--index-url <your CPU wheel index>" to get the small CPU-only torch build
ARG PIP_ARGS=""
ENV PYTHONUNBUFFERED=1 BATCHFLEET_CACHE_DIR=/cache
WORKDIR /app
# gcc: the native engine compiles its CPU paged-attention kernel at first use (falls back without it)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_SPEC" ]; then pip install --no-cache-dir "$TORCH_SPEC" $PIP_ARGS; fi
COPY pyproject.toml README.md ./
COPY common ./common
COPY producer ./producer
COPY worker ./worker
COPY gateway ./gateway
# the worker's stack and the gateway's: a plain `pip install .` is the client only (no torch)
RUN pip install --no-cache-dir ".[worker,serve]"
VOLUME ["/cache", "/models"]
ENTRYPOINT ["batchfleet"]
CMD ["worker"]
