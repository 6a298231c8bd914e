"""The batch job in this process (stories260K): one output line per input line, errors on
their own lines, resumable after a kill that tore the last line; also as ``keyserve batch``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from keyserve.cli import main as keyserve_main
from keyserve.cluster.batch_job import main as batch_main


def completion(cid: str, prompt: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 6, "temperature": 0, **body}})


def read(path: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ids = Counter(r["custom_id"] for r in records)
    assert all(n == 1 for n in ids.values()), ids.most_common(3)
    return {r["custom_id"]: r for r in records}


@pytest.fixture
def flags(stories_path: str) -> list[str]:
    return ["--model", stories_path, "--num-blocks", "256", "--no-progress"]


def test_every_line_gets_one_result_and_errors_stay_on_their_line(tmp_path: Path, flags: list[str],
                                                                  capsys) -> None:
    lines = [completion(f"ok-{i}", f"Once upon a time {i}") for i in range(12)]
    lines += [
        "{not json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        completion("streamed", "x", stream=True),
        completion("too-long", [5] * 600),
        completion("bad-field", "x", top_p=3),
        json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]}}),
        completion("ok-0", "a repeated id"),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n\n")  # a blank line is not a request
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["total"] == len(lines) and summary["succeeded"] == 12
    records = out.read_text().splitlines()
    assert len(records) == len(lines)
    by_id: dict[str, list[dict]] = {}
    for r in map(json.loads, records):
        by_id.setdefault(r["custom_id"], []).append(r)
    [dup] = [r for r in by_id["ok-0"] if r["error"] is not None]  # written first or second
    by_id["ok-0"].remove(dup)
    assert dup["error"]["code"] == "duplicate_custom_id"
    for i in range(12):
        [r] = by_id[f"ok-{i}"]
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert body["object"] == "text_completion" and body["choices"][0]["text"]
        assert r["response"]["request_id"] == body["id"]
    assert by_id["line-13"][0]["error"]["code"] == "invalid_json"
    assert by_id["line-14"][0]["error"]["code"] == "missing_custom_id"
    assert by_id["bad-url"][0]["error"]["code"] == "invalid_url"
    for cid, param in (("streamed", "stream"), ("too-long", "prompt"), ("bad-field", "top_p"), ("chat", "messages")):
        response = by_id[cid][0]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == param, cid
    assert "600" in by_id["too-long"][0]["response"]["body"]["error"]["message"]


def test_rerun_after_a_kill_resumes(tmp_path: Path, flags: list[str]) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(completion(f"r{i}", f"The dog {i}") + "\n" for i in range(20)))
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    first = read(out)
    kept = out.read_text().splitlines()[:7]
    out.write_text("\n".join(kept) + "\n" + kept[7 - 1][: len(kept[6]) // 2])  # a torn last line
    assert keyserve_main(["batch", "--input", str(src), "--output", str(out), *flags]) == 0
    again = read(out)
    assert set(again) == set(first) == {f"r{i}" for i in range(20)}
    for line in kept[:6]:  # whole lines written before the kill are kept as they were
        r = json.loads(line)
        assert again[r["custom_id"]]["id"] == r["id"]
    for cid, r in again.items():  # greedy: the redone lines say what the first run said
        assert r["response"]["body"]["choices"] == first[cid]["response"]["body"]["choices"]
