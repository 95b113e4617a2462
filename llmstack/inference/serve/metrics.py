"""Prometheus metrics of the serving engine, in a registry of their own (one per server)."""

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets in seconds, from a fast decode step on a GPU to a long prefill on a CPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
THROUGHPUT_WINDOW_S = 10.0


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.waiting = Gauge("llmstack_requests_waiting", "requests queued for admission", registry=r)
        self.running = Gauge("llmstack_requests_running", "requests in the decode batch", registry=r)
        self.kv_slots_used = Gauge("llmstack_kv_cache_slots_used", "KV cache slots held by requests", registry=r)
        self.kv_slots_total = Gauge("llmstack_kv_cache_slots_total", "KV cache slots (one context each)", registry=r)
        self.generated = Counter("llmstack_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("llmstack_requests_finished", "requests ended, by reason", ["reason"], registry=r)
        self.rejected = Counter(
            "llmstack_requests_rejected", "requests refused, by HTTP status", ["status"], registry=r
        )
        self.ttft = Histogram(
            "llmstack_time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "llmstack_inter_token_latency_seconds",
            "time between a request's tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.draft_tokens = Counter(
            "llmstack_speculative_draft_tokens", "tokens guessed by speculative decoding", registry=r
        )
        self.accepted_tokens = Counter(
            "llmstack_speculative_accepted_tokens", "guessed tokens the model's verification kept", registry=r
        )
        self.prefix_query_tokens = Counter(
            "llmstack_prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "llmstack_prefix_cache_hit_tokens",
            "prompt tokens whose keys/values came from the prefix cache (hit rate: hit / query)",
            registry=r,
        )
        self.prefix_cached_tokens = Gauge(
            "llmstack_prefix_cache_tokens", "tokens whose keys/values the prefix cache holds", registry=r
        )
        self.prefill_chunks = Counter(
            "llmstack_prefill_chunks",
            "prefill forwards (a prompt prefilled whole counts one; in chunks, one per chunk)",
            registry=r,
        )
        self.prefill_tokens = Counter(
            "llmstack_prefill_tokens", "prompt tokens prefilled (a prefix cache's hits not included)", registry=r
        )
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        tokens_per_second = Gauge(
            "llmstack_generation_tokens_per_second",
            f"tokens generated per second over the last {THROUGHPUT_WINDOW_S:g} s",
            registry=r,
        )
        tokens_per_second.set_function(self.tokens_per_second)

    def count_tokens(self, n: int) -> None:
        self.generated.inc(n)
        with self._lock:
            self._recent.append((time.monotonic(), n))

    def tokens_per_second(self) -> float:
        start = time.monotonic() - THROUGHPUT_WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < start:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
