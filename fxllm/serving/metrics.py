"""Prometheus metrics of one served engine, in a registry of its own (two apps in one process, or Ray replicas, never
collide on the process-wide default registry).

Gauges and counters of the engine core are read from `EngineStats` when /metrics is scraped; latencies are observed
by the server as each request's outputs reach it (what a client sees, minus the network):

| metric | kind | meaning |
| --- | --- | --- |
| fxllm_num_requests_running / _waiting | gauge | requests holding KV cache / queued in the engine |
| fxllm_num_requests_admitted | gauge | engine requests admitted and not finished (what --max-queue limits) |
| fxllm_kv_blocks_used / _total | gauge | KV pool blocks in use (cached but free ones count as free) / in the pool |
| fxllm_prefix_cache_hit_rate | gauge | prompt blocks found in the prefix cache / looked up, since start |
| fxllm_prefix_cache_queries_total / _hits_total | counter | the same as counts |
| fxllm_preemptions_total | counter | requests preempted for KV space |
| fxllm_prompt_tokens_total / fxllm_generation_tokens_total | counter | tokens of accepted prompts / tokens generated |
| fxllm_prefill_computed_tokens_total | counter | prompt tokens the model computed (prefix-cache hits excluded) |
| fxllm_model_calls_total{kind} | counter | model calls by kind: `prefill` (prompt chunks) or `decode` |
| fxllm_model_call_seconds_total{kind} | counter | seconds spent in those calls, by kind |
| fxllm_requests_total{finish_reason} | counter | finished engine requests (one per choice) by finish reason |
| fxllm_time_to_first_token_seconds | histogram | from admission (body parsed, prompt tokenized) to the first token |
| fxllm_inter_token_latency_seconds | histogram | between two outputs of a request, per token |
| fxllm_e2e_request_latency_seconds | histogram | from admission to the last output |

Every series carries the constant labels given (by default `model_name`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fxllm.runtime.metrics import EngineStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServingMetrics:
    def __init__(self, stats: Callable[[], EngineStats], labels: dict[str, str] | None = None,
                 registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.labels = dict(labels or {})
        self.error_streak = 0  # engine requests failed in a row (model calls), since the last one that finished
        self.registry.register(_EngineCollector(stats, self.labels))
        names = list(self.labels)
        self._ttft = Histogram("fxllm_time_to_first_token_seconds", "Time from arrival to the first token",
                               names, buckets=TTFT_BUCKETS, registry=self.registry)
        self._itl = Histogram("fxllm_inter_token_latency_seconds", "Time between tokens of one request",
                              names, buckets=ITL_BUCKETS, registry=self.registry)
        self._e2e = Histogram("fxllm_e2e_request_latency_seconds", "Time from arrival to the last output",
                              names, buckets=E2E_BUCKETS, registry=self.registry)
        self._finished = Counter("fxllm_requests", "Finished engine requests by finish reason",
                                 names + ["finish_reason"], registry=self.registry)
        self._admitted = Gauge("fxllm_num_requests_admitted", "Engine requests admitted and not finished", names,
                               registry=self.registry)
        self.time_to_first_token = self._child(self._ttft)
        self.inter_token_latency = self._child(self._itl)
        self.e2e_latency = self._child(self._e2e)
        self.admitted = self._child(self._admitted)

    def finished(self, finish_reason: str) -> None:
        self._finished.labels(**self.labels, finish_reason=finish_reason).inc()
        if finish_reason == "error":
            self.error_streak += 1
        elif finish_reason in ("stop", "length"):
            self.error_streak = 0

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _child(self, metric):
        return metric.labels(**self.labels) if self.labels else metric


class _EngineCollector:
    """Reads the engine's stats at scrape time. The read is not synchronized with the stepping thread: each number
    is current, the set may straddle a step."""

    def __init__(self, stats: Callable[[], EngineStats], labels: dict[str, str]):
        self.stats, self.labels = stats, labels

    def describe(self):
        return []  # collected on demand only (no duplicate-name checks against the engine's state)

    def collect(self):
        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        gauges = [("fxllm_num_requests_running", "Requests holding KV cache", s.running),
                  ("fxllm_num_requests_waiting", "Requests queued in the engine", s.waiting),
                  ("fxllm_kv_blocks_used", "KV pool blocks in use", s.kv_blocks_used),
                  ("fxllm_kv_blocks_total", "KV pool blocks", s.kv_blocks_total),
                  ("fxllm_prefix_cache_hit_rate", "Prompt blocks found in the prefix cache / looked up",
                   s.prefix_cache_hit_rate)]
        for name, documentation, value in gauges:
            if value is not None:
                family = GaugeMetricFamily(name, documentation, labels=names)
                family.add_metric(values, value)
                yield family
        counters = [("fxllm_prefix_cache_queries", "Prompt blocks looked up in the prefix cache",
                     s.prefix_cache_queries),
                    ("fxllm_prefix_cache_hits", "Prompt blocks found in the prefix cache", s.prefix_cache_hits),
                    ("fxllm_preemptions", "Requests preempted for KV space", s.preemptions),
                    ("fxllm_prompt_tokens", "Prompt tokens of accepted requests", s.prompt_tokens),
                    ("fxllm_generation_tokens", "Generated tokens", s.generation_tokens),
                    ("fxllm_prefill_computed_tokens", "Prompt tokens computed by the model (prefix-cache hits "
                     "excluded)", s.prefill_tokens)]
        for name, documentation, value in counters:
            family = CounterMetricFamily(name, documentation, labels=names)
            family.add_metric(values, value)
            yield family
        by_kind = [("fxllm_model_calls", "Model calls by kind", s.prefill_steps, s.decode_steps),
                   ("fxllm_model_call_seconds", "Seconds in model calls by kind", s.prefill_seconds, s.decode_seconds)]
        for name, documentation, prefill, decode in by_kind:
            family = CounterMetricFamily(name, documentation, labels=names + ["kind"])
            family.add_metric(values + ["prefill"], prefill)
            family.add_metric(values + ["decode"], decode)
            yield family
