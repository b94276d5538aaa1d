"""Serving benchmark: for each concurrency level, stream `num_prompts` requests and measure throughput, TTFT,
TPOT and the speculative accept length (from /server_info before and after the level).

The client speaks three ways (`backend`): "sglang" (/generate; streamed unless the namespace's `stream` is False:
then one JSON answer per request, no first-token time), "openai" (/v1/completions, streamed) and "chat"
(/v1/chat/completions, streamed; each prompt a list of chat messages)."""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

import aiohttp
import httpx
import msgspec
from aiohttp.http_exceptions import HttpProcessingError
from tqdm import tqdm

from blockspec.bench.report import LevelResult, RequestResult, summarise, write_outputs
from blockspec.config.cache_root import default_cache_root
from blockspec.evals.client import accept_length_between, auth_headers, first_model_id, get_server_info

ChatMessages = list[dict[str, str]]
Prompt = Union[str, list[int], ChatMessages]
MAX_CHUNK_BYTES = 1 << 24  # one SSE line (a /generate chunk carries the cumulative text and ids)
# NOTE: what one streamed request can fail with; msgspec.DecodeError is a ValueError, aiohttp's LineTooLong an
# HttpProcessingError (no ClientError)
CLIENT_ERRORS = (aiohttp.ClientError, HttpProcessingError, asyncio.TimeoutError, ValueError,
                 KeyError, TypeError, AttributeError)


def load_prompts(ns: argparse.Namespace, vocab_size: int) -> list[Prompt]:
    rng = random.Random(ns.seed)
    if ns.dataset_name == "random":
        low = min(10, vocab_size - 1)
        return [[rng.randrange(low, vocab_size) for _ in range(ns.random_input_len)] for _ in range(ns.num_prompts)]
    from blockspec.evals.gsm8k import default_data_path, few_shot_prefix, format_example, load_lines

    lines = load_lines(ns.dataset_path or default_data_path())
    prefix = few_shot_prefix(lines, ns.num_shots)
    pool = lines[ns.num_shots:]
    return [prefix + format_example(pool[i % len(pool)], False) for i in range(ns.num_prompts)]


def _payload(ns: argparse.Namespace, prompt: Prompt, max_new: int) -> tuple[str, dict[str, Any]]:
    if ns.backend == "chat":
        return "/v1/chat/completions", {
            "model": ns.model, "messages": prompt, "max_tokens": max_new, "temperature": ns.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ns.ignore_eos,
        }
    if ns.backend == "openai":
        body: dict[str, Any] = {
            "model": ns.model, "prompt": prompt, "max_tokens": max_new, "temperature": ns.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ns.ignore_eos,
        }
        return "/v1/completions", body
    key = "text" if isinstance(prompt, str) else "input_ids"
    params = {"max_new_tokens": max_new, "temperature": ns.temperature, "ignore_eos": ns.ignore_eos}
    return "/generate", {key: prompt, "sampling_params": params, "stream": ns.stream}


def _has_new_text(chunk: dict[str, Any]) -> bool:
    """Whether an OpenAI stream chunk carries output text (completions' `text`, chat's `delta.content`)."""
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices", []))


class _Meta(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int


class NativeChunk(msgspec.Struct):
    """The fields of a /generate stream chunk the client reads; the cumulative text and output_ids are skipped
    unparsed (their parse grew with every chunk and made the client, not the server, the limit of a level)."""

    meta_info: Optional[_Meta] = None
    error: Any = None


NATIVE_CHUNK = msgspec.json.Decoder(NativeChunk)  # one /generate stream chunk (bytes after "data: ")


def open_session(
    base_url: str, connections: int, timeout: float, api_key: Optional[str] = None
) -> aiohttp.ClientSession:
    """The benchmarks' HTTP client: aiohttp (C-accelerated parsing) keeps up with fast servers at about a third of the
    CPU per streamed chunk that httpx took, which had made the clients, not the server, the limit of a level. Paths
    are relative to `base_url` ("generate", not "/generate")."""
    return aiohttp.ClientSession(
        base_url=base_url.rstrip("/") + "/", headers=auth_headers(api_key),
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout),  # NOTE: per read, as httpx's
        read_bufsize=MAX_CHUNK_BYTES,
    )


