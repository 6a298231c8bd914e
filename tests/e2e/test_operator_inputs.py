"""What an operator feeds keyserve -- flags, files, keys -- when it is wrong: exit 2 with one
line naming the mistake, before any model loads, and never a half-started server or a file
written where it should not be. Found by a sweep of hostile operator input (stop 38)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from keyserve.cli import main as keyserve_main
from keyserve.cluster import serve_cli
from keyserve.cluster.serve_app import ServeArgs


def _refused(capsys, argv: list[str], *needles: str) -> str:
    with pytest.raises(SystemExit) as stop:  # argparse's own exit 2
        keyserve_main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    return err


@pytest.mark.parametrize("port", ["0", "70000", "-1", "http"])
def test_a_port_outside_1_to_65535_is_refused(capsys, port: str) -> None:
    _refused(capsys, ["serve", "--no-ray", "--port", port], "--port")


@pytest.mark.parametrize("flags,needle", [
    (["--tp", "3"], "--tp > 1"), (["--num-replicas", "4"], "--num-replicas"),
    (["--num-cpus", "8"], "--num-cpus"), (["--address", "auto"], "--address"),
])
def test_ray_only_flags_with_no_ray_are_refused(stories_path: str, capsys, flags: list[str], needle: str) -> None:
    assert serve_cli.main(["--no-ray", "--model", stories_path, *flags]) == 2
    err = capsys.readouterr().err
    assert "--no-ray serves in this process" in err and needle in err


def test_a_port_in_use_or_an_unknown_host_fails_before_the_model_loads(stories_path: str, capsys,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def no_server(*_):
        raise AssertionError("the server started")

    monkeypatch.setattr(serve_cli, "run_uvicorn", no_server)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_cli.main(["--no-ray", "--model", stories_path, "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert serve_cli.main(["--no-ray", "--model", stories_path, "--host", "bogus.invalid"]) == 2
    assert "--host 'bogus.invalid'" in capsys.readouterr().err


def test_an_api_key_with_a_trailing_newline_is_the_key() -> None:
    """A key file's newline (or a Secret made with --from-file) is not part of the key: kept,
    it locked every client out (they send the key without it)."""
    assert ServeArgs(api_key="sk-abc\n").api_key == "sk-abc"
    with pytest.raises(ValueError, match="whitespace inside"):
        ServeArgs(api_key="sk abc")


@pytest.mark.parametrize("field", ["num_cpus", "kv_cache_memory_gb", "collective_timeout_s", "default_kv_budget"])
def test_infinite_sizes_and_timeouts_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match="finite number"):
        ServeArgs.model_validate({field: float("inf")})


def test_negative_custom_resources_are_refused() -> None:
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        ServeArgs.model_validate({"worker_resources": {"GPU_x": -1}})


@pytest.mark.parametrize("content,needle", [
    ('{"text": "no prompt here"}\n', "line 1: a JSON line needs a \"prompt\" string"),
    ('{"prompt": 5}\n', "line 1: a JSON line needs a \"prompt\" string"),
    ('Once\n{"prompt": \n', "line 2: not valid JSON"),
    ("\n\n", "holds no prompt"),
    (b"caf\xe9\n", "is not UTF-8 text"),
])
def test_a_bad_prompts_file_names_the_line(stories_path: str, tmp_path: Path, capsys, content, needle: str) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert keyserve_main(["generate", "--model", stories_path, "--prompts-file", str(path)]) == 2
    assert needle in capsys.readouterr().err


def test_a_directory_as_prompts_file_and_a_file_as_disk_path(stories_path: str, tmp_path: Path, capsys) -> None:
    assert keyserve_main(["generate", "--model", stories_path, "--prompts-file", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert keyserve_main(["generate", "--model", stories_path, "--prompt", "Once", "--prefix-store",
                          "--prefix-store-disk-path", str(a_file), "--max-tokens", "2"]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8(stories_path: str, capsys) -> None:
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert keyserve_main(["generate", "--model", stories_path, "--prompt", bad]) == 2
    assert "--prompt is not valid UTF-8" in capsys.readouterr().err


def test_a_request_that_fails_is_reported_and_exits_1(stories_path: str, capsys) -> None:
    """A prompt that outgrows a tiny pool fails alone: the plain-text report said nothing of it
    and crashed formatting its missing time to first token; --json exited 0."""
    argv = ["generate", "--model", stories_path, "--prompt", "Once", "--num-blocks", "2", "--block-size", "4",
            "--max-tokens", "40", "--ignore-eos"]
    assert keyserve_main(argv) == 1
    assert "cannot be scheduled" in capsys.readouterr().err
    assert keyserve_main([*argv, "--json"]) == 1
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "cannot be scheduled" in record["error"]


@pytest.mark.parametrize("flags,needle", [
    (["--out", ""], "--out must name a directory"), (["--layers", "0"], "--layers must be at least 1"),
    (["--threads", "-3"], "--threads must be at least 1"), (["--gen-share", "5"], "--gen-share must lie in"),
    (["--time-budget-min", "-1"], "--time-budget-min must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"), (["--init-layers", "abc"], "--init-layers must be"),
])
def test_distill_flags_are_checked_before_anything_is_written(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch,
                                                              flags: list[str], needle: str) -> None:
    """``--out ""`` used to write a .gitignore into the current directory; bad values surfaced
    only after the target's answers were generated."""
    monkeypatch.chdir(tmp_path)
    argv = ["distill-draft", "--out", str(tmp_path / "draft"), *flags]
    assert keyserve_main(argv) == 2
    assert needle in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_api_key_in_the_environment_is_named(stories_path: str, capsys, monkeypatch: pytest.MonkeyPatch,
                                                     value: str) -> None:
    """Set but blank (a Secret that came out empty) is refused, naming the variable, not a flag
    nobody passed; it never means "serve without a key"."""
    monkeypatch.setenv("KEYSERVE_API_KEY", value)
    assert serve_cli.main(["--no-ray", "--model", stories_path]) == 2
    assert "$KEYSERVE_API_KEY is set but blank" in capsys.readouterr().err


def test_an_unreachable_ray_address_fails_at_once(stories_path: str, tmp_path: Path, capsys,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.init`` retries an unreachable GCS for minutes, printing only timeouts (a batch job
    with a stale $RAY_ADDRESS looked hung): the address is tried first, and the job exits 2."""
    from keyserve.core.ray_address import check_reachable
    from keyserve.cluster.batch_job import main as batch_main

    with pytest.raises(ConnectionError, match="cannot reach the Ray cluster at garbage.invalid:1"):
        check_reachable("garbage.invalid:1")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConnectionError, match="refused"):
            check_reachable(f"127.0.0.1:{port}")
    check_reachable("auto")  # left to Ray
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "Once", "max_tokens": 2}}) + "\n")
    monkeypatch.setenv("RAY_ADDRESS", "garbage.invalid:1")
    assert batch_main(["--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--model", stories_path,
                       "--no-progress"]) == 2
    assert "cannot reach the Ray cluster at garbage.invalid:1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", "a#b", "has space"])
def test_a_deployment_name_ray_cannot_take_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="deployment_name"):
        ServeArgs(deployment_name=name)
