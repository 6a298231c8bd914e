"""Many requests through an HTTP server: keyserve's own (``keyserve serve --no-ray``) and
llama.cpp's ``llama-server``, both driven by the same asyncio client at the same concurrency.

Every request is ``POST /v1/completions`` with token ids as the prompt, greedy, ``ignore_eos``
and its own ``max_tokens``, not streamed; the useful tokens are the ``completion_tokens`` the
server reports, and a request whose count differs from what it asked for is counted as a
mismatch (every engine must do the same work).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    port: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def keyserve_server(dtype: str, threads: int, port: int, max_num_seqs: int = 64, kv_gb: float = 4.0,
                    model: str | None = None) -> Server:
    """keyserve's HTTP server without Ray (uvicorn over the in-process engine): its best
    configuration here is every request in one continuous batch (``max_num_seqs`` 64)."""
    cmd = [sys.executable, "-m", "keyserve.cli", "serve", "--no-ray", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--max-queued-requests", "1024",
           "--kv-cache-memory-gb", str(kv_gb)] + (["--model", model] if model else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))  # torch's thread count in the server
    return Server(f"keyserve {dtype}", cmd, env, port=port)


def llama_server(binary: Path, gguf: Path, threads: int, port: int, slots: int = 16, ctx_per_slot: int = 1536) -> Server:
    """llama.cpp's server: continuous batching over ``slots`` parallel slots, each with room for
    the longest request (prompt ≤ 1000 + output ≤ 256 tokens)."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot), "-cb", "--no-webui"]
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    return Server(f"llama-server {gguf.stem}", cmd, env, port=port)


def start(server: Server, log: Path, timeout_s: float = 600) -> None:
    """Start the server and wait for ``/health`` to answer 200 (model loading is not timed)."""
    f = open(log, "w")
    server.proc = subprocess.Popen(server.cmd, stdout=f, stderr=subprocess.STDOUT, env=server.env,
                                   start_new_session=True, cwd=REPO)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}; see {log}")
        try:
            if httpx.get(server.base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(server)
    raise RuntimeError(f"{server.name} did not become healthy in {timeout_s:.0f} s; see {log}")


def stop(server: Server) -> None:
    if server.proc is None or server.proc.poll() is not None:
        return
    server.proc.send_signal(signal.SIGINT)
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()


async def drive(base: str, requests: list[tuple[list[int], int]], concurrency: int, budget_s: float,
                desc: str = "requests") -> dict:
    """Send ``requests`` with at most ``concurrency`` in flight; no new request starts after
    ``budget_s``. Returns tokens done, requests done, elapsed and count mismatches."""
    from tqdm import tqdm

    queue = list(reversed(requests))
    tokens = done = mismatches = errors = 0
    last_done = 0.0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    start_t = time.perf_counter()
    bar = tqdm(total=len(requests), desc=desc, unit="req")

    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:

        async def one(prompt: list[int], n: int) -> None:
            nonlocal tokens, done, mismatches, errors, last_done
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": False}
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                errors += 1
                print(f"{desc}: HTTP {r.status_code}: {r.text[:300]}", file=sys.stderr)
                return
            got = r.json()["usage"]["completion_tokens"]
            mismatches += got != n
            tokens += got
            done += 1
            last_done = time.perf_counter() - start_t
            bar.update(1)

        async def worker() -> None:
            while queue:
                prompt, n = queue.pop()
                await one(prompt, n)

        try:  # past the budget, requests still in flight are cancelled: only finished ones count
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout=budget_s)
        except TimeoutError:
            pass
    bar.close()
    return {"tokens": tokens, "requests": done, "total_requests": len(requests), "elapsed": last_done,
            "finished": done == len(requests), "mismatches": mismatches, "errors": errors, "budget_s": budget_s}


def run_server(server: Server, requests: list[tuple[list[int], int]], concurrency: int, budget_s: float,
               log: Path) -> dict:
    """Start, warm up with one short request, run the workload, stop."""
    start(server, log)
    try:
        warm = [(requests[0][0][:32], 8)]
        asyncio.run(drive(server.base, warm, 1, 600, desc=f"{server.name} warm-up"))
        return asyncio.run(drive(server.base, requests, concurrency, budget_s, desc=server.name))
    finally:
        stop(server)