async def one_request(
    session: aiohttp.ClientSession, ns: argparse.Namespace, prompt: Prompt, max_new: int
) -> RequestResult:
    path, body = _payload(ns, prompt, max_new)
    start = time.perf_counter()
    first: Optional[float] = None
    last = start
    gaps: list[float] = []
    prompt_tokens = output_tokens = 0
    try:
        async with session.post(path.lstrip("/"), json=body) as response:
            if response.status != 200:
                return RequestResult(False, error=f"HTTP {response.status}: {(await response.read())[:200]!r}")
            if body.get("stream") is False:
                answer = NATIVE_CHUNK.decode(await response.read())
                if answer.error is not None or answer.meta_info is None:
                    return RequestResult(False, error=str(answer.error or "an answer without meta_info"))
                end = time.perf_counter()
                # NOTE: a non-streamed answer has no first token of its own: its TTFT is the whole latency
                return RequestResult(True, end - start, end - start, answer.meta_info.prompt_tokens,
                                     answer.meta_info.completion_tokens)
            async for raw in response.content:
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                if ns.backend in ("openai", "chat"):
                    chunk = msgspec.json.decode(line[6:])
                    if "error" in chunk:
                        return RequestResult(False, error=str(chunk["error"]))
                    if chunk.get("usage"):
                        prompt_tokens, output_tokens = (
                            chunk["usage"]["prompt_tokens"],
                            chunk["usage"]["completion_tokens"],
                        )
                    if not _has_new_text(chunk):
                        continue
                else:
                    native = NATIVE_CHUNK.decode(line[6:])
                    if native.error is not None or native.meta_info is None:
                        return RequestResult(False, error=str(native.error or "a chunk without meta_info"))
                    seen, output_tokens = output_tokens, native.meta_info.completion_tokens
                    prompt_tokens = native.meta_info.prompt_tokens
                    if output_tokens <= seen:  # no new token in this chunk
                        continue
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    except CLIENT_ERRORS as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return RequestResult(True, (first or end) - start, end - start, prompt_tokens, output_tokens, tuple(gaps))


async def run_level(
    ns: argparse.Namespace, prompts: list[Prompt], concurrency: int
) -> tuple[list[RequestResult], float]:
    semaphore = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc=f"concurrency {concurrency}", disable=ns.disable_tqdm)
    async with open_session(ns.base_url, concurrency, ns.timeout, ns.api_key) as session:

        async def limited(prompt: Prompt) -> RequestResult:
            async with semaphore:
                result = await one_request(session, ns, prompt, ns.max_new_tokens)
            bar.update(1)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def run_benchmark(ns: argparse.Namespace) -> dict[str, Any]:
    info = get_server_info(ns.base_url, ns.api_key)
    if ns.backend == "openai" and ns.model is None:  # NOTE: the server 404s a model it does not serve
        ns.model = first_model_id(ns.base_url, ns.api_key)
    vocab_size = int(info.get("vocab_size") or 32000)
    prompts = load_prompts(ns, vocab_size)
    if ns.warmup > 0:
        asyncio.run(run_level(ns, prompts[: ns.warmup], min(ns.warmup, max(ns.concurrency))))
    levels: list[LevelResult] = []
    for concurrency in ns.concurrency:
        before = get_server_info(ns.base_url, ns.api_key)
        results, duration = asyncio.run(run_level(ns, prompts, concurrency))
        after = get_server_info(ns.base_url, ns.api_key)
        level = summarise(concurrency, results, duration, accept_length_between(before, after))
        levels.append(level)
        print(level.describe(), flush=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items() if k not in ("api_key", "func")}
    server = {k: info.get(k) for k in ("model_path", "speculative_algorithm", "device", "dtype", "context_length")}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": config,
        "server": server,
        "levels": [l.__dict__ for l in levels],
    }


def _concurrency_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key")
    parser.add_argument(
        "--backend", choices=("sglang", "openai"), default="sglang", help="/generate or /v1/completions"
    )
    parser.set_defaults(stream=True)  # NOTE: this command always streams (the client can also ask once per request)
    parser.add_argument("--model", help="model id for the openai backend (default: the first of /v1/models)")
    parser.add_argument("--concurrency", type=_concurrency_list, default=[1, 4, 16, 64], help="e.g. 1,4,16,64")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per concurrency level")
    parser.add_argument("--dataset-name", choices=("gsm8k", "random"), default="gsm8k")
    parser.add_argument(
        "--dataset-path", type=Path, help="GSM8K jsonl (default: the test split shipped in the package)"
    )
    parser.add_argument("--num-shots", type=int, default=0, help="few-shot examples before each GSM8K question")
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument("--warmup", type=int, default=0, help="requests sent (and ignored) before the first level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--output-dir", type=Path, default=default_cache_root() / "results" / "bench-serving",
                        help="where the JSON report and plot go ($BLOCKSPEC_CACHE or ~/.cache/blockspec, then "
                        "results/bench-serving; default: %(default)s)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--disable-tqdm", action="store_true")


def run_from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for flag, value in (
        ("--num-prompts", ns.num_prompts),
        ("--max-new-tokens", ns.max_new_tokens),
        ("--random-input-len", ns.random_input_len),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if ns.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {ns.temperature}")
    if ns.dataset_name == "gsm8k":
        from blockspec.evals.gsm8k import default_data_path

        path = ns.dataset_path or default_data_path()
        if not path.is_file():
            parser.error(f"--dataset-path: no such file {path}")
    try:
        report = run_benchmark(ns)
    except httpx.HTTPError as exc:
        print(f"blockspec bench serving: error: {exc}", file=sys.stderr)
        return 1
    json_path, plot_path = write_outputs(report, ns.output_dir, plot_png=not ns.no_plot)
    print(f"wrote {json_path}" + (f" and {plot_path}" if plot_path else ""))
    return 0 if all(level["completed"] for level in report["levels"]) else 1
