"""Prometheus metrics of a serving engine (one registry per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class _EngineCollector:
    """Gauges read from the engine at scrape time (running / waiting requests, KV use)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        sch = self.engine.engine.scheduler
        stats = self.engine.get_stats()
        g = GaugeMetricFamily("tandem:num_requests_running", "Requests in the running batch")
        g.add_metric([], len(sch.running))
        yield g
        g = GaugeMetricFamily("tandem:num_requests_waiting", "Requests waiting to be admitted (or swapped out)")
        g.add_metric([], len(sch.waiting) + len(sch.swapped))
        yield g
        total = max(1, stats["kv_blocks_total"])
        g = GaugeMetricFamily("tandem:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        g.add_metric([], (total - stats["kv_blocks_free"]) / total)
        yield g
        c = CounterMetricFamily("tandem:num_preemptions", "Preemptions since start")
        c.add_metric([], stats["num_preemptions"])
        yield c


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens (encoder + decoder) received", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(
            "tandem:request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        # Shown from the start at 0, so a rate() over them works before the first of each.
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(finished_reason=reason)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
