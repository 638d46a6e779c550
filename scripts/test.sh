#!/usr/bin/env bash
# Installs fulcrum with its test tools into a virtual environment and runs the test suite.
# torch==2.13.0 first: on these machines pip takes a CPU build from local disk, so no CUDA build is pulled.
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
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e ".[dev]"
"$VENV/bin/ruff" check --quiet .
# Two pytest-xdist workers: CI has two cores, and most tests wait on one (compilers, subprocesses, Python);
# `-n 0` after it runs the suite in one process.
exec "$VENV/bin/python" -m pytest -q -n 2 "$@"
