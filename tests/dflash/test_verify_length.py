"""The adaptive-verify cost model's parts (speculative/verify_length.py, simulated_accept.py) and its metrics."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from blockspec.config.speculative_flags import accept_distribution, parse_verify_schedule
from blockspec.engine.wire import VerifyLengthStat
from blockspec.server.metrics import ServerMetrics
from blockspec.speculative.simulated_accept import SimulatedAcceptance
from blockspec.speculative.verify_length import (
    AcceptanceStats, AdaptiveVerifyLength, CycleTimes, FixedVerifyLength, default_verify_lengths,
)


def test_rates_are_unbiased_by_short_verifies() -> None:
    """Accepted counts of a full block are geometric (rate 0.7); verifies of random lengths cut them at n - 1."""
    rng = random.Random(0)
    stats = AcceptanceStats(9, half_life=1e9)
    for _ in range(20000):
        n = rng.choice([1, 2, 4, 10])
        drawn = 0
        while drawn < 9 and rng.random() < 0.7:
            drawn += 1
        stats.observe(n, [min(drawn, n - 1)])
    rates = stats.rates()
    assert all(abs(r - 0.7) < 0.03 for r in rates[:5]) and all(abs(r - 0.7) < 0.08 for r in rates), rates
    assert stats.expected_tokens(1) == 1.0
    assert stats.expected_tokens(4) == pytest.approx(1 + 0.7 + 0.49 + 0.343, abs=0.05)


def test_untried_positions_follow_the_deepest_tried_and_counts_fade() -> None:
    stats = AcceptanceStats(4, half_life=10.0, prior_rate=0.8, prior_weight=2.0)
    assert stats.rates() == pytest.approx([0.8] * 4)
    stats.observe(2, [0] * 50)  # only position 1 tried: always rejected; the untried ones follow it
    assert stats.rates()[0] < 0.1 and stats.rates()[1:] == [stats.rates()[0]] * 3
    stats.observe(5, [4] * 200)  # later: every position accepted; the old rejections have faded
    assert all(r > 0.95 for r in stats.rates())


def test_cycle_times_bucket_and_live_refinement() -> None:
    times = CycleTimes({(1, 1): 4.0, (1, 8): 6.0, (8, 1): 5.0, (8, 8): 12.0})
    assert times.cycle_ms(3, 8) == 12.0 and times.cycle_ms(100, 1) == 5.0 and times.cycle_ms(1, 8) == 6.0
    times.observe(5, 8, 20.0)  # a long context: +8 ms on the first live cycle, for every length of that bucket
    assert times.cycle_ms(8, 8) == pytest.approx(20.0) and times.cycle_ms(8, 1) == pytest.approx(13.0)
    for _ in range(100):
        times.observe(8, 1, 7.0)  # later plain decode steps say +2 ms
    assert times.cycle_ms(8, 8) == pytest.approx(14.0, abs=0.01) and times.cycle_ms(1, 8) == 6.0
    assert times.startup_ms[(8, 8)] == 12.0


def choose(policy: AdaptiveVerifyLength, stats: AcceptanceStats, batch_size: int) -> int:
    return policy.choose(batch_size, stats).num_draft_tokens


def test_adaptive_picks_the_best_expected_throughput() -> None:
    """bs 1: cycles cost about the same at every length, so the full block; bs 64: long verifies cost 3x a decode
    step, so plain decode at low acceptance and a long verify at high acceptance."""
    lengths = (1, 4, 10)
    times = CycleTimes({(1, 1): 4.6, (1, 4): 5.7, (1, 10): 5.9, (64, 1): 6.7, (64, 4): 14.0, (64, 10): 22.5})
    policy = AdaptiveVerifyLength(lengths, times, explore_every=1000)
    low = AcceptanceStats(9, prior_weight=1e-9)
    low.observe(10, [0] * 60 + [1] * 25 + [2] * 10 + [9] * 5)
    high = AcceptanceStats(9, prior_weight=1e-9)
    high.observe(10, [9] * 50 + [5] * 50)
    assert choose(policy, low, 1) == 10 and choose(policy, high, 1) == 10
    assert choose(policy, low, 64) == 1 and choose(policy, high, 64) == 10
    reason = policy.last[64].reason
    assert "expected tokens / cycle time" in reason and "22.50 ms" in reason
    described = policy.describe(high)
    assert set(described["cost_model"]) == {"1", "64"} and described["in_use"]["64"]["num_draft_tokens"] == 10


def test_adaptive_explores_neighbouring_lengths() -> None:
    times = CycleTimes({(1, 1): 1.0, (1, 4): 10.0, (1, 10): 20.0})
    policy = AdaptiveVerifyLength((1, 4, 10), times, explore_every=4)
    stats = AcceptanceStats(9)
    picks = [choose(policy, stats, 1) for _ in range(16)]
    assert picks.count(1) == 12 and picks.count(4) == 4  # best is the shortest: its only neighbour is explored
    assert policy.last[1].num_draft_tokens == 1
    # NOTE: /server_info counts what ran, explorations included, per batch size
    choose(policy, stats, 3)
    assert policy.describe(stats)["cycles_by_verify_length"] == {"1": {"1": 12, "4": 4}, "3": {"1": 1}}
    policy.reset_live()
    assert policy.describe(stats)["cycles_by_verify_length"] == {}


def test_adaptive_needs_every_time() -> None:
    with pytest.raises(ValueError, match="no measured cycle time"):
        AdaptiveVerifyLength((1, 4), CycleTimes({(1, 1): 1.0}))


def test_schedules() -> None:
    assert parse_verify_schedule("1-16:10, 17-64:4") == [(1, 16, 10), (17, 64, 4)]
    assert parse_verify_schedule("1:1,2-8:3") == [(1, 1, 1), (2, 8, 3)]
    fixed = FixedVerifyLength(parse_verify_schedule("1-16:10,17-64:4"), 10, "schedule")
    stats = AcceptanceStats(9)
    assert [fixed.choose(bs, stats).num_draft_tokens for bs in (1, 16, 17, 64)] == [10, 10, 4, 4]
    assert fixed.lengths == (4, 10)
    assert fixed.describe(stats)["cycles_by_verify_length"] == {"1": {"10": 1}, "16": {"10": 1}, "17": {"4": 1},
                                                                "64": {"4": 1}}
    assert default_verify_lengths(10) == (1, 4, 7, 10) and default_verify_lengths(16) == (1, 4, 10, 16)
    assert default_verify_lengths(2) == (1, 2)


def test_geometric_profile() -> None:
    probs = accept_distribution("geometric:6", 10)
    assert len(probs) == 10 and sum(probs) == pytest.approx(1.0)
    rate = 5 / 6
    assert probs[0] == pytest.approx(1 - rate) and probs[-1] == pytest.approx(rate ** 9)
    simulated = SimulatedAcceptance(None, "geometric:6", 10, torch.device("cpu"))
    assert simulated.mean_accept_length == pytest.approx(1 + sum(rate ** j for j in range(1, 10)))
    draws = simulated.accepted(20000, 10, torch.device("cpu"))
    assert draws.shape == (20000, 1) and int(draws.max()) == 9
    assert float(draws.float().mean()) + 1 == pytest.approx(simulated.mean_accept_length, abs=0.05)
    assert int(simulated.accepted(1000, 3, torch.device("cpu")).max()) == 2  # a verify of 3 accepts at most 2


def test_histogram_profile_folds_into_the_block(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"spec_accept_length_histogram": [0, 4, 2, 2, 1, 1]}))
    assert accept_distribution(str(path), 3) == pytest.approx([0.4, 0.2, 0.4])  # committed 3..5: all proposals
    assert accept_distribution(str(path), 8) == pytest.approx([0.4, 0.2, 0.2, 0.1, 0.1, 0, 0, 0])
    path.write_text(json.dumps([0, 0, 0]))
    with pytest.raises(ValueError, match="has no verifies"):
        accept_distribution(str(path), 4)
    path.write_text(json.dumps({"other": 1}))
    with pytest.raises(ValueError, match="no list of counts"):
        accept_distribution(str(path), 4)


def test_constant_simulation_is_cut_by_the_verify_length() -> None:
    simulated = SimulatedAcceptance(4.0, None, 10, torch.device("cpu"))
    assert simulated.accepted(2, 10, torch.device("cpu")).tolist() == [[3], [3]]
    assert simulated.accepted(2, 2, torch.device("cpu")).tolist() == [[1], [1]]


def test_demo_profile_ships() -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks/profiles/smollm2_demo_draft_gsm8k.json"
    probs = accept_distribution(str(path), 10)
    assert sum(probs) == pytest.approx(1.0) and probs[0] > 0.2


def test_metrics_show_the_verify_length_per_batch_size() -> None:
    metrics = ServerMetrics(max_accept_length=10)
    metrics.set_verify_lengths([VerifyLengthStat(1, 10, 3.2, 5.9), VerifyLengthStat(64, 1, 1.0, None)])
    text = metrics.render().decode()
    assert 'blockspec_spec_verify_num_draft_tokens{batch_size="1"} 10.0' in text
    assert 'blockspec_spec_verify_num_draft_tokens{batch_size="64"} 1.0' in text
    assert 'blockspec_spec_verify_expected_tokens{batch_size="1"} 3.2' in text
    assert 'blockspec_spec_verify_cycle_ms{batch_size="1"} 5.9' in text
