"""GSM8K few-shot accuracy through /v1/chat/completions (SGLang run_eval semantics).

The first `num_shots` test lines are the worked examples; the `num_examples` lines after them are scored.
A prediction is right when the last number in the reply equals the number after '####' in the reference.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx
from tqdm import tqdm

from blockspec.evals.client import (
    accept_length_between, auth_headers, avg_accept_length, first_model_id, get_server_info,
)

STOP = ["Question", "Assistant:", "<|separator|>"]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def default_data_path() -> Path:
    """The GSM8K test split shipped inside the package (MIT, blockspec/assets/gsm8k/LICENSE)."""
    return Path(__file__).resolve().parents[1] / "assets" / "gsm8k" / "test.jsonl"


def load_lines(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_example(line: dict[str, str], with_answer: bool) -> str:
    text = f"Question: {line['question']}\nAnswer:"
    return f"{text} {line['answer']}" if with_answer else text


def few_shot_prefix(lines: list[dict[str, str]], num_shots: int) -> str:
    return "".join(format_example(line, True) + "\n\n" for line in lines[:num_shots])


def last_number(text: str) -> Optional[float]:
    numbers = _NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def reference_number(answer: str) -> float:
    value = last_number(answer.split("####")[-1])
    if value is None:
        raise ValueError(f"reference answer without a number after '####': {answer!r}")
    return value


@dataclass
class GSM8KResult:
    score: float
    num_examples: int
    num_correct: int
    num_invalid: int
    num_errors: int
    latency_s: float
    output_tokens: int
    output_throughput: float
    server_avg_spec_accept_length: Optional[float]
    run_avg_spec_accept_length: Optional[float]
    samples: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> str:
        accept = "n/a" if self.run_avg_spec_accept_length is None else f"{self.run_avg_spec_accept_length:.3f}"
        if self.server_avg_spec_accept_length is not None:
            accept += f" (this run; since the server started: {self.server_avg_spec_accept_length:.3f})"
        return (
            f"Accuracy: {self.score:.3f}\nInvalid: {self.num_invalid / max(self.num_examples, 1):.3f}\n"
            f"Errors: {self.num_errors}\nLatency: {self.latency_s:.3f} s\n"
            f"Output throughput: {self.output_throughput:.3f} token/s\nAccept length: {accept}"
        )


def run_gsm8k(
    base_url: str,
    data_path: Path,
    num_examples: int = 200,
    num_threads: int = 64,
    num_shots: int = 5,
    max_tokens: int = 512,
    api_key: Optional[str] = None,
    model: Optional[str] = None,
    timeout: float = 600.0,
    progress: bool = True,
) -> GSM8KResult:
    lines = load_lines(data_path)
    if len(lines) <= num_shots:
        raise ValueError(f"{data_path} has {len(lines)} lines; need more than the {num_shots} few-shot examples")
    prefix = few_shot_prefix(lines, num_shots)
    examples = lines[num_shots:num_shots + num_examples]
    base_url = base_url.rstrip("/")
    model = model or first_model_id(base_url, api_key)
    local = threading.local()

    def ask(line: dict[str, str]) -> dict[str, Any]:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=base_url, headers=auth_headers(api_key), timeout=timeout)
        payload = {
            "model": model,
            "messages": [{"role": "user", "content": prefix + format_example(line, False)}],
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "stop": STOP,
        }
        sample: dict[str, Any] = {"question": line["question"], "reference": reference_number(line["answer"])}
        try:
            response = local.client.post("/v1/chat/completions", json=payload)
            response.raise_for_status()
            body = response.json()
            sample["reply"] = body["choices"][0]["message"]["content"]
            sample["completion_tokens"] = int(body["usage"]["completion_tokens"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            sample.update(reply=None, completion_tokens=0, error=_describe(exc))
        sample["prediction"] = last_number(sample["reply"]) if sample["reply"] is not None else None
        sample["correct"] = sample["prediction"] is not None and sample["prediction"] == sample["reference"]
        return sample

    before = get_server_info(base_url, api_key)
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        samples = list(tqdm(pool.map(ask, examples), total=len(examples), desc="gsm8k", disable=not progress))
    latency = time.perf_counter() - start
    after = get_server_info(base_url, api_key)
    output_tokens = sum(s["completion_tokens"] for s in samples)
    correct = sum(s["correct"] for s in samples)
    return GSM8KResult(
        score=correct / max(len(samples), 1),
        num_examples=len(samples),
        num_correct=correct,
        num_invalid=sum(s["prediction"] is None for s in samples),
        num_errors=sum("error" in s for s in samples),
        latency_s=latency,
        output_tokens=output_tokens,
        output_throughput=output_tokens / latency if latency > 0 else 0.0,
        server_avg_spec_accept_length=avg_accept_length(after),
        run_avg_spec_accept_length=accept_length_between(before, after),
        samples=samples,
    )


def _describe(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:300]}"
    return f"{type(exc).__name__}: {exc}"


def add_gsm8k_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key")
    parser.add_argument("--model", help="model id sent to the server (default: the first of /v1/models)")
    parser.add_argument(
        "--data-path", type=Path, help="GSM8K test.jsonl (default: the test split shipped in the package)"
    )
    parser.add_argument("--num-examples", type=int, default=200)
    parser.add_argument("--num-threads", type=int, default=64)
    parser.add_argument("--num-shots", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--output", type=Path, help="write the result (with every sample) as JSON here")
    parser.add_argument("--disable-tqdm", action="store_true")


def run_from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for flag, value in (
        ("--num-examples", ns.num_examples),
        ("--num-threads", ns.num_threads),
        ("--max-tokens", ns.max_tokens),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if ns.num_shots < 0:
        parser.error(f"--num-shots must be >= 0, got {ns.num_shots}")
    data_path = ns.data_path or default_data_path()
    if not data_path.is_file():
        parser.error(f"--data-path: no such file {data_path}")
    try:
        result = run_gsm8k(
            ns.base_url, data_path, ns.num_examples, ns.num_threads, ns.num_shots, ns.max_tokens,
            ns.api_key, ns.model, ns.timeout, progress=not ns.disable_tqdm,
        )
    except (httpx.HTTPError, ValueError) as exc:
        print(f"blockspec eval gsm8k: error: {_describe(exc)}", file=sys.stderr)
        return 1
    print(result.summary())
    if ns.output:
        ns.output.parent.mkdir(parents=True, exist_ok=True)
        ns.output.write_text(json.dumps(asdict(result), indent=2))
    return 0 if result.num_errors < result.num_examples else 1
