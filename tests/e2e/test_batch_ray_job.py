"""The batch job submitted to a real Ray cluster: ``ray start --head`` (token auth, as Ray 2.60
turns it on) + ``RAY_AUTH_MODE=token ray job submit -- python -m keyserve.cluster.batch_job``
on 50 lines; then half the output is deleted and the job rerun: every id appears exactly once.

The head runs with ``--block`` in its own session, on free ports and its own temp dir, so it
neither collides with nor is found by (``ray.init()``) any other Ray on the machine; SIGTERM
to that one process stops every process it started.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from keyserve.cluster.launcher import free_port

RAY = str(Path(sys.executable).with_name("ray"))
pytestmark = pytest.mark.skipif(not Path(RAY).exists(), reason="the ray CLI is not installed")


# A token of this test's own: on a fresh machine there is no ~/.ray/auth_token, and with
# RAY_AUTH_MODE=token `ray start` refuses to start without one (it creates none itself).
AUTH_TOKEN = secrets.token_hex(32)


def ray_env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": AUTH_TOKEN, "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def dashboard() -> str:
    temp = tempfile.mkdtemp(prefix="ksray-", dir="/tmp")  # short: Ray puts unix sockets here
    dash = free_port()
    cmd = [RAY, "start", "--head", "--block", f"--port={free_port()}", "--num-cpus=2",
           "--object-store-memory=200000000", f"--temp-dir={temp}", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
           f"--ray-client-server-port={free_port()}", f"--metrics-export-port={free_port()}",
           "--disable-usage-stats"]
    log = open(Path(temp) / "ray-start.log", "w")
    head = subprocess.Popen(cmd, env=ray_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 240
        while subprocess.run([RAY, "job", "list", "--address", address], env=ray_env(),
                             capture_output=True).returncode != 0:
            assert head.poll() is None, (Path(temp) / "ray-start.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not come up"
            time.sleep(2)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(90)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # anything of that session still left
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def submit(address: str, src: Path, out: Path, model: str) -> str:
    entry = (f"{sys.executable} -m keyserve.cluster.batch_job --input {src} --output {out} "
             f"--model {model} --num-blocks 256 --max-num-seqs 16")
    done = subprocess.run([RAY, "job", "submit", "--address", address, "--", *entry.split()],
                          env=ray_env(), capture_output=True, text=True, timeout=420)
    logs = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in logs, logs[-4000:]
    return logs


def ids(path: Path) -> Counter:
    return Counter(json.loads(line)["custom_id"] for line in path.read_text().splitlines())


def test_ray_job_submit_batch_then_resume(dashboard: str, stories_path: str, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"custom_id": f"req-{i:02d}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"Once upon a time {i}", "max_tokens": 8, "seed": i}})
             for i in range(48)]
    lines.append(json.dumps({"custom_id": "req-48", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"messages": [{"role": "user", "content": "hi"}]}}))  # no template: 400
    lines.append("{broken")  # reported as line-50
    src.write_text("\n".join(lines) + "\n")
    expected = {f"req-{i:02d}" for i in range(49)} | {"line-50"}

    logs = submit(dashboard, src, out, stories_path)
    assert '"total": 50' in logs and '"succeeded": 48' in logs
    assert set(ids(out)) == expected and all(n == 1 for n in ids(out).values())

    kept = out.read_text().splitlines()[::2]  # delete half of the output lines
    out.write_text("\n".join(kept) + "\n")
    logs = submit(dashboard, src, out, stories_path)
    assert '"skipped": 25' in logs
    counts = ids(out)
    assert set(counts) == expected and all(n == 1 for n in counts.values()), counts.most_common(3)
    records = {json.loads(line)["custom_id"]: json.loads(line) for line in out.read_text().splitlines()}
    assert sum(r["response"] is not None and r["response"]["status_code"] == 200 for r in records.values()) == 48
    assert records["req-48"]["response"]["status_code"] == 400
    assert records["line-50"]["error"]["code"] == "invalid_json"
