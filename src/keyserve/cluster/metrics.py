"""Prometheus metrics (prefix ``keyserve:``) for one server, in its own registry.

Engine-wide gauges and counters are read at scrape time from the snapshot the engine thread
publishes after every step (no work per token); latency histograms are observed once per
finished request.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from keyserve.engine.stats import EngineStats
from keyserve.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5)

# (name, help, EngineStats attribute) — counters get Prometheus' `_total` suffix.
_GAUGES = [
    ("num_requests_running", "Requests with sequences in the running batch.", "num_requests_running"),
    ("num_requests_waiting", "Requests admitted but not yet running.", "num_requests_waiting"),
    ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "kv_cache_usage"),
    ("num_kv_blocks_free", "KV blocks free (cached prefixes included).", "num_free_blocks"),
    ("num_kv_blocks", "KV blocks in the pool.", "num_blocks"),
]
_COUNTERS = [
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.", "num_preemptions"),
    ("kv_tokens_evicted", "KV tokens evicted by KV budgets (per layer and kv-head).", "kv_tokens_evicted"),
    ("spec_decode_num_draft_tokens", "Draft tokens proposed by speculative sampling.", "spec_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", "spec_accepted_tokens"),
    ("spec_decode_num_lookup_draft_tokens", "Draft tokens prompt lookup proposed (part of the draft tokens).",
     "spec_lookup_draft_tokens"),
    ("spec_decode_num_lookup_accepted_tokens", "Prompt-lookup draft tokens accepted by the target.",
     "spec_lookup_accepted_tokens"),
    ("prompt_tokens", "Prompt tokens of finished requests.", "prompt_tokens"),
    ("generation_tokens", "Generated tokens of finished requests.", "generation_tokens"),
    ("engine_steps", "Engine steps run.", "num_steps"),
]

_STORE_TIERED = [
    ("hits", "Prefix-store chunks read, by tier.", "{}_hits"),
    ("bytes_read", "Prefix-store bytes read, by tier.", "{}_bytes_read"),
    ("evictions", "Prefix-store evictions (chunks; disk: nodes), by tier.", "{}_evictions"),
]
_STORE_COUNTERS = [
    ("lookups", "Admissions that looked up the prefix store.", "lookups"),
    ("hit_tokens", "Prompt tokens covered by prefix-store loads.", "hit_tokens"),
    ("importance_fallbacks", "Stored (prefix, layer) pairs whose sampled heads disagreed (load all).",
     "importance_fallbacks"),
    ("corrupt_chunks", "Damaged or missing disk chunks (treated as misses).", "corrupt_chunks"),
    ("stored_tokens", "Tokens written to the prefix store.", "stored_tokens"),
]


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self):
        s = self.stats()
        for name, doc, attr in _GAUGES:
            g = GaugeMetricFamily(f"keyserve:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(s, attr)))
            yield g
        for name, doc, attr in _COUNTERS:
            c = CounterMetricFamily(f"keyserve:{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(s, attr)))
            yield c
        yield from self._prefix_store(s.prefix_store)

    def _prefix_store(self, ps: dict[str, float]):
        """IMPRESS prefix-store counters, per tier where they have one (only when it is on)."""
        if not ps:
            return
        for name, doc, key in _STORE_TIERED:
            c = CounterMetricFamily(f"keyserve:prefix_store_{name}", doc, labels=["model_name", "tier"])
            for tier in ("device", "host", "disk"):
                c.add_metric([self.model_name, tier], float(ps.get(key.format(tier), 0)))
            yield c
        for name, doc, key in _STORE_COUNTERS:
            c = CounterMetricFamily(f"keyserve:prefix_store_{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], float(ps.get(key, 0)))
            yield c


class ServerMetrics:
    """The registry behind ``GET /metrics``; ``observe_finished`` is the engine's callback."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("keyserve:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("keyserve:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("keyserve:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("keyserve:request_success", "Requests finished, by reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.rejected = Counter("keyserve:request_rejected", "Requests refused, by HTTP status.",
                                ["model_name", "status"], registry=self.registry)
        self.aborted = Counter(
            "keyserve:request_aborted",
            "HTTP requests whose client went away before the response was complete (their engine "
            "requests, if any, are aborted and count in request_success{finished_reason=abort}).",
            labels, registry=self.registry)
        self.aborted.labels(model_name)  # exported as 0 from the start

    def observe_finished(self, out: RequestOutput) -> None:
        reasons = {o.finish_reason for o in out.outputs}
        if out.error is not None:  # failed, as vLLM's FinishReason.ERROR
            reason = "error"
        else:
            reason = "abort" if "abort" in reasons else (out.finish_reason or "unknown")
        self.finished.labels(self.model_name, reason).inc()
        if reason in ("abort", "error"):
            return
        st = out.stats
        if st.time_to_first_token_s is not None:
            self.ttft.labels(self.model_name).observe(st.time_to_first_token_s)
        if st.e2e_latency_s is not None:
            self.e2e.labels(self.model_name).observe(st.e2e_latency_s)
            tokens = max((len(o.token_ids) for o in out.outputs), default=0)
            if st.time_to_first_token_s is not None and tokens > 1:
                decode = st.e2e_latency_s - st.time_to_first_token_s
                self.tpot.labels(self.model_name).observe(decode / (tokens - 1))

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def observe_aborted(self) -> None:
        """A client disconnect: an abort, never an error (request_rejected{status=500})."""
        self.aborted.labels(self.model_name).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
