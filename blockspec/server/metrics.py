"""Prometheus metrics, one registry per server (so several servers can live in one process).

NOTE: the engine reports every step (hundreds a second, to every HTTP server process), but metrics are read only
when scraped: a step's labelled gauges are applied from the latest StepStats at `render`, and per-verify accept
lengths are counted into a plain list (exposed as a histogram by `_CountedHistogram`), so a step costs O(1) here."""
from __future__ import annotations

from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from blockspec.engine.wire import FinishStat, StepStats, VerifyLengthStat
from blockspec.server.metric_aliases import SGLangAliases

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, float("inf"))
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _CountedHistogram(Collector):
    """A histogram with buckets le=1..max_value (accept lengths) kept as counts per bucket: `counts[k]` = values in
    (k - 1, k] (k = 1: every value <= 1), `counts[max_value + 1]` = values above max_value (+Inf only)."""

    def __init__(self, name: str, documentation: str, max_value: int) -> None:
        self.name = name
        self.documentation = documentation
        self.counts = [0] * (max_value + 2)
        self.total = 0.0

    def observe(self, value: int) -> None:
        self.counts[min(max(value, 1), len(self.counts) - 1)] += 1
        self.total += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for value in range(1, len(self.counts)):
            cumulative += self.counts[value]
            buckets.append(("+Inf" if value == len(self.counts) - 1 else str(float(value)), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.total)


class ServerMetrics:
    def __init__(self, max_accept_length: int = 16) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("blockspec_requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("blockspec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("blockspec_generation_tokens", "Generated tokens", registry=r)
        self.http_errors = Counter("blockspec_http_errors", "Error responses", ["status"], registry=r)
        self.num_running = Gauge("blockspec_num_running_reqs", "Requests in the running batch", registry=r)
        self.num_queued = Gauge("blockspec_num_queue_reqs", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("blockspec_token_usage", "Fraction of KV slots in use", registry=r)
        self.kv_free = Gauge("blockspec_kv_free_slots", "Free KV slots", registry=r)
        self.kv_total = Gauge("blockspec_kv_total_slots", "KV slots in the pool", registry=r)
        self.ttft = Histogram(
            "blockspec_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "blockspec_time_per_output_token_seconds",
            "Mean time per token after the first",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.receive_time = Histogram("blockspec_request_receive_time_seconds", "Arrival to the engine's scheduler",
                                      buckets=_TPOT_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "blockspec_request_queue_time_seconds",
            "In the engine's waiting queue (received to " "admitted to a prefill step)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram("blockspec_request_prefill_time_seconds", "Admitted to first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(
            "blockspec_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.avg_accept = Gauge(
            "blockspec_spec_accept_length", "Tokens committed per verify forward (bonus included)", registry=r
        )
        self.accept_per_verify = _CountedHistogram(
            "blockspec_spec_accept_length_per_verify", "Tokens committed by each verify forward", max_accept_length
        )
        r.register(self.accept_per_verify)
        self._finish_reasons: dict[str, Any] = {}  # NOTE: labelled children, looked up once per reason
        self._last_step: Optional[StepStats] = None  # applied to the labelled gauges at render
        self._last_detail: Optional[StepStats] = None  # the last one with the detailed fields (StepStats.detailed)
        self.kernel_compiles = Gauge(
            "blockspec_kernel_compiles_after_startup",
            "Triton kernel variants compiled since the engine's start-up finished (each a stall; should stay 0)",
            registry=r,
        )
        self.startup_seconds = Gauge(
            "blockspec_startup_seconds", "Engine start-up time by phase", ["phase"], registry=r
        )
        self.position_accept = Gauge(
            "blockspec_spec_position_accept_rate",
            "Fraction of verifies that accepted draft position N",
            ["position"],
            registry=r,
        )

        self.verify_length = Gauge(
            "blockspec_spec_verify_num_draft_tokens", "DFlash verify length in use (1 = plain target decode)",
            ["batch_size"], registry=r,
        )
        self.verify_expected_tokens = Gauge(
            "blockspec_spec_verify_expected_tokens", "Expected tokens per cycle at the verify length in use",
            ["batch_size"], registry=r,
        )
        self.verify_cycle_ms = Gauge(
            "blockspec_spec_verify_cycle_ms", "Cycle time (ms) the verify length in use was chosen on (adaptive)",
            ["batch_size"], registry=r,
        )

        self.verify_position_rate = Gauge(
            "blockspec_spec_verify_position_accept_rate",
            "P(draft position N accepted | a verify tried it and accepted the ones before), decayed, as adaptive "
            "verify uses it",
            ["position"],
            registry=r,
        )

        self.cache_hit_rate = Gauge(
            "blockspec_cache_hit_rate", "Radix cache: prompt tokens found cached / prompt tokens admitted", registry=r
        )
        self.cached_tokens = Counter(
            "blockspec_cached_tokens", "Radix cache: prompt tokens whose KV was reused", registry=r
        )
        self.radix_evicted_tokens = Counter(
            "blockspec_radix_cache_evicted_tokens", "Radix cache: tokens evicted", registry=r
        )
        self.radix_tree_tokens = Gauge(
            "blockspec_radix_cache_tokens", "Radix cache: tokens held in the tree", registry=r
        )
        self._cache_totals = {"cached_tokens_total": 0, "evicted_tokens_total": 0}
        r.register(SGLangAliases([self.prompt_tokens, self.generation_tokens, self.num_running, self.num_queued,
                                  self.kv_usage, self.cache_hit_rate, self.avg_accept, self.ttft, self.tpot, self.e2e]))

    def set_cache_stats(self, stats: dict[str, Any]) -> None:
        """From `Engine.radix_cache_stats()` (read when /metrics is scraped); engine totals only grow."""
        self.cache_hit_rate.set(float(stats["cache_hit_rate"]))
        self.radix_tree_tokens.set(int(stats["tree_tokens"]))
        for key, counter in (
            ("cached_tokens_total", self.cached_tokens),
            ("evicted_tokens_total", self.radix_evicted_tokens),
        ):
            grown = int(stats[key]) - self._cache_totals[key]
            if grown > 0:
                counter.inc(grown)
                self._cache_totals[key] = int(stats[key])

    def on_finish(self, finish: FinishStat) -> None:
        requests = self._finish_reasons.get(finish.reason)
        if requests is None:
            requests = self._finish_reasons[finish.reason] = self.requests.labels(finish_reason=finish.reason)
        requests.inc()
        self.prompt_tokens.inc(finish.prompt_tokens)
        self.generation_tokens.inc(finish.completion_tokens)
        self.e2e.observe(finish.e2e)
        if finish.ttft is not None:
            self.ttft.observe(finish.ttft)
            if finish.decode_s is not None and finish.completion_tokens > 1:
                self.tpot.observe(finish.decode_s / (finish.completion_tokens - 1))
            # NOTE: the phases of the same requests as the TTFT (one aborted while queued has a receive time only)
            for value, histogram in ((finish.receive_s, self.receive_time), (finish.queue_s, self.queue_time),
                                     (finish.prefill_s, self.prefill_time)):
                if value is not None:
                    histogram.observe(value)
        observe = self.accept_per_verify.observe
        for committed in finish.accept_lengths:
            observe(committed)

    def on_step(self, stats: StepStats, num_queued: int) -> None:
        self.num_running.set(stats.num_running)
        self.num_queued.set(num_queued)
        self._last_step = stats
        if stats.detailed:
            self._last_detail = stats

    def _apply_last_step(self) -> None:
        stats = self._last_step
        if stats is None:
            return
        total, free = stats.kv_total, stats.kv_free
        self.kv_total.set(total)
        self.kv_free.set(free)
        self.kv_usage.set((total - free) / total if total else 0.0)
        stats = self._last_detail
        if stats is None:
            return
        if stats.spec_histogram is not None:
            self.set_spec_stats(stats.spec_histogram)
        if stats.kernel_compiles_after_startup is not None:
            self.kernel_compiles.set(stats.kernel_compiles_after_startup)
        if stats.verify_lengths is not None:
            self.set_verify_lengths(stats.verify_lengths)
        for position, rate in enumerate(stats.position_rates or [], 1):
            self.verify_position_rate.labels(position=str(position)).set(rate)

    def set_startup(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self.startup_seconds.labels(phase=phase).set(value)

    def set_verify_lengths(self, lengths: list[VerifyLengthStat]) -> None:
        for stat in lengths:
            label = str(stat.batch_size)
            self.verify_length.labels(batch_size=label).set(stat.num_draft_tokens)
            if stat.expected_tokens is not None:
                self.verify_expected_tokens.labels(batch_size=label).set(stat.expected_tokens)
            if stat.cycle_ms is not None:
                self.verify_cycle_ms.labels(batch_size=label).set(stat.cycle_ms)

    def set_spec_stats(self, histogram: list[int]) -> None:
        """`histogram[k]` = verifies that committed k tokens; draft position j is accepted when k > j."""
        verifies = sum(histogram)
        if not verifies:
            return
        self.avg_accept.set(sum(k * n for k, n in enumerate(histogram)) / verifies)
        for position in range(1, len(histogram) - 1):
            accepted = sum(histogram[position + 1:])
            self.position_accept.labels(position=str(position)).set(accepted / verifies)

    def render(self) -> bytes:
        self._apply_last_step()
        return generate_latest(self.registry)
