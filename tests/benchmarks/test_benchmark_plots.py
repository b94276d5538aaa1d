"""benchmarks/plots.py: a result JSON is drawn by the kind its file name starts with (the longest kind first), and a
name of no known kind is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.plots import PLOTTERS, plot_file

IDENTITY = {"gpu": "cpu", "date": "2026-12-04", "commit": "test"}


def test_a_result_is_drawn_by_its_kind_beside_its_json(tmp_path: Path) -> None:
    rows = [{"spec": True, "bs": 1, "context": 512, "new_cycle_ms": [5.0, 5.1], "parent_cycle_ms": [5.2, 5.0]}]
    summary = {**IDENTITY, "new_commit": "b", "parent_commit": "a", "rows": rows}
    ab = tmp_path / "step_latency_ab_2026-12-04_b_vs_a.json"  # NOTE: step_latency_* too: the A/B kind must win
    ab.write_text(json.dumps(summary))
    assert plot_file(ab) == ab.with_suffix(".png") and ab.with_suffix(".png").is_file()
    evict = tmp_path / "radix_evict_2026-12-04_test.json"
    evict.write_text(json.dumps({**IDENTITY, "settings": {"rows": 8},
                                 "rows": [{"cached_sequences": n, "us_per_step_median": 2.0 * n} for n in (1, 2)]}))
    assert plot_file(evict).is_file()


def test_kinds_are_tried_longest_first_and_unknown_names_refused(tmp_path: Path) -> None:
    kinds = list(PLOTTERS)
    assert kinds.index("step_latency_ab") < kinds.index("step_latency")
    with pytest.raises(SystemExit, match="no plot for this kind"):
        plot_file(tmp_path / "unknown_2026-12-04.json")


def test_dflash2_draws_the_cycle_and_the_heldout_drafts(tmp_path: Path) -> None:
    rows = [{"shape": "s", "bs": bs, "draft_arch": arch, "cycle_ms": 1.0 + bs / 64}
            for arch in ("dflash", "dflash2") for bs in (1, 16)]
    heldout = [{"draft": "v6", "gsm8k_accept": 4.2, "general_accept": 2.9, "server_c1_speedup": 2.1},
               {"draft": "v7", "gsm8k_accept": None, "general_accept": 3.0, "server_c1_speedup": None}]
    for name, report in (("dflash2_2026-12-05_a.json", {**IDENTITY, "rows": rows, "heldout": heldout}),
                         ("dflash2_2026-12-05_b.json", {**IDENTITY, "heldout": heldout})):
        path = tmp_path / name
        path.write_text(json.dumps(report))
        assert plot_file(path).is_file()


def test_moe_draws_the_serving_table(tmp_path: Path) -> None:
    """A `--parts serving` result alone: one panel of DFlash ÷ target-only per concurrency (a level without a ratio,
    left out or cut, drawn as a gap)."""
    summary = [{"client": "generate", "concurrency": c, "dflash_over_target": ratio, "engine_dflash_over_target": 1.5}
               for c, ratio in ((1, 3.0), (64, None))]
    path = tmp_path / "moe_2026-12-06_test.json"
    path.write_text(json.dumps({**IDENTITY, "shape": "tiny", "args": {"accept_len": 6.0}, "rows": [],
                                "serving": [], "serving_summary": summary}))
    assert plot_file(path) == path.with_suffix(".png") and path.with_suffix(".png").is_file()
