"""Prometheus metrics of a serving engine (one registry per server)."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger("tandem.serve")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)



# Engine stats exported as they are: (family, metric name, stats key, help).
_STAT_METRICS = (
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "spec_draft_tokens", "Speculative draft tokens proposed"),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "spec_accepted_tokens",
     "Speculative draft tokens accepted"),
    (GaugeMetricFamily, "spec_decode_acceptance_rate", "spec_acceptance_rate", "Share of draft tokens accepted (0..1)"),
    (GaugeMetricFamily, "spec_decode_mean_accepted_length", "spec_mean_accepted_length",
     "Tokens a verifying sequence step emits on average (accepted drafts + 1)"),
    (CounterMetricFamily, "structured_jump_forward_tokens", "structured_jump_forward_tokens",
     "Structured-output tokens appended by jump-forward (forced by the grammar, not sampled)"),
    (CounterMetricFamily, "structured_jump_forward_steps", "structured_jump_forward_steps",
     "Sequence steps that jumped forward over a forced structured-output continuation"),
    (CounterMetricFamily, "kv_compress_requests", "kv_compress_requests",
     "Requests whose cross-attention KV was compressed (kv_compress)"),
    (CounterMetricFamily, "kv_compress_blocks_freed", "kv_compress_blocks_freed",
     "KV blocks cross-attention compression released (kv_compress)"),
    (GaugeMetricFamily, "lora_adapters_running", "lora_adapters_running",
     "Distinct LoRA adapters among the requests of the last step"),
    (CounterMetricFamily, "lm_head_screen_rows", "lm_head_screen_rows",
     "Rows whose greedy token the int8 LM-head screen decided (in-process worker)"),
    (CounterMetricFamily, "lm_head_screen_full_rows", "lm_head_screen_full_rows",
     "Screened rows that needed their whole float32 LM-head row (in-process worker)"),
    (CounterMetricFamily, "encoder_runs", "encoder_runs", "Requests whose encoder ran"),
    (CounterMetricFamily, "encoder_runs_saved", "encoder_runs_saved",
     "Requests that skipped their encoder (a live or cached cross table)"),
    (CounterMetricFamily, "encoder_cache_hits", "encoder_cache_hits",
     "Requests that took a cross table the encoder cache kept"),
    (CounterMetricFamily, "encoder_cache_misses", "encoder_cache_misses",
     "Requests that found no live or cached cross table (their encoder ran)"),
    (CounterMetricFamily, "encoder_cache_evictions", "encoder_cache_evictions",
     "Cross tables evicted from the encoder cache"),
    (GaugeMetricFamily, "encoder_cache_blocks", "encoder_cache_blocks",
     "KV blocks the encoder cache keeps (evictable)"),
    (CounterMetricFamily, "prefix_cache_queries", "prefix_cache_queried_tokens",
     "Decoder prompt tokens looked up in the prefix cache at admission"),
    (CounterMetricFamily, "prefix_cache_hits", "prefix_cache_hit_tokens",
     "Decoder prompt tokens found in the prefix cache (not computed)"),
    (GaugeMetricFamily, "prefix_cache_hit_rate", "prefix_cache_hit_rate",
     "Share of looked-up decoder prompt tokens found cached (0..1)"),
    (CounterMetricFamily, "prefix_cache_evictions", "prefix_cache_evictions",
     "Decoder-prompt blocks evicted from the prefix cache"),
    (GaugeMetricFamily, "prefix_cache_blocks", "prefix_cache_blocks",
     "KV blocks the prefix cache keeps (evictable)"),
)

class _EngineCollector:
    """Gauges read at scrape time (running / waiting requests, KV use) from the
    counters the engine thread publishes after each step, never from its live queues."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.get_stats()
        g = GaugeMetricFamily("tandem:num_requests_running", "Requests in the running batch")
        g.add_metric([], stats["num_requests_running"])
        yield g
        g = GaugeMetricFamily("tandem:num_requests_waiting", "Requests waiting to be admitted (or swapped out)")
        g.add_metric([], stats["num_requests_waiting"] + stats["num_requests_swapped"])
        yield g
        total = max(1, stats["kv_blocks_total"])
        g = GaugeMetricFamily("tandem:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        g.add_metric([], (total - stats["kv_blocks_free"]) / total)
        yield g
        c = CounterMetricFamily("tandem:num_preemptions", "Preemptions since start")
        c.add_metric([], stats["num_preemptions"])
        yield c
        for family, metric, stat, doc in _STAT_METRICS:
            m = family(f"tandem:{metric}", doc)
            m.add_metric([], stats[stat])
            yield m


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


class AudioMeter:
    """One audio request (a transcription or translation) counted in the same
    metrics as completions. It stands in for the ``AsyncLLM`` that
    ``transcribe_async`` drives (``engine``, ``generate``, ``get_tokenizer``,
    ``call_model``), so each 30 s window's engine request is seen as it finishes:

    - prompt tokens: each window's decoder prompt tokens plus the encoder
      positions it ran (``max_encoder_len``: 1500 for Whisper's padded window);
    - generation tokens: each window's generated tokens, temperature-fallback
      re-decodes included (the engine generated them);
    - time to first token: arrival to the first window's tokens (windows finish
      whole: that is when a stream's first text can go out); no inter-token
      latency (no window streams its tokens);
    - one ``request_success`` per request, by its last window's finish reason
      (``abort`` when the client left or the shutdown cut it).
    """

    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self._async, self.metrics = engine, metrics
        self.engine = engine.engine  # the LLMEngine, whose model class transcribe_async asks for a session
        self.encoder_positions = int(self.engine.model_cls.max_encoder_len(self.engine.hf_config))
        self.start = time.monotonic()
        self.prompt_tokens = self.generated = self.windows = 0
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None
        self.counted = False

    def get_tokenizer(self):
        return self._async.get_tokenizer()

    def call_model(self, method, *args):
        return self._async.call_model(method, *args)

    async def generate(self, prompt, params=None, request_id=None, *, prompt_slot=None, lora_request=None):
        gen = self._async.generate(prompt, params, request_id, prompt_slot=prompt_slot, lora_request=lora_request)
        try:
            async for out in gen:
                if out.finished and out.error is None:
                    self._window(out)
                yield out
        finally:
            await gen.aclose()

    def _window(self, out) -> None:
        n_in = len(out.encoder_prompt_token_ids) + len(out.prompt_token_ids) + self.encoder_positions
        n_out = sum(len(c.token_ids) for c in out.outputs)
        self.windows += 1
        self.prompt_tokens += n_in
        self.generated += n_out
        self.metrics.prompt_tokens.inc(n_in)
        self.metrics.generation_tokens.inc(n_out)
        if n_out and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.finish_reason = out.outputs[0].finish_reason if out.outputs else None

    def finished(self, request_id: str, audio_seconds: float) -> None:
        """The request answered: its success, latencies and one log line."""
        if self.counted:
            return
        self.counted = True
        end = time.monotonic()
        self.metrics.request_success.labels(finished_reason=self.finish_reason or "stop").inc()
        self.metrics.e2e.observe(end - self.start)
        if self.first_token_at is not None:
            self.metrics.ttft.observe(self.first_token_at - self.start)
        logger.info("request %s: %.2f s of audio, %d window(s), %d tokens in, %d out, %.3f s", request_id,
                    audio_seconds, self.windows, self.prompt_tokens, self.generated, end - self.start)

    def aborted(self) -> None:
        """The client left, or the shutdown cut it: counted once as ``abort``."""
        if not self.counted:
            self.counted = True
            self.metrics.request_success.labels(finished_reason="abort").inc()
