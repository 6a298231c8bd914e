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
        "{not json",  # line 13
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),  # 14
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        completion("streamed", "x", stream=True),
        completion("too-long", [5] * 600),
        completion("bad-field", "x", top_p=3),
        json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]}}),
        completion("ok-0", "a repeated id"),  # line 20
        completion("line-13", "an id that is also the key of line 13's report"),  # 21
        completion("surrogate", "\ud800 alone"),  # 22: a lone surrogate, JSON-escaped
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data = ("\n".join(lines) + "\n\n").encode()  # a blank line is not a request
    latin1 = json.dumps(json.loads(completion("latin-1", "caf\u00e9")), ensure_ascii=False).encode("latin-1")
    src.write_bytes(data + latin1 + b"\n")  # line 24: not UTF-8
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["total"] == len(lines) + 1 and summary["succeeded"] == 13 and summary["unfinished"] == 0
    by_id = read(out)  # one record per key
    assert len(by_id) == len(lines) + 1
    for i in range(12):
        r = by_id[f"ok-{i}"]
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert body["object"] == "text_completion" and body["choices"][0]["text"]
        assert r["response"]["request_id"] == body["id"]
    # The repeat of ok-0 is reported under its own key; ok-0 itself ran (above).
    dup = by_id["ok-0#line-20"]
    assert dup["response"] is None and dup["error"]["code"] == "duplicate_custom_id"
    assert "line 1" in dup["error"]["message"]
    # Line 13 has no id and its natural key "line-13" is line 21's custom_id: it gets "#2".
    assert by_id["line-13#2"]["error"]["code"] == "invalid_json"
    assert by_id["line-13"]["response"]["status_code"] == 200
    assert by_id["line-14"]["error"]["code"] == "missing_custom_id"
    assert by_id["bad-url"]["error"]["code"] == "invalid_url"
    assert by_id["latin-1"]["error"]["code"] == "invalid_utf8"  # its custom_id is readable
    for cid, param in (("streamed", "stream"), ("too-long", "prompt"), ("bad-field", "top_p"),
                       ("chat", "messages"), ("surrogate", "prompt")):
        response = by_id[cid]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == param, cid
    assert "600" in by_id["too-long"]["response"]["body"]["error"]["message"]


def test_a_duplicate_never_shadows_the_line_it_repeats(tmp_path: Path, flags: list[str]) -> None:
    """A crash after the duplicate's report was written but before the original's: the rerun
    still runs the original. Also for an output of an older version, which wrote the
    duplicate's report under the original's id."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(completion("d", "The cat") + "\n" + completion("e", "The dog") + "\n"
                   + completion("d", "The cat, again") + "\n")
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    first = read(out)
    assert set(first) == {"d", "e", "d#line-3"}

    out.write_text(json.dumps(first["e"]) + "\n" + json.dumps(first["d#line-3"]) + "\n")  # "d" lost
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    again = read(out)
    assert set(again) == {"d", "e", "d#line-3"}
    assert again["d"]["response"]["body"]["choices"] == first["d"]["response"]["body"]["choices"]
    assert again["e"]["id"] == first["e"]["id"] and again["d#line-3"]["id"] == first["d#line-3"]["id"]

    legacy = {**first["d#line-3"], "custom_id": "d"}  # the old format: the error under "d"
    out.write_text(json.dumps(first["e"]) + "\n" + json.dumps(legacy) + "\n")
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ran = [r for r in records if r["custom_id"] == "d" and r["error"] is None]
    assert len(ran) == 1 and ran[0]["response"]["body"]["choices"] == first["d"]["response"]["body"]["choices"]
    assert [r["custom_id"] for r in records].count("d#line-3") == 1


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


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path, flags: list[str]) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(completion(f"w{i}", f"The sun {i}") + "\n" for i in range(4)))
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    first = read(out)
    kept = out.read_text().splitlines()[:2]
    out.write_text(kept[0] + "\n" + kept[1])  # whole, but no newline: e.g. written by hand
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    again = read(out)
    assert set(again) == set(first)
    assert again[json.loads(kept[1])["custom_id"]]["id"] == json.loads(kept[1])["id"]  # not redone


def test_a_second_job_on_the_same_output_is_refused(tmp_path: Path, flags: list[str], capsys) -> None:
    import fcntl

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(completion("a", "x") + "\n")
    with open(out, "a") as held:  # another job holds the output
        fcntl.flock(held, fcntl.LOCK_EX)
        assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 2
    assert "another batch job is writing" in capsys.readouterr().err
    assert out.read_text() == ""
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0  # released
    assert set(read(out)) == {"a"}


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path: Path, flags: list[str]) -> None:
    """Windows editors start UTF-8 files with a BOM: the first line still runs under its id."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + (completion("bom", "Once") + "\n" + completion("two", "Tim") + "\n").encode())
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    by_id = read(out)
    assert set(by_id) == {"bom", "two"} and by_id["bom"]["response"]["status_code"] == 200


@pytest.mark.parametrize("case", ["output is input", "output links to input", "input is a directory",
                                  "output is a directory", "missing input"])
def test_bad_paths_exit_2_before_the_model_loads(tmp_path: Path, flags: list[str], capsys,
                                                 monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """A path mistake is exit 2 with one line saying what is wrong, and the input is untouched
    (an output equal to the input used to count every input line as done, exit 0, and could
    cut the input's unterminated last line)."""
    import keyserve.cluster.batch_job as batch_job

    src = tmp_path / "in.jsonl"
    content = completion("a", "Once") + "\n" + "{not json"  # an unterminated last line
    src.write_text(content)
    out = tmp_path / "out.jsonl"
    if case == "output is input":
        out = src
    elif case == "output links to input":
        out.symlink_to(src)
    elif case == "input is a directory":
        src = tmp_path / "adir"
        src.mkdir()
    elif case == "output is a directory":
        out.mkdir()
    else:
        src = tmp_path / "nope.jsonl"

    def no_model(*_):
        raise AssertionError("the model loaded before the paths were checked")

    monkeypatch.setattr(batch_job, "serve_config", no_model)
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batch: ") and "Traceback" not in err
    if case in ("output is input", "output links to input"):
        assert "is the input file" in err and (tmp_path / "in.jsonl").read_text() == content


def test_an_input_line_is_not_taken_for_a_record(tmp_path: Path, flags: list[str]) -> None:
    """Resuming reads the output's records; a line with a custom_id but no response/error (an
    input line appended there by mistake) is not one, so its request still runs."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(completion("a", "Once") + "\n")
    out.write_text(completion("a", "Once") + "\n")
    assert batch_main(["--input", str(src), "--output", str(out), *flags]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("response", {}).get("status_code") for r in records if "response" in r] == [200]


def test_an_infinite_backoff_is_refused(tmp_path: Path, flags: list[str], capsys) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(completion("a", "Once") + "\n")
    assert batch_main(["--input", str(src), "--output", str(out), "--retry-backoff-s", "inf", *flags]) == 2
    assert "finite" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "nan", "-5"])
def test_a_timeout_that_is_not_a_positive_number_names_the_flag(tmp_path: Path, capsys, value: str) -> None:
    with pytest.raises(SystemExit) as stop:
        batch_main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"), "--timeout-s", value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "keyserve batch: error: argument --timeout-s: must be a positive number of seconds" in err
