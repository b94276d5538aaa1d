"""ServerMetrics: per-step work is deferred to the scrape, and the counted accept-length histogram reads as a
Prometheus histogram with the same buckets, count and sum as observing each verify would give."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from blockspec.engine import wire
from blockspec.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics, family: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    for parsed in text_string_to_metric_families(metrics.render().decode()):
        if parsed.name == family:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parsed.samples}
    raise AssertionError(f"{family} not rendered")


def _finish(accepts: list[int]) -> wire.FinishStat:
    return wire.FinishStat("length", 8, sum(accepts), 0.5, 0.05, 0.45, accepts, 0.001, 0.002, 0.047)


def test_accept_length_histogram_counts_every_verify() -> None:
    metrics = ServerMetrics(max_accept_length=4)
    metrics.on_finish(_finish([1, 3, 3, 4]))
    metrics.on_finish(_finish([2, 9]))  # NOTE: 9 > max: only the +Inf bucket holds it
    samples = _samples(metrics, "blockspec_spec_accept_length_per_verify")
    buckets = {dict(labels)["le"]: value for (name, labels), value in samples.items() if name.endswith("_bucket")}
    assert buckets == {"1.0": 1, "2.0": 2, "3.0": 4, "4.0": 5, "+Inf": 6}
    assert samples[("blockspec_spec_accept_length_per_verify_count", ())] == 6
    assert samples[("blockspec_spec_accept_length_per_verify_sum", ())] == 22


def test_ttft_phases_and_finish_reasons() -> None:
    metrics = ServerMetrics()
    metrics.on_finish(_finish([2]))
    # NOTE: aborted while queued: no first token, so its receive time stays out of the phases (they add up to the TTFT)
    metrics.on_finish(wire.FinishStat("abort", 8, 0, 0.1, None, None, [], receive_s=0.003))
    text = metrics.render().decode()
    for phase, value in (("receive", 0.001), ("queue", 0.002), ("prefill", 0.047)):
        assert f"blockspec_request_{phase}_time_seconds_count 1.0" in text
        assert f"blockspec_request_{phase}_time_seconds_sum {value}" in text
    reasons = _samples(metrics, "blockspec_requests")
    assert reasons[("blockspec_requests_total", (("finish_reason", "length"),))] == 1
    assert reasons[("blockspec_requests_total", (("finish_reason", "abort"),))] == 1


def test_step_gauges_show_the_latest_step_when_scraped() -> None:
    metrics = ServerMetrics(max_accept_length=4)
    for rate in (0.9, 0.5):
        stats = wire.StepStats(3, 1, 0, 100, 40, [0, 1, 2, 3, 4], [], 0, [wire.VerifyLengthStat(3, 4, 2.5, 1.2)],
                               [rate, 0.4, 0.3])
        metrics.on_step(stats, num_queued=2)
    text = metrics.render().decode()
    assert "blockspec_num_running_reqs 3.0" in text and "blockspec_num_queue_reqs 2.0" in text
    assert "blockspec_token_usage 0.6" in text
    assert 'blockspec_spec_verify_position_accept_rate{position="1"} 0.5' in text
    assert 'blockspec_spec_verify_num_draft_tokens{batch_size="3"} 4.0' in text
    assert "blockspec_spec_accept_length 3.0" in text  # histogram[k] verifies committed k: 30 tokens / 10


def test_a_step_without_detail_keeps_the_last_detailed_one() -> None:
    """The engine reads its statistics every DETAIL_INTERVAL_S (StepStats.detailed); the steps between carry the
    counts alone, and a scrape then shows the counts of the latest step and the detail of the latest detailed one."""
    metrics = ServerMetrics(max_accept_length=4)
    metrics.on_step(wire.StepStats(3, 1, 0, 100, 40, [0, 1, 2, 3, 4], [], 0, [wire.VerifyLengthStat(3, 4, 2.5, 1.2)],
                                   [0.9, 0.4, 0.3]), num_queued=0)
    metrics.on_step(wire.StepStats(5, 0, 0, 100, 20, None, [], detailed=False), num_queued=0)
    text = metrics.render().decode()
    assert "blockspec_num_running_reqs 5.0" in text and "blockspec_token_usage 0.8" in text
    assert 'blockspec_spec_verify_position_accept_rate{position="1"} 0.9' in text
    assert "blockspec_spec_accept_length 3.0" in text
