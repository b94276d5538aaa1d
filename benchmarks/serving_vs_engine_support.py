"""Pieces of benchmarks/serving_vs_engine.py: the model shapes (config.json files for dummy weights), the
offline-engine phase (its own process: `python -m benchmarks.serving_vs_engine_support engine SPEC OUT`) with its
continuous levels, the server process, and the client levels (closed loop from blockspec.bench.serving, Poisson
arrivals; /generate answered whole or streaming chat)."""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from benchmarks.serving_server import ROOT, ServerProcess, child_env, free_port, log_tail
from blockspec.evals.client import (
    accept_length_between, avg_accept_length, compiles_between, get_server_info, histogram_mean_between, metrics_text,
    forwards_between, steps_between,
)
from blockspec.bench.core_clock import CoreClock
from blockspec.bench.processes import http_server_pids, process_cpu_s, run_in_processes
from blockspec.bench.provenance import commit_id
from blockspec.bench.report import RequestResult, percentile
from blockspec.bench.serving import Prompt, one_request, open_session, run_level

SMOLLM2_DRAFT = ROOT / "blockspec" / "assets" / "smollm2-135m-dflash-b16"
SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0,
    bos_token_id=1, eos_token_id=2,
)
TINY = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    max_position_embeddings=1024, tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
)
TINY_DRAFT = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    max_position_embeddings=1024, rope_theta=10000.0, block_size=4, num_target_layers=4,
    dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 2]},
)
__all__ = ["ROOT", "ServerProcess", "free_port", "log_tail", "materialise", "measure_level", "run_clients",
           "run_engine_phase", "client_namespace", "flush_server_cache", "Shape", "SHAPES", "DEFAULT_ACCEPT",
           "CLIENTS"]
DEFAULT_ACCEPT = {"llama8b": 4.0, "smollm2": 3.2, "tiny": 2.0}
SHAPES = tuple(DEFAULT_ACCEPT)


@dataclass
class Shape:
    name: str
    target: Path
    draft: Optional[Path]
    vocab_size: int


