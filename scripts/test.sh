#!/usr/bin/env bash
# Quick start 2: install what is missing, then run the whole test suite (exit non-zero on any failure).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
