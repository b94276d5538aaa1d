"""benchmarks/prefix_cache.py on CPU: the workloads it builds (shared prefixes, multi-turn follow-ups), the goal
arithmetic, and one end-to-end smoke run through real servers, cache off and on, writing its JSON rows and plot."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import benchmarks
from benchmarks.prefix_cache_rows import describe, folded, goals, step_counts
from benchmarks.prefix_cache_workloads import SMOKE, build_workloads, fit_ids
from tests.support.server_support import save_text_model

ROOT = Path(benchmarks.__file__).resolve().parent.parent

ROW_KEYS = {"workload", "shape", "cache", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "accept_len", "cache_hit_rate",
            "engine_steps", "engine_extend_steps", "engine_held_steps", "engine_extend_step_mean_ms",
            "engine_other_step_mean_ms", "engine_receive_mean_ms", "engine_queue_mean_ms", "engine_prefill_mean_ms"}


@pytest.fixture(scope="module")
def workloads_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefix_cache_bench")
    tokenizer = save_text_model(root / "tokenizer")
    lines = [
        {
            "question": f"Janet has {i} apples and buys {i + 3} more. How many?",
            "answer": f"{i} + {i + 3} = {2 * i + 3} #### {2 * i + 3}",
        }
        for i in range(60)
    ]
    gsm8k = root / "test.jsonl"
    gsm8k.write_text("".join(json.dumps(line) + "\n" for line in lines))
    path = root / "workloads.json"
    path.write_text(json.dumps(build_workloads(tokenizer, gsm8k, SMOKE)))
    return path


def test_workloads_share_prefixes(workloads_file: Path) -> None:
    data = json.loads(workloads_file.read_text())
    by_name = {w["name"]: w for w in data["workloads"]}
    assert set(by_name) == {"gsm8k", "sysprompt", "multiturn"}
    gsm8k, system, chats = by_name["gsm8k"]["prompts"], by_name["sysprompt"], by_name["multiturn"]
    assert len(gsm8k) == SMOKE.gsm8k_questions and len({tuple(p) for p in gsm8k}) == len(gsm8k)
    common = os.path.commonprefix(gsm8k)
    assert len(common) > 0.8 * min(len(p) for p in gsm8k)  # the five shots
    shared = os.path.commonprefix(system["prompts"] + system["warmup"])
    assert len(shared) >= SMOKE.system_tokens and len(system["prompts"]) == SMOKE.system_questions
    assert system["concurrency"] == SMOKE.system_questions  # all questions at once
    assert len(chats["follow_ups"]) == SMOKE.turns - 1 and all(len(t) == SMOKE.chats for t in chats["follow_ups"])
    assert fit_ids([5, 600, 49151], 512, 49152) == [10 + 5 % 502, 10 + 600 % 502, 10 + 49151 % 502]
    assert fit_ids([5, 6], 512, 320) == [5, 6]


def test_goals_compare_on_with_off() -> None:
    def row(workload: str, cache: str, tok_s: float, ttft: float, accept: float) -> dict:
        return {
            "workload": workload,
            "shape": "s",
            "cache": cache,
            "tok_s": tok_s,
            "ttft_p50_ms": ttft,
            "accept_len": accept,
        }

    rows = [row("gsm8k", "off", 100, 50, 3.0), row("gsm8k", "on", 160, 10, 3.0),
            row("sysprompt", "off", 100, 500, 3.0), row("sysprompt", "on", 120, 60, 3.1)]
    by_workload = {g["workload"]: g for g in goals(rows)}
    assert by_workload["gsm8k"]["goal_tok_s_met"] and by_workload["gsm8k"]["goal_accept_met"]
    assert by_workload["sysprompt"]["ttft_p50_on_over_off"] == pytest.approx(0.12)
    assert not by_workload["sysprompt"]["goal_ttft_met"] and not by_workload["sysprompt"]["goal_accept_met"]


def test_step_counts_are_differences() -> None:
    def info(steps: int, extends: int, held: int) -> dict:
        return {"internal_states": [{"num_steps": steps, "num_extend_steps": extends, "num_steps_arrivals_held": held}]}

    assert step_counts(info(10, 2, 1), info(25, 5, 4)) == {"engine_steps": 15, "engine_extend_steps": 3,
                                                            "engine_held_steps": 3}
    assert step_counts({"internal_states": [{}]}, info(1, 1, 1))["engine_steps"] is None
    row = {"workload": "gsm8k", "shape": "s", "cache": "on", "tok_s": 1.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0,
           "accept_len": None, "cache_hit_rate": 0.5, "requests": 1, "failed": 0, "engine_ttft_mean_ms": None,
           "kernel_compiles": 0, "kernel_compiles_by_kernel": {}, "engine_steps": 15, "engine_extend_steps": 3,
           "engine_held_steps": 3, "engine_extend_step_mean_ms": 2.5, "engine_other_step_mean_ms": None}
    assert "steps 15 (extend 3, held 3) ms extend 2.50 other -" in describe(row)


def test_repeats_fold_into_medians() -> None:
    def sample(tok_s: float, ttft: float, accept: float, steps: int) -> dict:
        return {"tok_s": tok_s, "ttft_p50_ms": ttft, "accept_len": accept, "cache_hit_rate": 0.5, "failed": 0,
                "requests": 64, "engine_steps": steps}

    row = folded([sample(300.0, 9.0, 2.0, 30), sample(100.0, 5.0, 1.0, 10), sample(200.0, 7.0, 3.0, 20)])
    assert (row["tok_s"], row["ttft_p50_ms"], row["accept_len"], row["engine_steps"]) == (200.0, 7.0, 2.0, 20)
    assert row["repeats"] == 3 and row["requests"] == 192 and row["tok_s_samples"] == [300.0, 100.0, 200.0]
    assert folded([sample(1.0, 2.0, 3.0, 4)])["tok_s_samples"] == [1.0]
    with pytest.raises(ValueError, match="no samples"):
        folded([])


@pytest.mark.slow
def test_only_selects_workloads(workloads_file: Path) -> None:
    from benchmarks.prefix_cache import selected
    from benchmarks.prefix_cache_workloads import Workload

    workloads = [Workload(**w) for w in json.loads(workloads_file.read_text())["workloads"]]
    assert [w.name for w in selected(workloads, "")] == ["gsm8k", "sysprompt", "multiturn"]
    assert [w.name for w in selected(workloads, " sysprompt,gsm8k")] == ["gsm8k", "sysprompt"]
    with pytest.raises(SystemExit, match="unknown"):
        selected(workloads, "sysprompt,fewshot")


def test_smoke_end_to_end(workloads_file: Path, tmp_path: Path) -> None:
    root = ROOT
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    command = [sys.executable, "-m", "benchmarks.prefix_cache", "--smoke", "--workloads", str(workloads_file),
               "--commit", "test", "--out", str(tmp_path), "--startup-timeout", "120", "--repeats", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("prefix_cache_*_test.json")
    assert path.with_suffix(".png").is_file()
    report = json.loads(path.read_text())
    assert report["gpu"] == "cpu" and report["commit"] == "test" and not report["errors"]
    rows = report["rows"]
    assert [(r["cache"], r["workload"]) for r in rows] == [
        (cache, workload) for cache in ("off", "on") for workload in ("gsm8k", "sysprompt", "multiturn")
    ]
    for r in rows:
        assert ROW_KEYS <= set(r) and r["failed"] == 0 and r["tok_s"] > 0 and r["accept_len"] is not None
        assert (r["cache_hit_rate"] > 0) == (r["cache"] == "on")
        assert r["engine_steps"] > 0 and 0 < r["engine_extend_steps"] <= r["engine_steps"]
        parts = r["engine_receive_mean_ms"] + r["engine_queue_mean_ms"] + r["engine_prefill_mean_ms"]
        assert r["engine_prefill_mean_ms"] > 0 and parts == pytest.approx(r["engine_ttft_mean_ms"], rel=0.02, abs=0.5)
        assert r["repeats"] == 2 and len(r["tok_s_samples"]) == 2 and min(r["tok_s_samples"]) <= r["tok_s"]
    assert len(report["goals"]) == 3
    assert all(g["accept_len_rel_diff"] == 0.0 for g in report["goals"])  # fp32 CPU, greedy: identical verifies


def _serve_children(parent: int) -> list[int]:
    """Pids of `blockspec.serve` processes whose parent is `parent` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"blockspec.serve" in command:
            found.append(int(entry.name))
    return found


