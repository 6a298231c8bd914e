"""``keyserve serve`` as a user runs it: a subprocess on a free port (``--no-ray``: the Ray path
is the same app, tested in test_ray_serve.py), answered over HTTP, stopped with Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from keyserve.cluster.launcher import free_port


def test_bad_flags_exit_2_naming_them() -> None:
    done = subprocess.run([sys.executable, "-m", "keyserve.cli", "serve", "--tp", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tp" in done.stderr and "greater than or equal to 1" in done.stderr
    done = subprocess.run([sys.executable, "-m", "keyserve.cli", "serve", "--max-num-seqs", "many"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--max-num-seqs" in done.stderr


def test_keyserve_serve_answers_and_stops_on_ctrl_c(stories_path: str) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "keyserve.cli", "serve", "--no-ray", "--port", str(port),
                             "--model", stories_path, "--num-blocks", "128", "--api-key", "sk-cli"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.5)
        r = httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer sk-cli"},
                       json={"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 5}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert httpx.post(base + "/v1/completions", json={"prompt": "x"}, timeout=60).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(60) in (0, 1, -signal.SIGINT)
        finally:
            if proc.poll() is None:
                proc.kill()
