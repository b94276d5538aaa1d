"""The three workloads of benchmarks/prefix_cache.py as token ids, and the streaming clients that run them.

- gsm8k: 5-shot GSM8K chats (the eval's prompt: the first 5 test problems worked, then the question), N questions.
- sysprompt: one ~4k-token system prompt (reference problems with their solutions) + 32 different questions, all at
  once, after one warm-up request that shares the system prompt (a hot prefix, as on a real server).
- multiturn: 4-turn chats; turn t+1's prompt is turn t's prompt + the server's reply + the next user message.

Prompts are built once from a tokenizer (the demo's ChatML one) and GSM8K, and can be saved and loaded as JSON
(`--save-workloads` / `--workloads`), so the device needs neither. `fit_ids` folds ids into a smaller vocabulary.

`run_workload` runs a workload's turns, each by closed-loop clients spread over processes: one Python event loop that
sends 32 bodies of 4k token ids and parses their streams adds tens of ms to every TTFT (≈ 40 ms p50 against a server
that answers at once, on a 2-core CPU), which is the client's time, not the server's."""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import aiohttp
import msgspec

from blockspec.bench.processes import run_in_processes
from blockspec.bench.report import percentile
from blockspec.bench.serving import CLIENT_ERRORS, NATIVE_CHUNK, open_session
from blockspec.evals.gsm8k import few_shot_prefix, format_example, load_lines
from blockspec.models.smollm2 import SYSTEM_PROMPT


CHATML_EOS = "<|im_end|>"


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # the first turn's prompts
    concurrency: int  # closed-loop clients
    max_new_tokens: int
    warmup: list[list[int]] = field(default_factory=list)  # sent first, untimed (never flushed before the run)
    follow_ups: list[list[list[int]]] = field(default_factory=list)  # per later turn, per chat: the ids appended

    @property
    def num_requests(self) -> int:
        return len(self.prompts) * (1 + len(self.follow_ups))


@dataclass(frozen=True)
class Sizes:
    gsm8k_questions: int = 64
    gsm8k_concurrency: int = 16
    gsm8k_new_tokens: int = 128
    system_tokens: int = 4096
    system_questions: int = 32
    system_new_tokens: int = 64
    chats: int = 16
    turns: int = 4
    turn_new_tokens: int = 64


SMOKE = Sizes(gsm8k_questions=4, gsm8k_concurrency=2, gsm8k_new_tokens=8, system_tokens=256, system_questions=4,
              system_new_tokens=8, chats=2, turns=4, turn_new_tokens=6)


def build_workloads(tokenizer_path: Path, gsm8k_path: Path, sizes: Sizes) -> dict[str, Any]:
    """{"vocab_size", "eos_id", "workloads": [Workload as dict]} from a ChatML tokenizer and the GSM8K test split."""
    from blockspec.tokenizer import chat_to_ids, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    eos_id = tokenizer.convert_tokens_to_ids(CHATML_EOS)
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        raise ValueError(f"{tokenizer_path}: not a ChatML tokenizer (no {CHATML_EOS} token)")
    lines = load_lines(gsm8k_path)
    shots, pool = few_shot_prefix(lines, 5), lines[5:]
    needed = sizes.gsm8k_questions + sizes.system_questions + 1 + sizes.chats * sizes.turns
    if len(pool) < needed + 8:
        raise ValueError(f"{gsm8k_path} has {len(pool)} problems after the shots; the workloads need {needed + 8}")
    questions = iter(pool)

    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    gsm8k = [chat_to_ids(tokenizer, user(shots + format_example(next(questions), False)))
             for _ in range(sizes.gsm8k_questions)]
    system = _system_text(tokenizer, reversed(pool), sizes.system_tokens)
    asked = [next(questions)["question"] for _ in range(sizes.system_questions + 1)]
    with_system = [chat_to_ids(tokenizer, [{"role": "system", "content": system}, *user(q)]) for q in asked]
    first_turns, follow_ups = [], [[] for _ in range(sizes.turns - 1)]
    for _ in range(sizes.chats):
        chat = [next(questions)["question"] for _ in range(sizes.turns)]
        first_turns.append(chat_to_ids(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT}, *user(chat[0])]))
        for turn, question in enumerate(chat[1:]):
            # NOTE: ChatML after the assistant's reply, whose <|im_end|> the runner adds when the reply lacks it
            text = f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            follow_ups[turn].append(list(tokenizer.encode(text, add_special_tokens=False)))
    workloads = [
        Workload("gsm8k", gsm8k, sizes.gsm8k_concurrency, sizes.gsm8k_new_tokens),
        Workload("sysprompt", with_system[1:], len(with_system) - 1, sizes.system_new_tokens, warmup=with_system[:1]),
        Workload("multiturn", first_turns, sizes.chats, sizes.turn_new_tokens, follow_ups=follow_ups),
    ]
    return {"vocab_size": len(tokenizer), "eos_id": eos_id, "tokenizer": str(tokenizer_path),
            "workloads": [asdict(w) for w in workloads]}


