# The kvdepot daemon image: `kvdepot serve` as uid/gid 10001, health through the daemon's
# grpc.health.v1 service (`kvdepot status --probe`). Build from the repository root:
#
#   podman build --format docker -f deploy/docker/kvdepot.Dockerfile -t localhost/kvdepot:0.1.0 .
#
# (Docker: `docker build` without `--format docker`.) BASE is any Debian-like image with python3
# (3.11 or newer, with the venv module) and useradd; both stages must use the same one,
# since the virtual environment is copied from the first to the second.
ARG BASE=docker.io/library/python:3.11-slim-bookworm

FROM ${BASE} AS build
# A C compiler for the run copier and the planner's loops (server/memory/_runcopy.c,
# server/core/_plan.c); only this stage has it. Without one the install goes on and the
# daemon plans and copies with numpy, slower.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The repository, less what .dockerignore keeps out (virtual environments, tests, .git).
COPY . .
RUN python3 -m venv /opt/kvdepot \
    && /opt/kvdepot/bin/pip install --no-cache-dir --disable-pip-version-check '.[server,remote]'

FROM ${BASE}
# The uid and gid the manifests run as (deploy/k8s); the group owns the socket.
RUN groupadd --system --gid 10001 kvdepot \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvdepot \
    && mkdir -p /run/kvdepot \
    && chown 10001:10001 /run/kvdepot \
    && chmod 0750 /run/kvdepot
COPY --from=build /opt/kvdepot /opt/kvdepot
ENV PATH=/opt/kvdepot/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    KVDEPOT_SOCKET=/run/kvdepot/kvdepot.sock
USER 10001:10001
WORKDIR /nonexistent
# SERVING once the socket accepts (the pool warms in the background); NOT_SERVING from
# the start of a shutdown. The start period covers a cold start on a GPU host.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["kvdepot", "status", "--probe", "--timeout", "3"]
ENTRYPOINT ["kvdepot"]
CMD ["serve"]
