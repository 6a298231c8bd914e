"""A real server on loopback: the FastAPI app over a real engine, on uvicorn in a background
thread of the test process (the Ray Serve tests deploy the same app on Ray)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from keyserve.cluster.http_app import create_app
from keyserve.cluster.launcher import UvicornThread
from keyserve.cluster.openai_serving import OpenAIServing
from keyserve.config import ServeConfig


@dataclass
class LiveServer:
    serving: OpenAIServing
    url: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def engine(self):
        return self.serving.engine

    def client(self, api_key: str = "unused", **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def async_client(self, api_key: str = "unused", **kwargs):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """Every sample of /metrics, by name (labels dropped: one model per server)."""
        text = httpx.get(self.url + "/metrics", headers=headers or {}, timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name if "le" not in s.labels else f"{s.name}{{le={s.labels['le']}}}"
                if "finished_reason" in s.labels:
                    key = f"{s.name}{{{s.labels['finished_reason']}}}"
                if "status" in s.labels:
                    key = f"{s.name}{{{s.labels['status']}}}"
                samples[key] = s.value
        return samples

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request is in the engine and every KV block is back in the pool."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.engine.stats()
            bm = self.engine.engine.block_manager
            if (st.num_requests_running == st.num_requests_waiting == 0
                    and bm.num_free_blocks == bm.num_blocks and not self.engine.engine.requests):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {st}")
            time.sleep(0.05)


@contextmanager
def live_server(**options) -> Iterator[LiveServer]:
    serving = OpenAIServing.from_config(ServeConfig(**options))
    try:
        assert serving.engine.wait_ready_blocking(timeout=600)
        server = UvicornThread(create_app(serving)).start()
        try:
            yield LiveServer(serving, server.url)
        finally:
            server.stop()
    finally:
        serving.engine.shutdown()
