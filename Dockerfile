# syntax=docker/dockerfile:1
# The kv-sidecar image: `kv-sidecar serve`, run beside vLLM in the same pod (see deploy/README.md).
#
#   docker build -t kv-sidecar:0.1.0 .
#
# Dependencies come only from requirements.lock: every version pinned, every file hashed, wheels
# only (no compiler in either stage). The lock includes the `otlp` extra (the OTLP/HTTP span
# exporter), so OTEL_EXPORTER_OTLP_* turns traces on in the image, and not the `transformers` extra
# (tokenizer.json is read by `tokenizers`, the chat template rendered with jinja2; a tokenizer
# without a tokenizer.json is counted by vLLM's /tokenize). Regenerate the lock as
# deploy/README.md says when pyproject.toml's dependencies change; tests/test_deploy.py fails when
# one is missing from it.

ARG PYTHON_IMAGE=python:3.11-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
COPY requirements.lock /tmp/requirements.lock
# --require-hashes also makes pip refuse any dependency the lock does not pin.
RUN /opt/venv/bin/pip install --no-cache-dir --require-hashes --only-binary=:all: \
        -r /tmp/requirements.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
# The build backend (setuptools, wheel) is already in the venv from the lock: build without
# fetching anything, then drop the backend, which is not needed at run time.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation --no-index . \
    && /opt/venv/bin/pip uninstall --yes setuptools wheel \
    && /opt/venv/bin/kv-sidecar --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kv-sidecar" \
      org.opencontainers.image.description="KV-cache admission controller and Prometheus exporter that runs beside vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
# Bytecode was compiled at install time; the root filesystem is read-only in the pod, so nothing
# may try to write .pyc files or caches outside /tmp (an emptyDir there). The sidecar reads
# tokenizers only from mounted directories: the Hugging Face hub is never contacted.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1
COPY --from=build /opt/venv /opt/venv
# A fixed numeric UID/GID so that runAsNonRoot can verify it without an /etc/passwd lookup.
USER 65532:65532
# 8080: the proxy clients talk to; 9091: the sidecar's /metrics, /healthz and /readyz.
EXPOSE 8080 9091
# Used by Docker and Compose only (Kubernetes ignores it and uses the pod's probes).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KV_SIDECAR_METRICS_PORT', '9091'), timeout=4)"]
ENTRYPOINT ["kv-sidecar", "serve"]
