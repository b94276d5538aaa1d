"""Helpers for the server / CLI / eval tests: a tiny Llama with a real (tiny, locally trained) tokenizer and chat
template, SSE parsing, and polling the server until it is idle."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import httpx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.support.tiny_models import save_tiny_model

if TYPE_CHECKING:
    import openai

    from blockspec.server import BackgroundServer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Question: Janet has 3 apples and buys 4 more. How many apples does she have? Answer: 3 + 4 = 7 apples. #### 7",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = $ % , . ? ! : ;",
]


def save_text_model(directory: Path, max_position_embeddings: int = 4096) -> Path:
    """Tiny random Llama whose vocabulary is a byte-level BPE trained here (≈320 tokens, EOS = </s>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    save_tiny_model(
        "llama", directory, vocab_size=len(fast), max_position_embeddings=max_position_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return directory


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """Decoded `data:` payloads of an SSE stream; "[DONE]" stays a string."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(base_url: str, timeout: float = 20.0, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Polls /server_info until no request runs or waits and every KV slot is free; returns the last answer."""
    deadline = time.monotonic() + timeout
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        info = httpx.get(base_url + "/server_info", headers=headers, timeout=10).json()
        state = info["internal_states"][0]
        kv = info["kv_cache"]
        if (
            kv["free_slots"] == kv["total_slots"]
            and not state["num_running_reqs"]
            and not state["num_waiting_reqs"]
            and not info["num_queued_requests"]
        ):
            return info
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {timeout}s: {info}")


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Value of one sample in a Prometheus text exposition (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server_process(
    args: list[str], entry: tuple[str, ...] = ("-m", "blockspec.serve")
) -> tuple[subprocess.Popen[str], str]:
    """A real `blockspec serve` process on a free port (CPU, one thread), once /health answers 200; (process, url)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, *entry, *args, "--port", str(port), "--device", "cpu", "--dtype", "float32"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read() if proc.stdout else "the server exited")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not come up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


@contextmanager
def server_process(
    args: list[str], entry: tuple[str, ...] = ("-m", "blockspec.serve")
) -> Iterator[tuple["subprocess.Popen[str]", str]]:
    """start_server_process as a context: (process, url); a server still running at the end is killed."""
    proc, url = start_server_process(args, entry)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def openai_client(server: "BackgroundServer", api_key: str = "none", timeout: float = 120) -> Iterator["openai.OpenAI"]:
    """An `openai` client on `server` for a fixture; the server must be idle again after the test."""
    import openai

    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout) as client:
        yield client
    wait_idle(server.base_url, headers={"Authorization": f"Bearer {api_key}"} if api_key != "none" else None)


def serve_qwen_dflash(root: Path, **settings: Any) -> Iterator["BackgroundServer"]:
    """A BackgroundServer on the Qwen3-vocabulary DFlash pair at `root` (the `qwen_vocab_pair` fixture), for a
    fixture."""
    from blockspec import Engine
    from blockspec.server import BackgroundServer
    from blockspec.server.args import ServerSettings

    engine = Engine(model_path=str(root / "target"), device="cpu", dtype="float32", page_size=4, max_total_tokens=8192,
                    speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "draft"))
    with BackgroundServer(engine, ServerSettings(port=0, served_model_name="tiny", **settings)) as running:
        yield running


def serve_text_model(directory: Path) -> Iterator["BackgroundServer"]:
    """A BackgroundServer (in-process engine, CPU fp32) on a fresh text model saved in `directory`, for a fixture."""
    from blockspec import Engine
    from blockspec.server import BackgroundServer
    from blockspec.server.args import ServerSettings

    model = save_text_model(directory)
    engine = Engine(model_path=str(model), device="cpu", dtype="float32", max_total_tokens=8192)
    with BackgroundServer(engine, ServerSettings(port=0)) as running:
        yield running
