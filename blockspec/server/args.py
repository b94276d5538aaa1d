"""`blockspec serve` flags: SGLang's names, mapped onto EngineConfig plus the HTTP server's own settings."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from blockspec.config.engine_config import ATTENTION_BACKENDS, EngineConfig
from blockspec.scheduler.admission import WAIT_POLICIES
from blockspec.server.compat_flags import add_compat_arguments, apply_compat_flags
from blockspec.server.tool_calls import PARSERS as TOOL_CALL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 20.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_TIMEOUT_KEEP_ALIVE = 5


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    served_model_name: Optional[str] = None
    log_level: str = "warning"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE
    api_server_count: int = 1
    tool_call_parser: Optional[str] = None  # tool_calls.PARSERS; None: requests with tools get 400


@dataclass
class ServeArgs:
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig keyword arguments
    server: ServerSettings = field(default_factory=ServerSettings)


# (flag, argparse keywords); each engine flag sets the EngineConfig field named after it.
_ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--model-path", dict(required=True, help="HF checkpoint directory of the target model, or a hub id org/name")),
    ("--tokenizer-path", dict(help="tokenizer directory (default: the model path)")),
    ("--skip-tokenizer-init", dict(action="store_true", help="serve input_ids only, no tokenizer")),
    ("--trust-remote-code", dict(action="store_true", help="accepted for SGLang compatibility")),
    ("--device", dict(default="auto", help="auto, cpu, cuda or cuda:N")),
    ("--dtype", dict(default="auto", choices=("auto", "float32", "bfloat16", "float16", "half"),
                     help="auto: bfloat16 on CUDA, float32 on CPU; half = float16 (default auto)")),
    ("--attention-backend", dict(default="auto", choices=ATTENTION_BACKENDS,
                                 help="auto: Triton on CUDA, torch on CPU (default auto)")),
    ("--page-size", dict(type=int, default=1, help="tokens per KV page (default 1)")),
    ("--max-running-requests", dict(type=int, default=64, help="requests decoding at once (default 64)")),
    ("--max-total-tokens", dict(type=int, help="KV pool size in tokens (default: from --mem-fraction-static)")),
    ("--chunked-prefill-size", dict(type=int, default=8192, help="-1 disables chunked prefill")),
    ("--max-prefill-wait-steps", dict(type=int, help="while requests decode, new arrivals wait up to N decode steps "
                                      "to be prefilled together in one extend step (default: 1 with "
                                      "--speculative-algorithm, else 0: at once)")),
    ("--prefill-wait-policy", dict(default="fixed", choices=WAIT_POLICIES, help="fixed: held arrivals wait the N steps "
                                   "of --max-prefill-wait-steps; cost: N at most, released once holding them has "
                                   "cost as much as an extend step (default fixed)")),
    ("--stream-interval", dict(type=int, default=1, help="a streaming request gets a chunk once this many new tokens "
                               "are ready, and its last one always (default 1: every step's tokens)")),
    ("--context-length", dict(type=int, help="prompt + output limit (default: the model's max_position_embeddings)")),
    ("--mem-fraction-static", dict(type=float, default=0.85, help="GPU memory share for weights + KV pool (default 0.85)")),
    ("--random-seed", dict(type=int, default=0, help="seed for dummy weights and simulated acceptance (default 0)")),
    ("--host-threads", dict(type=int, help="torch threads for the engine's host-side tensor work (default: 1 on a GPU, "
                                            "torch's default on CPU)")),
    ("--cuda-graph-bs", dict(type=int, nargs="+", help="batch sizes captured as CUDA graphs")),
    ("--disable-cuda-graph", dict(action="store_true", help="run decode / verify / draft eagerly (default: graphs on CUDA)")),
    ("--disable-overlap-schedule", dict(action="store_true", help="greedy decode: commit each step before launching the next")),
    ("--disable-radix-cache", dict(action="store_true", help="no prefix sharing: every prompt is prefilled in full")),
    ("--enable-mixed-chunk", dict(action="store_true", help="one forward carries prefill chunks with the running decode/verify")),
    ("--enforce-piecewise-cuda-graph", dict(action="store_true", help="piecewise CUDA graphs for prefill/extend")),
    ("--piecewise-eager-attention", dict(action="store_true", help="run attention eagerly between the piecewise "
     "graphs (default with Triton attention: each token bucket's whole extend forward, attentions included, is one "
     "graph)")),
    ("--piecewise-attention-max-splits", dict(type=int, default=4, help="Triton attention inside the piecewise "
     "graphs splits each program's keys up to N ways (a power of two <= 16) in token buckets too small to fill the "
     "GPU (cache-hit extends: few new tokens behind long cached prefixes); 1: never")),
    ("--piecewise-cuda-graph-max-tokens", dict(type=int, help="largest piecewise-graph token bucket (default: the "
                                                              "--chunked-prefill-size, at most 8192)")),
    ("--piecewise-cuda-graph-tokens", dict(type=int, nargs="+", help="explicit token buckets for piecewise graphs")),
    ("--cuda-graph-backend-prefill", dict(choices=("piecewise", "none"), help="piecewise = --enforce-piecewise-cuda-graph")),
    ("--tp-size", dict(type=int, default=1, help="tensor-parallel ranks (one process and GPU each; default 1)")),
    ("--speculative-algorithm", dict(type=str.upper, choices=("DFLASH",), help="DFLASH (default: none, target only)")),
    ("--speculative-draft-model-path", dict(help="z-lab format DFlash draft directory or hub id (default: none)")),
    ("--speculative-num-draft-tokens", dict(type=int, help="block size (default: the draft's block_size)")),
    ("--speculative-simulate-accept-len", dict(type=float, help="benchmarking only: force the accept length")),
    ("--speculative-simulate-accept-profile", dict(
        help="benchmarking only: draw each verify's accept length from geometric:MEAN or an accept-length histogram "
             "JSON (the /server_info layout)")),
    ("--speculative-adaptive-verify", dict(
        type=str.lower, choices=("on", "off"),
        help="verify length per batch size from measured cycle times and live acceptance (default: on when the "
             "DFlash cycle runs in CUDA graphs; on without graphs times eager cycles)")),
    ("--speculative-num-draft-tokens-per-bs", dict(
        help="fixed verify length per batch size instead, e.g. 1-16:10,17-64:4 (1 = plain target decode)")),
    ("--load-format", dict(default="auto", choices=("auto", "dummy"), help="dummy: random weights (default auto)")),
    ("--enable-deterministic-inference", dict(
        action="store_true",
        help="batch-invariant GEMM, attention and norms: a token's logits do not depend on the batch, so greedy DFlash "
             "output equals target-only output at any batch size (Triton attention, tp-size 1; costs step latency)")),
    ("--triton-attention-split-tile-size", dict(
        type=int, help="keys per KV split of the deterministic attention, a multiple of 32 (default 256)")),
]

_SERVER_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--host", dict(default="127.0.0.1", help="address to listen on (default 127.0.0.1)")),
    ("--port", dict(type=int, default=30000, help="0 picks a free port")),
    ("--api-key", dict(help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics")),
    ("--max-queued-requests", dict(type=int, default=DEFAULT_MAX_QUEUED_REQUESTS, help="waiting requests beyond it get 503")),
    ("--served-model-name", dict(help="model id reported by /v1/models (default: the model path)")),
    ("--log-level", dict(default="warning", type=str.lower, choices=LOG_LEVELS, help="info and debug add an access log line per request (default warning)")),
    ("--tool-call-parser", dict(choices=TOOL_CALL_PARSERS, help="the model's tool-call format: llama3 (Llama-3.x JSON) or "
                                "qwen3 (Hermes-style <tool_call>); default none: chat requests with tools get 400")),
    ("--max-request-bytes", dict(type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="request bodies larger than this get 413 (default 16 MiB, far above any context length of text)")),
    ("--shutdown-grace-s", dict(
        type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
        help="on SIGTERM/SIGINT, in-flight requests get this long to finish; then streams end with an SSE error event "
             "and the others get 503 (default 20: below Kubernetes' 30 s from SIGTERM to SIGKILL)",
    )),
    ("--header-timeout-s", dict(
        type=float, default=DEFAULT_HEADER_TIMEOUT_S,
        help="a connection must deliver a complete request head this long after it opens or its last response ends; "
             "else it is closed, with a 408 if it sent part of one (default 10)",
    )),
    ("--timeout-keep-alive", dict(type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE, help="seconds an idle keep-alive connection stays open (uvicorn's, default 5)")),
    ("--api-server-count", dict(
        type=int,
        help="HTTP server processes on the port (SO_REUSEPORT), each with its own event loop, tokenizer and "
             "detokenizer, all in front of one engine process (default: on a GPU, one per 4 CPU cores up to 4; "
             "else 1)",
    )),
]


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def engine_flag_names() -> dict[str, str]:
    """EngineConfig field -> CLI flag."""
    return {_dest(flag): flag for flag, _ in _ENGINE_FLAGS}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    for flag, kwargs in _ENGINE_FLAGS:
        engine.add_argument(flag, **kwargs)
    server = parser.add_argument_group("server")
    for flag, kwargs in _SERVER_FLAGS:
        server.add_argument(flag, **kwargs)
    add_compat_arguments(parser)


def build_serve_parser(prog: str = "blockspec serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP (OpenAI- and SGLang-compatible).")
    add_serve_arguments(parser)
    return parser


def _flagify(message: str) -> str:
    """Rewrites EngineConfig field names in an error message as the flags a user typed."""
    names = {**engine_flag_names(), **{_dest(flag): flag for flag, _ in _SERVER_FLAGS}}
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda m: names[m.group(1)], message)


def serve_args_from_namespace(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> ServeArgs:
    """Validates everything now; `parser.error` (exit 2) names the offending flag."""
    values = vars(ns)
    engine = {_dest(flag): values[_dest(flag)] for flag, _ in _ENGINE_FLAGS}
    if engine["cuda_graph_bs"] is None:
        engine.pop("cuda_graph_bs")
    engine["log_level"] = values["log_level"]
    if engine["dtype"] == "half":
        engine["dtype"] = "float16"
    apply_compat_flags(values, engine, parser)
    if engine["max_prefill_wait_steps"] is None:
        # NOTE: H200, 2026-12-02, 793551f, SmolLM2 shapes, DFlash, 64 clients, 4 HTTP processes, one lease: 0.89 of
        # the offline engine at 0, 0.97 at 1 (fewer, larger extend steps, each of which stalls every running cycle)
        engine["max_prefill_wait_steps"] = 1 if engine["speculative_algorithm"] else 0
    if values["api_server_count"] is None:
        values["api_server_count"] = default_api_server_count(engine["device"], usable_cpu_count())
    server = ServerSettings(**{_dest(flag): values[_dest(flag)] for flag, _ in _SERVER_FLAGS})
    if not 0 <= server.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {server.port}")
    if server.max_queued_requests < 1:
        parser.error(f"--max-queued-requests must be >= 1, got {server.max_queued_requests}")
    if server.api_key is not None and not server.api_key:
        parser.error("--api-key must not be empty")
    if server.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be >= 1, got {server.max_request_bytes}")
    if not (math.isfinite(server.shutdown_grace_s) and server.shutdown_grace_s >= 0):
        parser.error(f"--shutdown-grace-s must be a finite number >= 0, got {server.shutdown_grace_s}")
    if not (math.isfinite(server.header_timeout_s) and server.header_timeout_s > 0):
        parser.error(f"--header-timeout-s must be a finite number > 0, got {server.header_timeout_s}")
    if not 1 <= server.api_server_count <= 64:
        parser.error(f"--api-server-count must be in [1, 64], got {server.api_server_count}")
    if server.timeout_keep_alive < 1:
        parser.error(f"--timeout-keep-alive must be >= 1, got {server.timeout_keep_alive}")
    try:
        EngineConfig.from_kwargs(**engine)
    except ValueError as exc:
        parser.error(_flagify(str(exc)))
    return ServeArgs(engine=engine, server=server)


def usable_cpu_count() -> Optional[int]:
    """The CPUs this process may run on (a container's limit), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def default_api_server_count(device: str, cpu_count: Optional[int]) -> int:
    """HTTP server processes when --api-server-count is not given: on a GPU one per 4 CPU cores, at most 4; else 1.
    NOTE: on the H200 (16 cores, 2026-12-02, 793551f, SmolLM2 shapes, 64 clients) one process kept 0.89 of the
    offline engine's target-only tokens/s and four kept 1.05; on a CPU the engine, not HTTP, is the bottleneck."""
    on_gpu = device.startswith("cuda")
    if device == "auto":
        import torch

        on_gpu = torch.cuda.is_available()
    return min(4, max(1, (cpu_count or 1) // 4)) if on_gpu else 1


def parse_serve_args(argv: Optional[Sequence[str]] = None, prog: str = "blockspec serve") -> ServeArgs:
    parser = build_serve_parser(prog)
    return serve_args_from_namespace(parser.parse_args(argv), parser)


def config_fields_without_flag() -> list[str]:
    """EngineConfig fields no flag sets (log_level comes from the shared --log-level)."""
    flagged = set(engine_flag_names()) | {"log_level"}
    return [f.name for f in dataclasses.fields(EngineConfig) if f.name not in flagged]
