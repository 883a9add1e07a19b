#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh machine, then runs it:
#   bash scripts/test.sh [pytest args...]
# A virtual environment in .venv with kvdepot (editable), its test extras and
# vLLM 0.33.0; Debian's systemd package for `systemd-analyze verify`.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv"
    "$PY" -m venv .venv
fi
echo "== installing kvdepot[test,vllm] (vLLM pulls torch: the first run takes minutes)"
.venv/bin/pip install --disable-pip-version-check -q -e '.[test,vllm]' 2>&1 \
    | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvdepot.server, kvdepot.client, vllm, grpc_tools" \
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

echo "== ruff"
.venv/bin/ruff check .
echo "== pytest"
exec .venv/bin/python -m pytest "$@"
