"""Schema-driven fuzzing of the live server (stories260K on uvicorn in-process): request bodies
generated from the server's own OpenAPI document (``schema_strategy``), most of them then
made hostile (a field replaced by NaN, 1e400, a huge int, a numeric string, a lone surrogate,
deep nesting, an unknown field, or a required field dropped). Every answer is below 500, and
afterwards the server is healthy and idle, its engine alive and no 500 was ever counted.

Bounded: ``max_tokens`` / ``n`` are capped in the schema copy that drives generation, and each
endpoint gets a fixed, derandomised number of examples."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer, live_server
from schema_strategy import from_schema

EXAMPLES = 75  # per endpoint: 150 in all
CAPS = {"max_tokens": 2, "max_completion_tokens": 2, "n": 2, "best_of": 2}
LENGTH = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_completion_tokens"}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
HOSTILE = [
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", str(2**64), str(-(2**63) - 1), "9" * 5000,
    '"5"', '"yes"', "true", "null", "[]", "{}", '"\\ud800"', '["\\udfff"]', "-1", "0", "1.5",
    "[" * 64 + "]" * 64, "[" * 5000 + "]" * 5000, '"' + "x" * 100_000 + '"',
    "[" + ",".join(["1"] * 50_000) + "]", '{"a": "\\udc00"}', '[{"role": "user", "content": "\\ud800"}]',
]


@pytest.fixture(scope="module")
def server(stories_path: str) -> LiveServer:
    with live_server(model=stories_path, num_blocks=1024, max_num_seqs=8, max_queued_requests=64,
                     request_timeout_s=60, seed=0) as live:
        tok = live.engine.tokenizer
        tok.chat_template = TEMPLATE  # stories260K has none: let chat requests reach the engine
        yield live
        tok.chat_template = None


@pytest.fixture(scope="module")
def openapi(server: LiveServer) -> dict:
    return httpx.get(server.url + "/openapi.json", timeout=30).json()


def body_schema(openapi: dict, path: str) -> dict:
    """The request body schema of ``path``, self-contained, with generation capped."""
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    components = copy.deepcopy(openapi["components"])
    name = ref.rsplit("/", 1)[1]
    model = components["schemas"][name]
    props = model["properties"]
    for field, cap in CAPS.items():
        if field in props:
            for option in props[field].get("anyOf", [props[field]]):
                if option.get("type") == "integer":
                    option["maximum"] = cap
    # Always a small length: chat's default is the rest of the context (seconds per request).
    props[LENGTH[path]] = {"type": "integer", "minimum": 1, "maximum": CAPS[LENGTH[path]]}
    if path == "/v1/chat/completions":
        props.pop("max_tokens")  # its deprecated alias: null there would mean the whole context
    model["required"] = [*model.get("required", []), LENGTH[path]]
    return {"$ref": ref, "components": components}, {"components": components}


def hostile(draw, body: dict, keep: str, fields: list[str]) -> bytes:
    """``body`` as JSON, maybe with one field made hostile (raw text: NaN etc. are not JSON);
    ``keep`` (the length limit) is never dropped; a replaced field may be any of ``fields``."""
    text = json.dumps(body)
    how = draw(st.sampled_from(["valid", "replace", "replace", "unknown", "drop"]))
    if how == "valid" or not body:
        return text.encode()
    if how == "drop":
        field = draw(st.sampled_from(sorted(set(body) - {keep}) or [keep]))
        if field == keep:
            return text.encode()
        return json.dumps({k: v for k, v in body.items() if k != field}).encode()
    field = draw(st.sampled_from(fields)) if how == "replace" else "kv_polcy"
    rest = {k: v for k, v in body.items() if k != field}
    value = draw(st.sampled_from(HOSTILE))
    if field == keep and value == "null":
        value = "0"  # null is the default length: the whole context
    return (json.dumps(rest)[:-1] + ("," if rest else "") + f' "{field}": {value}}}').encode()


def check(server: LiveServer, path: str, content: bytes) -> None:
    with httpx.stream("POST", server.url + path, content=content, timeout=120,
                      headers={"content-type": "application/json"}) as r:
        body = r.read()
        assert r.status_code < 500, (r.status_code, body[:500], content[:300])
        if r.status_code >= 400:
            assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
        elif b"data: " in body[:6]:
            assert body.rstrip().endswith(b"data: [DONE]")
            assert b'"error"' not in body, body[-500:]


def fuzz(server: LiveServer, openapi: dict, path: str) -> None:
    schema, root = body_schema(openapi, path)
    fields = sorted(root["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]["properties"])

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data) -> None:
        body = data.draw(from_schema(schema, root), label="body")
        check(server, path, hostile(data.draw, body, LENGTH[path], fields))

    run()


def after(server: LiveServer) -> None:
    server.wait_idle(timeout=120)
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    assert server.metrics().get("keyserve:request_rejected_total{500}", 0.0) == 0.0
    out = server.client().completions.create(model=server.serving.model_name, prompt="Once", max_tokens=3)
    assert out.usage.completion_tokens == 3


def test_fuzz_completions(server: LiveServer, openapi: dict) -> None:
    fuzz(server, openapi, "/v1/completions")
    after(server)


def test_fuzz_chat_completions(server: LiveServer, openapi: dict) -> None:
    fuzz(server, openapi, "/v1/chat/completions")
    after(server)