def _write_config(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def materialise(name: str, root: Path, model_dir: Optional[Path], draft_dir: Optional[Path]) -> Shape:
    """The target and draft directories of a shape: config.json alone (dummy weights) unless `model_dir` /
    `draft_dir` point at real checkpoints."""
    if name == "llama8b":
        from benchmarks.step_latency import write_configs

        target, draft = write_configs(root / "llama8b")
    elif name == "smollm2":
        target, draft = _write_config(root / "smollm2", SMOLLM2), SMOLLM2_DRAFT
    elif name == "tiny":
        target, draft = _write_config(root / "tiny", TINY), _write_config(root / "tiny-draft", TINY_DRAFT)
    else:
        raise ValueError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
    target = model_dir or target
    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    return Shape(name, target, draft_dir or draft, vocab)


# NOTE: the offline engine's side of a closed-loop level of C clients (`engine_baseline: "continuous"`): an engine
# with the server's flags and max_running_requests min(C, the server's), given all N prompts of the level in one
# `Engine.generate` call: C run, the rest wait, and each that finishes is replaced in the next step (continuous
# batching, what a saturated server should reach). Until issue 49 the levels ran in waves of C prompts, each wave
# ending in a shrinking batch, which understated the engine.
Sync = Callable[[], None]


def continuous_level(make_engine: Callable[..., Any], engine_kwargs: dict[str, Any], running: int,
                     prompts: list[list[int]], warmup: list[list[int]], params: dict[str, Any],
                     warmup_new_tokens: int, sync: Sync, reads: int = 1) -> dict[str, Any]:
    """One level on a fresh engine of `running` running requests: an untimed warm-up (batch sizes this engine has not
    run may compile kernels), then `reads` timed passes, each with the prefix cache emptied first (the server's is
    before each level too) and all `prompts` in one `generate` call. Its output tok/s and wall time are the fastest
    pass's (the baseline at its best; `tok_s_reads` keeps every pass), with that pass's accept length, forwards and
    steps (`steps`: steps_between's fields, which the server's rows carry too)."""
    if reads < 1:
        raise ValueError(f"reads must be >= 1, got {reads}")
    engine = make_engine(**{**engine_kwargs, "max_running_requests": running})
    passes: list[dict[str, Any]] = []
    try:
        if warmup:
            engine.generate(input_ids=warmup, sampling_params=dict(params, max_new_tokens=warmup_new_tokens))
        for _ in range(reads):
            engine.flush_cache()
            before = engine.get_server_info()
            start = time.perf_counter()
            outputs = engine.generate(input_ids=prompts, sampling_params=params)
            sync()
            wall = time.perf_counter() - start
            after = engine.get_server_info()
            assert isinstance(outputs, list)
            tokens = sum(len(out["output_ids"]) for out in outputs)
            passes.append({"tok_s": tokens / wall, "wall_s": wall, "output_tokens": tokens,
                           "accept_length": accept_length_between(before, after),
                           "forward_counts": forwards_between(before, after)["server_forward_counts"],
                           "steps": steps_between(before, after, wall)})
    finally:
        engine.shutdown()
    best = max(passes, key=lambda one: one["tok_s"])
    return {**best, "requests": len(prompts), "max_running_requests": running,
            "tok_s_reads": [one["tok_s"] for one in passes]}


def run_engine_phase(spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    """Runs `engine_main` in a fresh process (its device memory is gone when it exits); its result dict."""
    spec_path, out_path, log_path = workdir / "engine_spec.json", workdir / "engine_out.json", workdir / "engine.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    with log_path.open("w") as log:
        command = [sys.executable, "-m", "benchmarks.serving_vs_engine_support", "engine", str(spec_path),
                   str(out_path)]
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                              timeout=timeout)
    if proc.returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"engine phase failed (exit {proc.returncode}):\n{log_tail(log_path)}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def cached_engine_phase(spec: dict[str, Any], workdir: Path, timeout: float, cache: Optional[Path]) -> dict[str, Any]:
    """`run_engine_phase`, or the result an earlier run with the same spec left in `cache` (flag variants that change
    only the server, such as --api-server-count, need the engine phase once: it takes a minute on the device). The
    result says whether it was reused (`reused_engine_phase`)."""
    if cache is None:
        return {**run_engine_phase(spec, workdir, timeout), "reused_engine_phase": False}
    # NOTE: the shapes' config.json live in this run's workdir: the spec is keyed with that prefix taken out, and
    # with the code's commit (a warm machine keeps /tmp between calls of an A/B across commits)
    text = commit_id() + json.dumps(spec, sort_keys=True).replace(str(workdir), "<workdir>")
    path = cache / f"engine_{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"
    if path.is_file():
        return {**json.loads(path.read_text()), "reused_engine_phase": True}
    result = run_engine_phase(spec, workdir, timeout)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return {**result, "reused_engine_phase": False}


def engine_main(spec_path: Path, out_path: Path) -> None:
    """The engine phase: `continuous_level` for each (concurrency, prompt count) of the spec's levels."""
    import torch

    from blockspec import Engine

    spec = json.loads(spec_path.read_text())
    prompts: list[list[int]] = spec["prompts"]
    params = {"temperature": 0.0, "max_new_tokens": spec["max_new_tokens"], "ignore_eos": True}
    device = str(spec["engine"].get("device", "auto"))
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    levels: dict[str, dict[str, Any]] = {}
    with CoreClock(os.getpid()) as clock:
        for concurrency, count in spec["levels"]:
            running = min(concurrency, spec["max_running_requests"])
            levels[str(concurrency)] = continuous_level(
                Engine, spec["engine"], running, prompts[:count], prompts[: min(spec["warmup"], running)], params,
                spec["warmup_new_tokens"], sync, spec["reads"])
    result = {
        "engine_core_mhz": clock.mean_mhz, "engine_baseline": "continuous", "engine_levels": levels,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
    }
    out_path.write_text(json.dumps(result))


CLIENTS = ("generate", "chat_stream")  # a row's `client`


def client_namespace(base_url: str, max_new_tokens: int, timeout: float, client: str = "generate",
                     stream: bool = True) -> argparse.Namespace:
    """What blockspec.bench.serving's client reads, greedy, ignore_eos: `client` "generate" is /generate with
    input_ids (streamed unless `stream` is False), "chat_stream" streaming /v1/chat/completions with messages."""
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r}; one of {', '.join(CLIENTS)}")
    return argparse.Namespace(backend="chat" if client == "chat_stream" else "sglang", stream=stream,
                              base_url=base_url, api_key=None, model=None, timeout=timeout, disable_tqdm=True,
                              max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


async def run_poisson(ns: argparse.Namespace, prompts: list[Prompt], rate: float,
                      seed: int) -> tuple[list[RequestResult], float]:
    """Requests sent at exponential gaps (mean 1/rate s), none waiting on another; (results, first send to last end)."""
    rng = random.Random(seed)
    async with open_session(ns.base_url, len(prompts), ns.timeout, ns.api_key) as session:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(session, ns, prompt, ns.max_new_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _clients(ns: argparse.Namespace, prompts: list[Prompt], concurrency: Optional[int], rate: float,
             seed: int) -> tuple[list[RequestResult], float]:
    if concurrency is None:
        return asyncio.run(run_poisson(ns, prompts, rate, seed))
    return asyncio.run(run_level(ns, prompts, concurrency))


def _clients_in_this_process(ns: argparse.Namespace, prompts: list[Prompt], concurrency: Optional[int], rate: float,
                             seed: int) -> tuple[list[RequestResult], float, float]:
    cpu = time.process_time()
    results, wall = _clients(ns, prompts, concurrency, rate, seed)
    return results, wall, time.process_time() - cpu


def _clients_results(ns: argparse.Namespace, prompts: list[Prompt], concurrency: Optional[int], rate: float,
                     seed: int) -> list[RequestResult]:
    return _clients(ns, prompts, concurrency, rate, seed)[0]


def run_clients(ns: argparse.Namespace, prompts: list[Prompt], concurrency: Optional[int], rate: float, seed: int,
                procs: int, spawn: bool = False) -> tuple[list[RequestResult], float, float]:
    """The clients spread over `procs` processes (blockspec.bench.processes): process i takes prompts i::n and its
    share of the clients (or rate/n: merged Poisson streams are one Poisson stream); the duration runs from the first
    start to the last end. Returns (results, duration, the clients' CPU seconds). One process runs here unless
    `spawn` (the server runs in this process)."""
    n = max(1, min(procs, len(prompts), concurrency or len(prompts)))
    if n == 1 and not spawn:
        return _clients_in_this_process(ns, prompts, concurrency, rate, seed)
    shares = [None if concurrency is None else concurrency // n + (i < concurrency % n) for i in range(n)]
    per_process, wall, cpu = run_in_processes(
        _clients_results, [(ns, prompts[i::n], shares[i], rate / n, seed + i) for i in range(n)])
    return [r for results in per_process for r in results], wall, cpu


def server_pids(info: dict[str, Any]) -> dict[str, list[int]]:
    """The HTTP server processes (all of --api-server-count's; the answering one alone when the engine runs in no
    process of its own) and the engine process of a /server_info answer (empty where it names none)."""
    api_pid, engine_pid = (info.get("api_server") or {}).get("pid"), info.get("engine_pid")
    http = http_server_pids(engine_pid) if engine_pid and engine_pid != api_pid else []
    return {"http": http or ([api_pid] if api_pid else []), "engine": [engine_pid] if engine_pid else []}


def cpu_s(pids: list[int]) -> Optional[float]:
    """CPU seconds the processes used so far, summed (None when any cannot be read)."""
    times = [process_cpu_s(pid) for pid in pids]
    return None if not times or None in times else sum(t for t in times if t is not None)


def flush_server_cache(base_url: str, timeout: float = 30.0) -> None:
    """Empties the server's radix cache (/flush_cache; refused while requests finish: asked again)."""
    deadline = time.monotonic() + timeout
    while httpx.post(base_url + "/flush_cache", timeout=timeout).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server's cache was not flushed in {timeout:.0f} s")
        time.sleep(0.1)


def measure_level(ns: argparse.Namespace, prompts: list[Prompt], concurrency: Optional[int], rate: float, seed: int,
                  procs: int = 1, spawn: bool = False) -> dict[str, Any]:
    """One closed-loop level (`concurrency` clients) or, with concurrency None, one Poisson run at `rate` req/s."""
    before, metrics_before = get_server_info(ns.base_url), metrics_text(ns.base_url)
    pids = server_pids(before)
    cpu_before = {name: cpu_s(group) for name, group in pids.items()}
    with CoreClock(pids["engine"][0] if pids["engine"] else os.getpid()) as clock:
        results, duration, clients_cpu = run_clients(ns, prompts, concurrency, rate, seed, procs, spawn)
    cpu_after = {name: cpu_s(group) for name, group in pids.items()}
    after, metrics_after = get_server_info(ns.base_url), metrics_text(ns.base_url)
    engine_ttft = histogram_mean_between(metrics_before, metrics_after, "blockspec_time_to_first_token_seconds")
    phases = {f"engine_{phase}_mean_ms":
              histogram_mean_between(metrics_before, metrics_after, f"blockspec_request_{phase}_time_seconds")
              for phase in ("receive", "queue", "prefill")}
    ok = [r for r in results if r.ok]
    streamed = ns.backend != "sglang" or ns.stream
    ttfts = [r.ttft for r in ok]
    gaps = [g for r in ok for g in r.chunk_gaps]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    duration = max(duration, 1e-9)
    return {
        "concurrency": "poisson" if concurrency is None else concurrency, "rate": rate if concurrency is None else None,
        "server_tok_s": sum(r.output_tokens for r in ok) / duration, "request_throughput": len(ok) / duration,
        "completed": len(ok), "failed": len(errors), "duration_s": duration,
        # NOTE: a non-streamed answer has no first token or chunks of its own: TTFT and ITL None (its whole latency
        # is e2e_p50_ms; the server's own TTFT is engine_ttft_mean_ms)
        "streamed": streamed,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3 if streamed else None,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3 if streamed else None,
        # NOTE: the server's own TTFT (submitted to the engine → first token committed) against the client's: the
        # difference is HTTP intake before the submit plus delivery of the first chunk.
        "ttft_mean_ms": sum(ttfts) / len(ttfts) * 1e3 if ttfts and streamed else None,
        "engine_ttft_mean_ms": None if engine_ttft is None else engine_ttft * 1e3,
        # NOTE: the engine TTFT's phases: server submit -> scheduler, waiting queue, first prefill step -> first token
        **{key: None if value is None else value * 1e3 for key, value in phases.items()},
        **steps_between(before, after, duration),
        **forwards_between(before, after),
        "itl_p50_ms": percentile(gaps, 50) * 1e3 if streamed else None,
        "itl_p99_ms": percentile(gaps, 99) * 1e3 if streamed else None,
        "tpot_p50_ms": percentile(tpots, 50) * 1e3, "tpot_p99_ms": percentile(tpots, 99) * 1e3,
        "e2e_p50_ms": percentile([r.latency for r in ok], 50) * 1e3,
        "mean_in_flight": sum(r.latency for r in ok) / duration,  # NOTE: Little's law over the run's own requests
        "server_accept_length": accept_length_between(before, after),
        "server_avg_accept_length": avg_accept_length(after),
        # NOTE: near `client_procs` the clients, not the server, may be what limits the level
        "client_procs": max(1, min(procs, len(prompts), concurrency or len(prompts))),
        "clients_cpu_share": clients_cpu / duration,
        # NOTE: busy shares of the server's processes over the level (about 1.0: that process is the limit). The
        # HTTP share sums the first server process and every process it started but the engine: the other servers
        # of --api-server-count (N all busy: about N) and multiprocessing's idle resource tracker.
        "http_processes": len(pids["http"]),
        **{f"{name}_cpu_share": None if cpu_before[name] is None or cpu_after[name] is None
           else (cpu_after[name] - cpu_before[name]) / duration for name in ("http", "engine")},
        # NOTE: the server's engine process's core clock over the level, against the offline engine's
        # (engine_core_mhz): a host-bound engine among busy processes may run at a lower clock than alone
        "server_engine_core_mhz": clock.mean_mhz,
        "first_error": errors[0] if errors else "",
        **compiles_between(before, after),
    }


if __name__ == "__main__":
    if sys.argv[1:2] != ["engine"] or len(sys.argv) != 4:
        sys.exit("usage: python -m benchmarks.serving_vs_engine_support engine SPEC.json OUT.json")
    engine_main(Path(sys.argv[2]), Path(sys.argv[3]))
