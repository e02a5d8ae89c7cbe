"""Prometheus metrics of a server: request latencies and token counts, observed as requests
finish, and the runtime's live state (queues, KV, cache), read at each scrape.

Each latency histogram is observed exactly once per finished request: time to first token,
mean inter-token latency, and end-to-end latency.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """Metrics in a registry of their own (so several servers in one process never clash)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            "radixlm_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "radixlm_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.cached_tokens = Counter(
            "radixlm_cached_tokens", "Prompt tokens served from the prefix cache",
            registry=self.registry,
        )
        self.finished = Counter(
            "radixlm_requests_finished", "Finished requests", ["finish_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "radixlm_time_to_first_token_seconds", "Time to first token",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "radixlm_inter_token_latency_seconds", "Mean time between output tokens",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "radixlm_e2e_request_latency_seconds", "End-to-end request latency",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._state = _RuntimeStateCollector()
        self.registry.register(self._state)

    def observe_finished(self, created: float, first_token: float | None, meta: dict) -> None:
        """Records one finished request (``meta``: its native ``meta_info``)."""
        now = time.perf_counter()
        first = first_token if first_token is not None else now
        completion = meta["completion_tokens"]
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(meta["cached_tokens"])
        self.finished.labels((meta["finish_reason"] or {}).get("type", "unknown")).inc()
        self.time_to_first_token.observe(first - created)
        self.inter_token_latency.observe((now - first) / (completion - 1) if completion > 1 else 0)
        self.e2e_latency.observe(now - created)

    def render(self, server_info: dict[str, Any]) -> bytes:
        """The metrics in Prometheus' text format, with the runtime's live state read from
        ``server_info`` (``Engine.get_server_info``, fetched by the caller)."""
        self._state.server_info = server_info
        return generate_latest(self.registry)


class _RuntimeStateCollector(Collector):
    """Gauges read from the runtime at scrape time."""

    server_info: dict[str, Any] | None = None
    """The state to report at the next scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = self.server_info
        if info is None:
            return
        stats = info.get("stats", {})
        used = info["max_total_tokens"] - info["free_kv_tokens"]
        hit_rate = stats.get("cached_tokens", 0) / max(stats.get("prompt_tokens", 0), 1)
        gauges = {
            "radixlm_num_running_requests": ("Requests running", info["num_running"]),
            "radixlm_num_queued_requests": ("Requests waiting", info["num_waiting"]),
            "radixlm_kv_usage_ratio": ("Share of KV slots in use (requests and cache)",
                                       used / info["max_total_tokens"]),
            "radixlm_cache_tokens": ("Tokens held by the prefix cache", info["cache_tokens"]),
            "radixlm_cache_hit_rate": ("Cached share of admitted prompt tokens", hit_rate),
            "radixlm_retractions": ("Requests retracted so far", stats.get("retractions", 0)),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(name, help_text, value=value)
        yield GaugeMetricFamily("radixlm_tp_size", "Tensor-parallel ranks of the model",
                                value=info.get("tp_size", 1))
        for name, key, help_text in (
                ("radixlm_tp_rank_kv_tokens", "kv_tokens", "KV pool slots of each rank"),
                ("radixlm_tp_rank_kv_bytes", "kv_bytes", "KV pool bytes of each rank")):
            family = GaugeMetricFamily(name, help_text, labels=["tp_rank"])
            for rank in info.get("tp_ranks", []):
                family.add_metric([str(rank["rank"])], rank[key])
            yield family
        tiers = info.get("hierarchical_cache")
        if tiers is not None:
            yield from _tier_gauges(tiers)


def _tier_gauges(tiers: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    """The hierarchical cache's per-tier occupancy and traffic, labelled by tier."""
    host, disk = tiers["host"], tiers["disk"] or {}
    rows = {
        "radixlm_hicache_tokens": ("Tokens each tier holds",
                                   {"device": tiers["device_tokens"], "host": host["tokens"],
                                    "disk": disk.get("files", 0) * tiers["block_tokens"]}),
        "radixlm_hicache_bytes": ("Bytes each lower tier holds",
                                  {"host": host["bytes_used"], "disk": disk.get("bytes_used", 0)}),
        "radixlm_hicache_hit_tokens": ("Prompt tokens each tier supplied",
                                       {"device": tiers["device_hit_tokens"],
                                        "host": tiers["host_hit_tokens"],
                                        "disk": tiers["disk_hit_tokens"]}),
        "radixlm_hicache_bytes_written": ("Bytes written into each lower tier",
                                          {"host": host["bytes_written"],
                                           "disk": disk.get("bytes_written", 0)}),
        "radixlm_hicache_bytes_loaded": ("Bytes read out of each lower tier",
                                         {"host": host["bytes_loaded"],
                                          "disk": disk.get("bytes_read", 0)}),
        "radixlm_hicache_load_seconds": ("Seconds spent loading from each lower tier",
                                         {"host": tiers["load_seconds"],
                                          "disk": tiers["disk_read_seconds"]}),
    }
    for name, (help_text, values) in rows.items():
        family = GaugeMetricFamily(name, help_text, labels=["tier"])
        for tier, value in values.items():
            family.add_metric([tier], value)
        yield family
