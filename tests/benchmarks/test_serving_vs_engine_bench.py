"""benchmarks/serving_vs_engine.py on CPU: the flag plumbing, and one end-to-end run of the tiny shape (engine
process, then a real `python -m blockspec.serve` with streaming clients and a Poisson run) writing its JSON rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks
from benchmarks.serving_vs_engine import extra_engine_kwargs, serve_flags
from benchmarks.serving_workload import gsm8k_chat_prompts, serve_dflash_wait_steps

ROOT = Path(benchmarks.__file__).resolve().parent.parent

ROW_KEYS = {"shape", "weights", "mode", "concurrency", "engine_tok_s", "server_tok_s", "server_over_engine", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "server_accept_length", "client_procs", "clients_cpu_share", "http_cpu_share", "engine_cpu_share"}


def test_extra_flags_become_engine_kwargs_and_serve_flags() -> None:
    extra = extra_engine_kwargs(["--enable-mixed-chunk", "--cuda-graph-bs", "1", "2", "--max-queued-requests", "9"])
    assert extra == {"enable_mixed_chunk": True, "cuda_graph_bs": [1, 2]}
    flags = serve_flags({"model_path": "m", "skip_tokenizer_init": True, "tokenizer_path": None,
                         "disable_cuda_graph": False, "cuda_graph_bs": [1, 2], "speculative_simulate_accept_len": 3.2})
    assert flags == ["--model-path", "m", "--skip-tokenizer-init", "--cuda-graph-bs", "1", "2",
                     "--speculative-simulate-accept-len", "3.2"]


def test_gsm8k_prompts_are_chats_of_the_test_questions(tmp_path: Path) -> None:
    from benchmarks.greedy_drift import load_questions
    from tests.support.server_support import save_text_model

    from blockspec.tokenizer import load_tokenizer

    model = save_text_model(tmp_path / "model")
    prompts = gsm8k_chat_prompts(model, 3)
    tokenizer = load_tokenizer(model)
    questions = load_questions(None, 3)
    assert len(prompts) == 3 and len(set(map(tuple, prompts))) == 3
    for ids, question in zip(prompts, questions):
        assert question in tokenizer.decode(ids)


def test_engine_side_waits_as_the_server_does_under_dflash() -> None:
    assert serve_dflash_wait_steps([]) == 1
    assert serve_dflash_wait_steps(["--max-prefill-wait-steps", "0"]) == 0
    assert serve_dflash_wait_steps(["--api-server-count", "2", "--max-prefill-wait-steps", "4"]) == 4


def test_wait_policy_flags_reach_the_engine_side() -> None:
    extra = extra_engine_kwargs(["--max-prefill-wait-steps", "8", "--prefill-wait-policy", "cost"])
    assert extra == {"max_prefill_wait_steps": 8, "prefill_wait_policy": "cost"}


def test_merge_keeps_sources_and_tells_weights_apart(tmp_path: Path) -> None:
    from benchmarks.merge_serving_results import merge

    def result(name: str, commit: str, load_format: str, rows: list[dict[str, object]]) -> Path:
        data = {"gpu": "NVIDIA H200", "date": "2026-12-03", "commit": commit, "flags": {"extra_flags": "--x"},
                "engines": {"smollm2/dflash": {"load_format": load_format}}, "errors": [], "rows": rows}
        (tmp_path / name).write_text(json.dumps(data))
        return tmp_path / name

    old = result("a.json", "aaa", "dummy", [{"shape": "smollm2", "mode": "dflash", "concurrency": 8, "server_tok_s": 1},
                                            {"shape": "smollm2", "mode": "dflash", "concurrency": 64, "server_tok_s": 2}])
    new = result("b.json", "bbb", "auto", [{"shape": "smollm2", "mode": "dflash", "concurrency": 8, "server_tok_s": 3}])
    again = result("c.json", "ccc", "dummy", [{"shape": "smollm2", "weights": "dummy", "mode": "dflash",
                                               "concurrency": 64, "server_tok_s": 4}])
    merged = merge([old, new, again], tmp_path / "out.json")
    rows = {(r["weights"], r["concurrency"]): (r["server_tok_s"], r["commit"]) for r in merged["rows"]}
    assert rows == {("dummy", 8): (1, "aaa"), ("dummy", 64): (4, "ccc"), ("real", 8): (3, "bbb")}
    assert [s["file"] for s in merged["sources"]] == ["a.json", "b.json", "c.json"] and merged["commit"] == "aaa+bbb+ccc"
    assert set(merged["engines"]) == {"a.json:smollm2/dflash", "b.json:smollm2/dflash", "c.json:smollm2/dflash"}
    assert json.loads((tmp_path / "out.json").read_text()) == merged
    poisson = result("d.json", "ddd", "dummy", [{"shape": "smollm2", "mode": "target", "concurrency": "poisson", "rate": r,
                                                "server_tok_s": r} for r in (10.0, 20.0)])
    assert len(merge([poisson], tmp_path / "p.json")["rows"]) == 2  # two rates, two rows
    assert merge([poisson], tmp_path / "p.json")["rows"][0]["weights"] == "unknown"  # no engine entry for target
    with pytest.raises(ValueError, match="file name"):
        merge([old, tmp_path / "x" / "a.json"], tmp_path / "out.json")


def test_offline_closed_loop_keeps_the_level_in_flight() -> None:
    from types import SimpleNamespace

    from benchmarks.serving_vs_engine_support import closed_loop_tok_s

    class Scheduler:
        """Finishes its oldest request at every step; counts what it holds."""
        def __init__(self) -> None:
            self.held: list[SimpleNamespace] = []
            self.most = 0

        def add_request(self, req: SimpleNamespace) -> None:
            self.held.append(req)
            self.most = max(self.most, len(self.held))

        def step(self) -> list[SimpleNamespace]:
            return [self.held.pop(0)] if self.held else []

    scheduler = Scheduler()
    engine = SimpleNamespace(scheduler=scheduler, make_requests=lambda input_ids, sampling_params: (
        [SimpleNamespace(rid=str(i), output_ids=[0] * 3) for i in range(len(input_ids))], False))
    assert closed_loop_tok_s(engine, [[1]] * 10, 4, {}, lambda: None) > 0
    assert scheduler.most == 4 and not scheduler.held  # NOTE: refilled to 4 at every step, all 10 done


def test_help() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.serving_vs_engine", "--help"], capture_output=True,
                         text=True, check=True)
    assert "--extra-flags" in out.stdout


@pytest.mark.slow
def test_tiny_end_to_end(tmp_path: Path) -> None:
    root = ROOT
    # NOTE: one intra-op thread per process, as in the CPU suite: the engine and the server share two cores.
    env = dict(os.environ, OMP_NUM_THREADS="1", BLOCKSPEC_COMMIT="test",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    command = [sys.executable, "-m", "benchmarks.serving_vs_engine", "--shapes", "tiny", "--device", "cpu",
               "--num-prompts", "4", "--prompt-len", "12", "--max-new-tokens", "8", "--concurrency", "1,2",
               "--warmup", "2", "--warmup-new-tokens", "4", "--extra-flags=--disable-overlap-schedule",
               "--out", str(tmp_path), "--tag", "smoke", "--startup-timeout", "120"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("serving_vs_engine_*_test_smoke.json")
    assert path.with_suffix(".png").is_file()
    report = json.loads(path.read_text())
    assert report["gpu"] == "cpu" and report["commit"] == "test" and not report["errors"]
    assert report["engines"]["tiny/dflash"]["disable_overlap_schedule"] is True
    rows = report["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [
        ("dflash", 1), ("dflash", 2), ("dflash", "poisson"), ("target", 1), ("target", 2), ("target", "poisson")
    ]
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["completed"] == 4 and row["failed"] == 0
        assert row["server_tok_s"] > 0 and row["engine_tok_s"] > 0 and row["ttft_p50_ms"] > 0
        if row["concurrency"] != "poisson":  # NOTE: the closed-loop engine is the comparison; waves kept beside it
            assert row["engine_waves_tok_s"] > 0
        assert row["http_cpu_share"] > 0 and row["engine_cpu_share"] > 0 and row["clients_cpu_share"] > 0
        # NOTE: core clocks: None only where neither cpufreq nor /proc/cpuinfo says (not on Linux CI machines)
        assert row["server_engine_core_mhz"] > 0 and row["engine_core_mhz"] > 0
        assert row["http_processes"] >= 1
        assert (row["server_accept_length"] is not None) == (row["mode"] == "dflash")
        # NOTE: the engine TTFT's phases add up to it (each a mean over the same requests)
        phases = row["engine_receive_mean_ms"] + row["engine_queue_mean_ms"] + row["engine_prefill_mean_ms"]
        assert row["engine_queue_mean_ms"] >= 0 and phases == pytest.approx(row["engine_ttft_mean_ms"], rel=1e-6)
        assert row["engine_steps_per_s"] > 0 and 0 < row["extend_step_share"] <= 1
        assert row["engine_extend_step_mean_ms"] > 0 and row["engine_other_step_mean_ms"] > 0
        # NOTE: the serving loop's time outside the steps, per step: each phase ran, and all of it fits the duration
        loop_ms = [row[f"engine_{p}_per_step_ms"] for p in ("intake", "publish", "flush")]
        assert all(ms > 0 for ms in loop_ms)
        steps = row["engine_steps_per_s"] * row["duration_s"]
        assert sum(loop_ms) * steps < 1e3 * row["duration_s"]
        assert sum(row["server_forward_counts"].values()) > 0
    assert all(r["rate"] > 0 for r in rows if r["concurrency"] == "poisson")


def test_engine_phase_is_reused_for_the_same_spec_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import serving_vs_engine_support as support

    runs: list[dict] = []

    def fake_phase(spec: dict, workdir: Path, timeout: float) -> dict:
        runs.append(spec)
        return {"engine_tok_s": 100.0 * len(runs), "gpu": "cpu"}

    monkeypatch.setattr(support, "run_engine_phase", fake_phase)
    cache = tmp_path / "cache"

    def spec(workdir: Path, max_new_tokens: int = 8) -> dict:
        return {"engine": {"model_path": str(workdir / "tiny")}, "prompts": [[1, 2]], "max_new_tokens": max_new_tokens}

    first = support.cached_engine_phase(spec(tmp_path / "a"), tmp_path / "a", 1.0, cache)
    # NOTE: another run's workdir, the same shape and work: read back, not run
    again = support.cached_engine_phase(spec(tmp_path / "b"), tmp_path / "b", 1.0, cache)
    other = support.cached_engine_phase(spec(tmp_path / "c", 16), tmp_path / "c", 1.0, cache)
    uncached = support.cached_engine_phase(spec(tmp_path / "a"), tmp_path / "a", 1.0, None)
    assert len(runs) == 3
    assert (first["reused_engine_phase"], again["reused_engine_phase"], other["reused_engine_phase"]) == (False, True, False)
    assert again["engine_tok_s"] == first["engine_tok_s"] == 100.0 and other["engine_tok_s"] == 200.0
    assert uncached["reused_engine_phase"] is False and uncached["engine_tok_s"] == 300.0


def test_ab_plot_draws_one_pair_of_bars_per_variant(tmp_path: Path) -> None:
    """plot_serving_ab.py: the variants of one A/B call side by side, titled with their GPU, date and commits."""
    from benchmarks.plots import plot_serving_ab, serving_ab_variant_name

    row = {"shape": "smollm2", "mode": "dflash", "concurrency": 64, "engine_tok_s": 100.0, "server_tok_s": 90.0,
           "server_over_engine": 0.9, "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0}
    paths = []
    for commit, tag in (("aaa1111", "parent_api4"), ("bbb2222", "api4")):
        path = tmp_path / f"serving_vs_engine_2026-12-02_{commit}_ab_{tag}.json"
        path.write_text(json.dumps({"gpu": "cpu", "date": "2026-12-02", "commit": commit, "rows": [row]}))
        paths.append(path)
    assert serving_ab_variant_name(paths[0], {"commit": "aaa1111"}) == "aaa1111\nparent_api4"
    out = plot_serving_ab(paths, tmp_path / "ab.png")
    assert out.is_file() and out.stat().st_size > 1000
    with pytest.raises(SystemExit):
        empty = tmp_path / "serving_vs_engine_2026-12-02_ccc_ab_none.json"
        empty.write_text(json.dumps({"gpu": "cpu", "date": "2026-12-02", "commit": "ccc", "rows": []}))
        plot_serving_ab([empty], tmp_path / "none.png")
