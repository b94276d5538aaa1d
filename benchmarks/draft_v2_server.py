"""benchmarks/draft_v2.py's server measurement: the demo pair through `python -m blockspec.serve` at one streaming
client, target alone and with each draft, on the demo's own prompts (GSM8K test questions in the demo wording,
greedy, each answer to its end of turn); tokens/s from the client, the accept length from /server_info."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from blockspec.evals.gsm8k import default_data_path, load_lines
from blockspec.models.smollm2 import build_messages
from blockspec.tokenizer import chat_to_ids, load_tokenizer
from serving_server import ServerProcess, log_tail
from serving_vs_engine_support import client_namespace, measure_level


@dataclass(frozen=True)
class ServerSettings:
    device: str  # "cuda" or "cpu"
    num_prompts: int = 16
    warmup_prompts: int = 2
    max_new_tokens: int = 256
    startup_timeout: float = 600.0
    request_timeout: float = 600.0

    def flags(self) -> list[str]:
        """The demo server as a user starts it on this device: Triton + bf16 + graphs on CUDA, torch + fp32 on CPU."""
        common = ["--max-running-requests", "4", "--disable-radix-cache"]
        if self.device == "cpu":
            return [*common, "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch"]
        return [*common, "--device", "cuda", "--dtype", "bfloat16", "--attention-backend", "triton",
                "--enforce-piecewise-cuda-graph", "--cuda-graph-bs", "1", "2", "4"]


def demo_prompts(model_dir: Path, settings: ServerSettings) -> tuple[list[list[int]], list[list[int]]]:
    """(measured prompts, warm-up prompts): the first test questions, then others for the warm-up."""
    tokenizer = load_tokenizer(model_dir)
    rows = load_lines(default_data_path())
    ids = [chat_to_ids(tokenizer, build_messages(r["question"])) for r in rows[:settings.num_prompts + settings.warmup_prompts]]
    return ids[:settings.num_prompts], ids[settings.num_prompts:]


def measure_one_client(
    label: str, model_dir: Path, draft: Optional[Path], settings: ServerSettings, prompts: list[list[int]],
    warmup: list[list[int]], log_dir: Path,
) -> dict[str, Any]:
    """One server, its warm-up, then the prompts one after another from one client."""
    flags = ["--model-path", str(model_dir), *settings.flags()]
    if draft is not None:
        flags += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft)]
    log_path = log_dir / f"server_{label}.log"
    ns: argparse.Namespace = client_namespace("", settings.max_new_tokens, settings.request_timeout)
    ns.ignore_eos = False  # NOTE: real answers end at their end of turn, as the demo's do
    try:
        with ServerProcess(flags, log_path, settings.startup_timeout) as server:
            ns.base_url = server.base_url
            if warmup:
                measure_level(ns, warmup, 1, 0.0, 0)
            level = measure_level(ns, prompts, 1, 0.0, 0)
    except (RuntimeError, OSError) as error:
        return {"label": label, "draft": str(draft) if draft else None, "error": f"{error}\n{log_tail(log_path)}"}
    keys = ("server_tok_s", "completed", "failed", "duration_s", "ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms",
            "server_accept_length", "first_error")
    return {"label": label, "draft": str(draft) if draft else None, "prompts": len(prompts),
            "output_tokens": round(level["server_tok_s"] * level["duration_s"]), **{k: level[k] for k in keys}}


def speedups(rows: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """Each DFlash row's tokens/s over the target-only row's (None where either failed)."""
    target = next((r for r in rows if r["label"] == "target_only" and "error" not in r), None)
    result: dict[str, Optional[float]] = {}
    for row in rows:
        if row["label"] == "target_only":
            continue
        ok = target is not None and "error" not in row and target["server_tok_s"] > 0
        result[row["label"]] = row["server_tok_s"] / target["server_tok_s"] if ok and target else None
    return result
