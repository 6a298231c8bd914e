"""The batch job parses a line's body as the server parses a request body: a non-finite
number, an integer too long to convert or a lone surrogate gets the server's 400, and such a
line costs that line only, never the job."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from keyserve.cluster.batch_job import run_batch
from keyserve.cluster.json_body import check_json, parse_json_sync
from keyserve.cluster.errors import APIError
from keyserve.cluster.openai_serving import OpenAIServing
from keyserve.config import ServeConfig

BODIES = {
    "nan": '{"prompt": "x", "max_tokens": 3, "temperature": NaN}',
    "inf": '{"prompt": "x", "max_tokens": 3, "top_p": Infinity}',
    "e400": '{"prompt": "x", "max_tokens": 3, "temperature": 1e400}',
    "bigint": '{"prompt": "x", "max_tokens": 1' + "0" * 5000 + "}",
    "surr": '{"prompt": ["ok", "a\\udc00"], "max_tokens": 3}',
    "surrchat": '{"messages": [{"role": "user", "content": "\\ud800"}]}',
}


def server_error(raw: str) -> dict:
    """The envelope the HTTP server sends for this body (it fails in parse_json)."""
    with pytest.raises(APIError) as e:
        check_json(parse_json_sync(raw.encode()))
    return e.value.body()


def test_batch_bodies_fail_as_on_the_server(stories_path: str, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = []
    for cid, body in BODIES.items():
        url = "/v1/chat/completions" if "chat" in cid else "/v1/completions"
        lines.append('{"custom_id": "%s", "method": "POST", "url": "%s", "body": %s}' % (cid, url, body))
    lines.append(json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "Once", "max_tokens": 2, "temperature": 0}}))
    lines.append(json.dumps({"custom_id": "echo", "method": "POST", "url": "/v1/completions",  # lm-eval's scoring
                             "body": {"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0, "echo": True,
                                      "logprobs": 1}}))
    src.write_text("\n".join(lines) + "\n")
    config = ServeConfig(model=stories_path, max_num_seqs=2, max_queued_requests=4)
    serving = OpenAIServing.from_config(config, in_process=True)

    async def go():
        await serving.engine.wait_ready()
        return await run_batch(serving, src, out, 4, progress=False)

    try:
        summary = asyncio.run(go())
    finally:
        serving.engine.shutdown()
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert summary.succeeded == 2 and summary.failed == len(BODIES)
    assert recs["ok"]["response"]["status_code"] == 200
    scored = recs["echo"]["response"]["body"]["choices"][0]["logprobs"]
    assert scored["token_logprobs"][0] is None and all(v < 0 for v in scored["token_logprobs"][1:])
    assert len(scored["tokens"]) == recs["echo"]["response"]["body"]["usage"]["prompt_tokens"] + 1
    for cid, body in BODIES.items():
        assert recs[cid]["error"] is None, cid
        assert recs[cid]["response"]["status_code"] == 400, cid
        assert recs[cid]["response"]["body"] == server_error(body), cid
