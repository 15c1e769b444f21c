"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The server's metrics, counted from the app's start: what the Inferencer ran before (the server's
    warm-up, a program's own use) is not this server's traffic."""

    def __init__(self, inferencer):
        r = self.registry = CollectorRegistry()
        base = inferencer.stats()
        stat = lambda key: (lambda: inferencer.stats()[key])  # noqa: E731  read at scrape time
        Gauge("slotinfer_requests_running", "Requests holding a slot", registry=r).set_function(stat("active_slots"))
        Gauge("slotinfer_requests_waiting", "Requests waiting for a slot or K/V blocks", registry=r).set_function(stat("waiting"))
        Gauge("slotinfer_prefill_tokens_per_second", "Prefill tokens/s since start (time in prefill only)",
              registry=r).set_function(lambda: _rate(inferencer.stats(), base, "prefill_tokens", "prefill_s"))
        Gauge("slotinfer_decode_tokens_per_second", "Decode tokens/s since start (time in engine steps only)",
              registry=r).set_function(lambda: _rate(inferencer.stats(), base, "decode_tokens", "step_s"))
        Gauge("slotinfer_kv_blocks_used", "K/V pool blocks held by requests",
              registry=r).set_function(stat("blocks_used"))
        Gauge("slotinfer_kv_blocks_free", "K/V pool blocks free", registry=r).set_function(stat("blocks_free"))
        Gauge("slotinfer_kv_block_tokens", "Tokens one K/V block holds", registry=r).set_function(stat("block_tokens"))
        r.register(PrefixCacheCollector(inferencer, base.get("prefix_cache") or {}))
        r.register(PreemptedCollector(inferencer, base.get("preempted", 0)))
        r.register(SpeculativeCollector(inferencer, base))
        self.requests = Counter("slotinfer_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("slotinfer_prompt_tokens", "Prompt tokens taken", registry=r)
        self.generation_tokens = Counter("slotinfer_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("slotinfer_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("slotinfer_inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY, registry=r)

    def outcome(self, endpoint: str, outcome: str):
        self.requests.labels(endpoint, outcome).inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class PrefixCacheCollector:
    """The prefix cache's counters and size, read from the Inferencer's stats at scrape time."""

    COUNTERS = {"queries": "Prompts looked up in the prefix cache",
                "hits": "Prompts that found a cached prefix",
                "query_tokens": "Prompt tokens looked up",
                "hit_tokens": "Prompt tokens whose K/V came from the cache",
                "inserted_blocks": "Blocks written into the cache",
                "evictions": "Blocks evicted to stay within the budget"}
    GAUGES = {"bytes": "Bytes the cache holds", "budget_bytes": "The cache's byte budget",
              "blocks": "Blocks the cache holds"}

    def __init__(self, inferencer, base: dict):
        self.inferencer, self.base = inferencer, base

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        st = self.inferencer.stats().get("prefix_cache") or {}
        for key, text in self.COUNTERS.items():
            c = CounterMetricFamily(f"slotinfer_prefix_cache_{key}", text)
            c.add_metric([], st.get(key, 0) - self.base.get(key, 0))
            yield c
        for key, text in self.GAUGES.items():
            g = GaugeMetricFamily(f"slotinfer_prefix_cache_{key}", text)
            g.add_metric([], st.get(key, 0))
            yield g


class PreemptedCollector:
    """Requests preempted so far (the K/V pool ran short; each resumed by recompute)."""

    def __init__(self, inferencer, base: int):
        self.inferencer, self.base = inferencer, base

    def describe(self):
        return []

    def collect(self):
        yield CounterMetricFamily("slotinfer_preempted", "Requests preempted because the K/V pool ran short, "
                                  "each resumed later by recompute",
                                  value=self.inferencer.stats().get("preempted", 0) - self.base)


class SpeculativeCollector:
    """Speculative decoding's draft tokens verified and accepted, and its verify passes (0 while off)."""

    COUNTERS = {"spec_drafted": ("slotinfer_spec_draft_tokens", "Draft tokens verified in decode steps"),
                "spec_accepted": ("slotinfer_spec_accepted_tokens", "Draft tokens accepted (equal to the model's own)"),
                "spec_passes": ("slotinfer_spec_verify_passes", "Rows that verified a draft in a decode step")}

    def __init__(self, inferencer, base: dict):
        self.inferencer, self.base = inferencer, base

    def describe(self):
        return []

    def collect(self):
        st = self.inferencer.stats()
        for key, (name, text) in self.COUNTERS.items():
            yield CounterMetricFamily(name, text, value=st.get(key, 0) - self.base.get(key, 0))


def _rate(now: dict, base: dict, tokens: str, seconds: str) -> float:
    """Tokens per second of the work since ``base`` (0 before any)."""
    spent = now[seconds] - base[seconds]
    return (now[tokens] - base[tokens]) / spent if spent > 0 else 0.0


class Timer:
    """Times one row's tokens as the server hands them on: TTFT once, then each gap."""

    def __init__(self, metrics: Metrics, t0: float):
        self.metrics, self.last, self.first = metrics, t0, True

    def tick(self):
        now = time.perf_counter()
        (self.metrics.ttft if self.first else self.metrics.itl).observe(now - self.last)
        self.first, self.last = False, now
        self.metrics.generation_tokens.inc()
