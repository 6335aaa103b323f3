# gradwatch collector image: the daemon only (no torch), run as a non-root user.
#
#   docker build -t gradwatch-collector .
#   docker run -p 5555:5555 -p 9400:9400 gradwatch-collector
#
# Settings: /etc/gradwatch/collector.yaml binds 0.0.0.0 inside the container;
# GRADWATCH_* environment variables beat that file, and flags after the image
# name beat both (e.g. `--webhook URL --per-layer-metrics`). The default rule
# pack ships inside the installed package; mount a file and pass --rules to
# replace it.
#
# The base image is pinned by digest, so a rebuild starts from the same bytes: the
# multi-arch index of python:3.11-slim (Python 3.11.16 on Debian trixie, pushed
# 2026-08-16, official-images commit fe89472b), as recorded by public projects
# that pin it. To move it: `docker pull python:3.11-slim`, copy the Digest: it
# prints, rebuild and rerun tests/deploy and tests/packaging.
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY gradwatch/ gradwatch/
COPY wire/ wire/
COPY agent/ agent/
COPY rules/ rules/
COPY collector/ collector/
# setuptools needs every package folder of pyproject.toml to build, even those
# the collector never imports (tests/deploy checks this list against pyproject).
COPY preflight/ preflight/
COPY report/ report/
COPY integrations/ integrations/

# The collector extra only, every dependency at the version constraints.txt pins
# (the versions the tests ran with); the build fails if anything pulled torch in.
# DL3013: this installs the project itself; its dependencies are pinned by constraints.txt.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c constraints.txt ".[collector]" \
    && if pip show torch >/dev/null 2>&1; then echo "torch must not be in the collector image" >&2; exit 1; fi \
    && rm -rf /src \
    && groupadd --system --gid 10001 gradwatch \
    && useradd --system --uid 10001 --gid gradwatch --no-create-home \
        --home-dir /var/lib/gradwatch --shell /usr/sbin/nologin gradwatch \
    && mkdir -p /etc/gradwatch /var/lib/gradwatch \
    && printf 'listen: tcp://0.0.0.0:5555\nmetrics_addr: 0.0.0.0:9400\n' > /etc/gradwatch/collector.yaml \
    && chown gradwatch:gradwatch /var/lib/gradwatch

WORKDIR /var/lib/gradwatch
USER 10001:10001

# 5555: ZeroMQ ingest from agents; 9400: /metrics, /healthz, /readyz.
EXPOSE 5555 9400

# Readiness, not liveness: the collector answers /readyz 200 once it ingests.
# The stdlib only (slim has no curl); the port follows GRADWATCH_METRICS_ADDR.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('GRADWATCH_METRICS_ADDR', ':9400').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=4)"]

ENTRYPOINT ["gradwatch", "collector"]
CMD ["--config", "/etc/gradwatch/collector.yaml"]
