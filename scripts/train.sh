#!/usr/bin/env bash
# Installs fulcrum into a virtual environment and runs `fulcrum train` (no arguments: the built-in demo).
# Arguments are passed on as KEY=VALUE overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
# Model-written code runs in a bubblewrap jail (docs/multi-turn.md, "The jail"): install it where missing.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -q && apt-get install -y -q bubblewrap; } >/dev/null 2>&1 || echo "could not install bubblewrap"
  else
    echo "bubblewrap (bwrap) is not installed: tools that run model code will refuse to start (docs/multi-turn.md)"
  fi
fi
VENV=${FULCRUM_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# Keep a torch the user already has (a CUDA build); otherwise the CPU build these machines carry.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e .
exec "$VENV/bin/fulcrum" train "$@"
