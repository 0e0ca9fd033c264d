# syntax=docker/dockerfile:1
# kmq-tracker service image.
#
#   docker build -t kmq-tracker:0.1.0 .
#   docker run --rm -p 8080:8080 -e KMQ_KAFKA_BOOTSTRAP_SERVERS=kafka:9092 kmq-tracker:0.1.0
#
# Two stages: the builder compiles the wheel (with the optional C marker decoder) into a
# virtual environment, pinned by constraints.txt; the runtime stage copies only that
# environment onto a fresh slim base: no compiler, no build tools, no source tree.
# Settings come from KMQ_* environment variables or a TOML file (KMQ_CONFIG_FILE); see
# docs/configuration.md. SQLite's default file is /data/kmq-tracker.db (the working directory).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

# gcc and the C library headers build tracker/_speedups.c; they stay in this stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN python -m venv /opt/kmq
WORKDIR /src

# Build tools first (a layer that only changes with constraints.txt), pinned like the rest.
COPY constraints.txt ./
RUN /opt/kmq/bin/pip install -c constraints.txt setuptools wheel

COPY pyproject.toml setup.py README.md ./
COPY tracker ./tracker
COPY api ./api
COPY migrations ./migrations
# --no-build-isolation: build with the pinned setuptools/wheel above, not whatever is newest.
# The import check fails the build if the C decoder did not compile.
RUN /opt/kmq/bin/pip install --no-build-isolation -c constraints.txt . \
    && /opt/kmq/bin/python -c "import tracker._speedups" \
    && /opt/kmq/bin/pip uninstall -y setuptools wheel

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG UID=10001
RUN groupadd --system --gid "${UID}" kmq \
    && useradd --system --uid "${UID}" --gid kmq --no-create-home --home-dir /data \
        --shell /usr/sbin/nologin kmq \
    && mkdir -p /data \
    && chown kmq:kmq /data

COPY --from=builder /opt/kmq /opt/kmq

ENV PATH=/opt/kmq/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KMQ_HTTP_HOST=0.0.0.0

WORKDIR /data
VOLUME ["/data"]
USER 10001:10001
EXPOSE 8080

# Liveness of the HTTP API (no curl in the slim image; Python's urllib does). Any answer other
# than 2xx/3xx, or none within 4 s, is a failure.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KMQ_HTTP_PORT', '8080'), timeout=4)"]

ENTRYPOINT ["kmq-tracker"]
CMD ["run"]
