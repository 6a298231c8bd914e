"""Start a server: Ray Serve (``keyserve serve``) or plain uvicorn (``--no-ray``, tests, bench)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from keyserve.cluster.http_app import create_app
from keyserve.cluster.openai_serving import OpenAIServing
from keyserve.cluster.serve_app import ServeArgs, build_app
from keyserve.core.ray_address import check_reachable


@dataclass
class RayOptions:
    address: str | None = None  # None: $RAY_ADDRESS, else a fresh local Ray; "auto": the running one
    num_cpus: int | None = None  # local Ray only; default: this machine's cores (at least 2)
    object_store_memory_mb: int = 256  # local Ray only


def init_ray(opts: RayOptions) -> None:
    """Connect to ``opts.address`` (or ``$RAY_ADDRESS``, as inside a Ray pod or job), else start
    a small local Ray (no dashboard) rather than join whatever cluster this machine runs."""
    import ray

    if ray.is_initialized():
        return
    address = opts.address or os.environ.get("RAY_ADDRESS")
    if address:
        check_reachable(address)
        ray.init(address=address)
        return
    ray.init(
        address="local",
        num_cpus=opts.num_cpus or max(2, os.cpu_count() or 2),
        object_store_memory=opts.object_store_memory_mb * 1024 * 1024,
        include_dashboard=False,
    )


def run_serve(args: ServeArgs, host: str, port: int, ray_opts: RayOptions, blocking: bool = True) -> str:
    """Deploy on Ray Serve at http://host:port/ and (``blocking``) serve until Ctrl-C."""
    from ray import serve

    init_ray(ray_opts)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(args.model_dump(exclude_defaults=True)), name="keyserve", route_prefix="/")
    url = f"http://{host}:{port}"
    print(f"keyserve: serving {args.model_name()!r} at {url}/v1 (Ray Serve); Ctrl-C stops", flush=True)
    if blocking:
        _block_then(lambda: _shutdown_serve())
    return url


def _shutdown_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def run_uvicorn(args: ServeArgs, host: str, port: int) -> None:
    """Serve in this process with uvicorn (no Ray); blocks until Ctrl-C. The server listens
    while the model loads (``/health`` 503 loading, as under Ray Serve); a failed load stops
    it and raises."""
    import uvicorn

    serving = OpenAIServing.from_config(args.serve_config(), in_process=True)
    server = uvicorn.Server(uvicorn.Config(create_app(serving), host=host, port=port, log_level="warning"))
    failed: list[BaseException] = []

    def announce_when_loaded() -> None:
        try:
            serving.engine.wait_ready_blocking()
        except BaseException as e:  # noqa: BLE001 — re-raised in the main thread
            failed.append(e)
            server.should_exit = True
            return
        if server.should_exit or not server.started:  # e.g. it could not bind: uvicorn said why
            return
        print(f"keyserve: serving {serving.model_name!r} at http://{host}:{port}/v1 (uvicorn)", flush=True)

    print(f"keyserve: loading {serving.model_name!r}; http://{host}:{port}/health is 503 until it is "
          "ready", flush=True)
    threading.Thread(target=announce_when_loaded, name="keyserve-load-watch", daemon=True).start()
    try:
        server.run()
    finally:
        serving.engine.shutdown()
    if failed:
        raise failed[0]


def _block_then(cleanup) -> None:
    """Sleep until Ctrl-C or SIGTERM, then clean up (Ray's local processes included)."""

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # A shell starts background jobs with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: take SIGINT explicitly so `kill -INT` stops a background server.
    signal.signal(signal.SIGINT, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cleanup()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class UvicornThread:
    """The FastAPI app on uvicorn in a background thread of this process (tests, benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None) -> None:
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "UvicornThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