def _system_text(tokenizer: Any, problems: Any, tokens: int) -> str:
    """Reference problems with their worked solutions until the text is at least `tokens` tokens long."""
    text = "You are a careful math tutor. Reference problems with worked solutions follow.\n\n"
    for line in problems:
        if len(tokenizer.encode(text, add_special_tokens=False)) >= tokens:
            return text
        text += f"Problem: {line['question']}\nSolution: {line['answer']}\n\n"
    raise ValueError(f"not enough GSM8K problems for a {tokens}-token system prompt")


def fit_ids(ids: list[int], vocab_size: int, source_vocab: int) -> list[int]:
    """Ids of a larger vocabulary folded into [10, vocab_size) (the CPU smoke shape); unchanged when they fit.
    Equal prefixes stay equal, which is all the cache sees."""
    if source_vocab <= vocab_size:
        return ids
    return [10 + t % (vocab_size - 10) for t in ids]


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    error: str = ""


class _Final(msgspec.Struct):
    output_ids: list[int]


_FINAL = msgspec.json.Decoder(_Final)


async def stream_generate(session: aiohttp.ClientSession, ids: list[int], params: dict[str, Any]) -> Result:
    """One streamed /generate (SGLang chunks carry the cumulative output_ids: only the last chunk's are read);
    TTFT at the first chunk with a token."""
    start = time.perf_counter()
    first: Optional[float] = None
    last = b""
    try:
        body = {"input_ids": ids, "sampling_params": params, "stream": True}
        async with session.post("generate", json=body) as response:
            if response.status != 200:
                return Result(False, error=f"HTTP {response.status}: {(await response.read())[:200]!r}")
            async for raw in response.content:
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = NATIVE_CHUNK.decode(line[6:])
                if chunk.error is not None or chunk.meta_info is None:
                    return Result(False, error=str(chunk.error or "a chunk without meta_info"))
                if chunk.meta_info.completion_tokens and first is None:
                    first = time.perf_counter()
                last = line[6:]
        output = _FINAL.decode(last).output_ids if last else []
    except CLIENT_ERRORS as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    return Result(True, (first or end) - start, end - start, output)


async def closed_loop(base_url: str, prompts: list[list[int]], params: dict[str, Any], concurrency: int,
                      timeout: float) -> tuple[list[Result], float]:
    """`concurrency` clients over the prompts; results in prompt order and the wall time of the whole set."""
    semaphore = asyncio.Semaphore(concurrency)
    async with open_session(base_url, concurrency, timeout) as client:

        async def one(ids: list[int]) -> Result:
            async with semaphore:
                return await stream_generate(client, ids, params)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - start


def _closed_loop_results(base_url: str, prompts: list[list[int]], params: dict[str, Any], concurrency: int,
                         timeout: float) -> list[Result]:
    results, _ = asyncio.run(closed_loop(base_url, prompts, params, concurrency, timeout))
    return results


def closed_loop_procs(base_url: str, prompts: list[list[int]], params: dict[str, Any], concurrency: int,
                      timeout: float, procs: int) -> tuple[list[Result], float]:
    """`closed_loop` with process i taking prompts i::n and its share of the clients; results in prompt order, wall
    time from the first process's start to the last one's end."""
    n = max(1, min(procs, len(prompts), concurrency))
    if n == 1:
        return asyncio.run(closed_loop(base_url, prompts, params, concurrency, timeout))
    shares = [concurrency // n + (i < concurrency % n) for i in range(n)]
    per_process, wall, _ = run_in_processes(
        _closed_loop_results, [(base_url, prompts[i::n], params, shares[i], timeout) for i in range(n)])
    return [per_process[j % n][j // n] for j in range(len(prompts))], wall  # NOTE: process i had prompts i::n


def run_workload(base_url: str, workload: Workload, params: dict[str, Any], eos_id: int, timeout: float,
                 procs: int = 1) -> dict[str, Any]:
    """Warm-up requests (untimed), then every turn in order: tok/s over the turns' wall time, TTFT percentiles. The
    clients of a turn are spread over `procs` processes."""
    if workload.warmup:
        warmup_params = dict(params, max_new_tokens=4)
        asyncio.run(closed_loop(base_url, workload.warmup, warmup_params, len(workload.warmup), timeout))
    prompts, results, duration = workload.prompts, [], 0.0
    for turn in range(1 + len(workload.follow_ups)):
        turn_results, seconds = closed_loop_procs(base_url, prompts, params, workload.concurrency, timeout, procs)
        results += turn_results
        duration += seconds
        if turn < len(workload.follow_ups):
            prompts = [prompt + reply.output_ids + ([] if reply.output_ids[-1:] == [eos_id] else [eos_id]) + follow
                       for prompt, reply, follow in zip(prompts, turn_results, workload.follow_ups[turn])]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    output_tokens = sum(len(r.output_ids) for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok), "output_tokens": output_tokens,
        "duration_s": duration, "tok_s": output_tokens / max(duration, 1e-9),
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3, "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "e2e_p50_ms": percentile([r.latency for r in ok], 50) * 1e3,
        "first_error": next((r.error for r in results if not r.ok), ""),
        "prompt_tokens": sum(len(p) for p in workload.prompts),
    }
