#!/usr/bin/env bash
# Installs fulcrum into a virtual environment and runs `fulcrum train` (no arguments: the built-in demo).
# Arguments are passed on as KEY=VALUE overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FULCRUM_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# Keep a torch the user already has (a CUDA build); otherwise the CPU build these machines carry.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e .
exec "$VENV/bin/fulcrum" train "$@"
