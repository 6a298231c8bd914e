"""The IMPRESS prefix store behind the OpenAI server: a repeated long prompt is answered from
the disk tier (no device or host tier here) with the same text as recomputing it, and the
store's counters appear on /metrics per tier."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from keyserve import LLM, SamplingParams

from live_server import LiveServer, live_server

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
    "with her friends. One day, she saw a big dog in the park. The dog was brown and had a long "
    "tail. Lily wanted to pet the dog, but her mom said to be careful. Lily walked slowly to the "
    "dog and held out her hand. The dog sniffed her hand and wagged its tail. "
)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def server(stories_path: str, disk: Path) -> LiveServer:
    with live_server(model=stories_path, num_blocks=256, seed=0, enable_prefix_caching=False,
                     prefix_store=True, prefix_store_device_tokens=0, prefix_store_host_tokens=0,
                     prefix_store_disk_path=str(disk)) as live:
        yield live


def store_metrics(url: str) -> dict[str, float]:
    """keyserve:prefix_store_* samples, keyed ``name`` or ``name{tier}``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name.startswith("keyserve:prefix_store_"):
                out[s.name + (f"{{{s.labels['tier']}}}" if "tier" in s.labels else "")] = s.value
    return out


def test_repeated_prompt_is_served_from_disk_exactly(server: LiveServer, stories_path: str, disk: Path) -> None:
    client, model = server.client(), server.serving.model_name
    prompts = [STORY * 2 + "Then Lily", STORY * 2 + "The dog ran"]  # one stored prefix, two endings
    ask = dict(model=model, max_tokens=20, temperature=0)
    first = client.completions.create(prompt=prompts[0], **ask)
    server.wait_idle()
    before = store_metrics(server.url)
    assert before["keyserve:prefix_store_stored_tokens_total"] > 0
    assert any(p.is_file() for p in disk.rglob("*"))  # the disk tier's files
    again = [client.completions.create(prompt=p, **ask) for p in prompts]
    after = store_metrics(server.url)
    assert after["keyserve:prefix_store_hits_total{disk}"] > before["keyserve:prefix_store_hits_total{disk}"]
    assert after["keyserve:prefix_store_bytes_read_total{disk}"] > 0
    assert after["keyserve:prefix_store_hits_total{device}"] == after["keyserve:prefix_store_hits_total{host}"] == 0
    assert after["keyserve:prefix_store_hit_tokens_total"] >= 2 * 64
    assert after["keyserve:prefix_store_corrupt_chunks_total"] == 0
    # the oracle: the same engine settings without a store, recomputing every prompt
    plain = LLM(stories_path, num_blocks=256, enable_prefix_caching=False)
    want = plain.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    assert first.choices[0].text == again[0].choices[0].text == want[0].text
    assert again[1].choices[0].text == want[1].text
