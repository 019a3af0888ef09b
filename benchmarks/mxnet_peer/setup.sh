#!/usr/bin/env bash
# Install MXNet 1.9.1, the peer that benchmarks/kvstore.py measures hora's
# parameter server against, into its own virtual environment OUTSIDE the repo.
#
#   bash benchmarks/mxnet_peer/setup.sh            # venv in ~/.cache/hora/mxnet-venv
#   HORA_MXNET_VENV=/tmp/mx bash benchmarks/mxnet_peer/setup.sh
#   bash benchmarks/mxnet_peer/setup.sh /tmp/mx     # same, as an argument
#
# Idempotent: a venv that already imports mxnet 1.9.1 is left as it is, and the
# script only prints its python.  MXNet 1.9.1 is the last release; its wheel is
# tagged py3-none, but it uses numpy aliases (np.bool, ...) that numpy 1.24
# removed, so it needs 'numpy<1.24', whose newest wheels are for CPython 3.11.
# The script therefore picks python3.11 (or 3.10, 3.9, 3.8), never a newer one.
# The last line printed is the venv's python, for scripts to capture.
set -euo pipefail

VENV="${1:-${HORA_MXNET_VENV:-$HOME/.cache/hora/mxnet-venv}}"
MXNET_VERSION="1.9.1"

find_python() {
    if [[ -n "${HORA_MXNET_PYTHON:-}" ]]; then
        echo "$HORA_MXNET_PYTHON"
        return 0
    fi
    local v
    for v in 3.11 3.10 3.9 3.8; do
        if command -v "python$v" >/dev/null 2>&1; then
            command -v "python$v"
            return 0
        fi
    done
    return 1
}

check_venv() {
    [[ -x "$VENV/bin/python" ]] &&
        "$VENV/bin/python" -c "import mxnet, sys; sys.exit(mxnet.__version__ != '$MXNET_VERSION')" >/dev/null 2>&1
}

if check_venv; then
    echo "mxnet $MXNET_VERSION already installed in $VENV" >&2
    echo "$VENV/bin/python"
    exit 0
fi

if ! PY="$(find_python)"; then
    echo "error: MXNet $MXNET_VERSION needs numpy<1.24, which has wheels only up to CPython 3.11," >&2
    echo "       and no python3.11/3.10/3.9/3.8 is on PATH. Install one (e.g. apt-get install python3.11-venv)" >&2
    echo "       or point HORA_MXNET_PYTHON at it." >&2
    exit 2
fi

echo "creating $VENV with $PY ($("$PY" --version 2>&1))" >&2
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip >&2 || true
# MXNet's wheel imports 'requests' and 'graphviz' lazily; the pins are the ones
# its setup.py asks for.  numpy 1.23.5 is the last release with np.bool.
"$VENV/bin/python" -m pip install --quiet "mxnet==$MXNET_VERSION" "numpy<1.24" >&2

if ! check_venv; then
    echo "error: $VENV/bin/python cannot import mxnet $MXNET_VERSION after the install; see pip's output above" >&2
    exit 1
fi
echo "mxnet $MXNET_VERSION installed in $VENV" >&2
echo "$VENV/bin/python"