def test_sigterm_stops_the_server_it_started(workloads_file: Path, tmp_path: Path) -> None:
    """`timeout` cut a device run of this benchmark and its server (a session of its own) kept the GPU's memory:
    SIGTERM must stop the server before the benchmark exits."""
    root = ROOT
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    command = [sys.executable, "-m", "benchmarks.prefix_cache", "--smoke", "--workloads", str(workloads_file),
               "--commit", "test", "--out", str(tmp_path), "--startup-timeout", "120", "--no-plot", "--repeats", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        servers: list[int] = []
        while not servers and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            servers = _serve_children(proc.pid)
        assert servers, "the benchmark never started its server"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
        assert not any(Path(f"/proc/{pid}").exists() and b"blockspec.serve" in Path(f"/proc/{pid}/cmdline").read_bytes()
                       for pid in servers)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_servers_run_extends_as_the_documented_serve_command_does(tmp_path: Path) -> None:
    from benchmarks.prefix_cache import build_parser, serve_flags, shape_kwargs

    documented, _, _ = shape_kwargs("tiny", tmp_path, build_parser().parse_args([]))
    assert "--enforce-piecewise-cuda-graph" in serve_flags(documented)
    eager, _, _ = shape_kwargs("tiny", tmp_path, build_parser().parse_args(["--eager-extend"]))
    assert "--enforce-piecewise-cuda-graph" not in serve_flags(eager)
