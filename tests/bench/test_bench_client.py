"""The benchmark's HTTP helpers: histogram means between two /metrics scrapes, accept length between snapshots."""
from __future__ import annotations

import pytest

from typing import Any, Optional

from blockspec.evals.client import accept_length_between, compiles_between, histogram_mean_between

NAME = "blockspec_time_to_first_token_seconds"


def _scrape(total: float, count: int) -> str:
    return (f"# HELP {NAME} Arrival to first token\n{NAME}_bucket{{le=\"0.005\"}} 1.0\n"
            f"{NAME}_count {float(count)}\n{NAME}_sum {total}\n{NAME}_created 1.7e9\n")


def test_histogram_mean_between_scrapes() -> None:
    assert histogram_mean_between(_scrape(0.5, 10), _scrape(2.5, 30), NAME) == pytest.approx(0.1)
    assert histogram_mean_between(_scrape(0.5, 10), _scrape(0.5, 10), NAME) is None
    assert histogram_mean_between("", _scrape(0.3, 3), NAME) == pytest.approx(0.1)
    assert histogram_mean_between("", "", NAME) is None


def test_accept_length_between_snapshots() -> None:
    def info(committed: int, verifies: int) -> dict[str, object]:
        return {
            "internal_states": [
                {"spec_verify_ct": verifies, "avg_spec_accept_length": committed / verifies if verifies else 0.0}
            ]
        }

    before, after = info(30, 10), info(90, 30)
    value = accept_length_between(before, after)
    assert value is not None and abs(value - 3.0) < 1e-9


def test_compiles_between_counts_the_variants_compiled_in_between() -> None:
    def info(total: Optional[int], kernels: dict[str, int]) -> dict[str, Any]:
        return {"internal_states": [{"kernel_compiles_after_startup": total,
                                     "kernel_compiles_after_startup_by_kernel": kernels}]}

    before = info(2, {"rope_kernel": 2})
    after = info(5, {"rope_kernel": 3, "paged_attention_kernel": 2})
    assert compiles_between(before, after) == {
        "kernel_compiles": 3, "kernel_compiles_by_kernel": {"rope_kernel": 1, "paged_attention_kernel": 2}}
    assert compiles_between(before, before) == {"kernel_compiles": 0, "kernel_compiles_by_kernel": {}}
    assert compiles_between(info(None, {}), info(None, {}))["kernel_compiles"] is None  # Triton cannot count here
