"""`blockspec serve` flags: SGLang's names, mapped onto EngineConfig plus the HTTP server's own settings."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from blockspec.config.chat_templates import CHAT_TEMPLATES
from blockspec.config.cli_help import DefaultsHelpFormatter
from blockspec.config.engine_config import EngineConfig
from blockspec.config.flags import ENGINE_FLAGS
from blockspec.server.compat_flags import add_compat_arguments, apply_compat_flags
from blockspec.server.tool_calls import PARSERS as TOOL_CALL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 20.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0  # NOTE: the 16 MiB body limit at 1 MB/s takes 17 s
DEFAULT_MAX_CONNECTIONS = 1000  # NOTE: below the usual 1024 open-file limit, which also covers sockets and files
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
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE
    api_server_count: int = 1
    tool_call_parser: Optional[str] = None  # tool_calls.PARSERS; None: requests with tools get 400


@dataclass
class ServeArgs:
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig keyword arguments
    server: ServerSettings = field(default_factory=ServerSettings)
    notes: list[str] = field(default_factory=list)  # what accepted SGLang flags do here, printed at start-up


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _engine_flag(field: dataclasses.Field[Any], field_type: Any) -> tuple[str, dict[str, Any]]:
    """The argparse flag of one EngineConfig field: its type and default from the field, the rest from ENGINE_FLAGS."""
    flag = ENGINE_FLAGS[field.name]
    kwargs: dict[str, Any] = {"help": flag.help}
    value_type = field_type
    if typing.get_origin(field_type) is typing.Union:  # NOTE: Optional[X]: the flag takes an X
        value_type = next(t for t in typing.get_args(field_type) if t is not type(None))
    if value_type is bool:
        kwargs["action"] = "store_true"  # NOTE: every switch defaults to off
    elif typing.get_origin(value_type) is list:
        kwargs.update(type=typing.get_args(value_type)[0], nargs="+")
    elif value_type in (int, float):
        kwargs["type"] = value_type
    if flag.fold_case is not None:
        kwargs["type"] = flag.fold_case
    if flag.choices is not None:
        kwargs["choices"] = flag.choices
    if flag.required:
        kwargs["required"] = True
    elif value_type is not bool and not flag.unset_by_default and field.default not in (dataclasses.MISSING, None):
        kwargs["default"] = field.default
    return _flag(field.name), kwargs


def _engine_flags() -> list[tuple[str, dict[str, Any]]]:
    """Every EngineConfig field with an entry in ENGINE_FLAGS, in that table's order (the --help order)."""
    fields = {field.name: field for field in dataclasses.fields(EngineConfig)}
    types = typing.get_type_hints(EngineConfig)
    return [_engine_flag(fields[name], types[name]) for name in ENGINE_FLAGS]


_ENGINE_FLAGS = _engine_flags()

_SERVER_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--host", dict(default="127.0.0.1", help="address to listen on (default 127.0.0.1)")),
    ("--port", dict(type=int, default=30000, help="0 picks a free port")),
    ("--api-key", dict(help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics")),
    ("--max-queued-requests", dict(type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                                   help="waiting requests beyond it get 503")),
    ("--served-model-name", dict(help="model id reported by /v1/models (default: the model directory's name, or the "
                                      "hub id; requests may name the --model-path too)")),
    ("--log-level", dict(default="warning", type=str.lower, choices=LOG_LEVELS,
                         help="info and debug add an access log line per request (default warning)")),
    ("--tool-call-parser", dict(
        choices=TOOL_CALL_PARSERS,
        help="the model's tool-call format: llama3 (Llama-3.x JSON) or qwen3 (Hermes-style <tool_call>); default "
             "none: chat requests with tools get 400")),
    ("--max-request-bytes", dict(
        type=int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="request bodies larger than this get 413 (default 16 MiB, far above any context length of text)")),
    ("--shutdown-grace-s", dict(
        type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
        help="on SIGTERM/SIGINT, in-flight requests get this long to finish; then streams end with an SSE error "
             "event and the others get 503 (default 20: below Kubernetes' 30 s from SIGTERM to SIGKILL)",
    )),
    ("--header-timeout-s", dict(
        type=float, default=DEFAULT_HEADER_TIMEOUT_S,
        help="a connection must deliver a complete request head this long after it opens or its last response "
             "ends; else it is closed, with a 408 if it sent part of one (default 10)",
    )),
    ("--body-timeout-s", dict(
        type=float, default=DEFAULT_BODY_TIMEOUT_S,
        help="once a request head is in, its whole body must arrive within this long; else the connection is "
             "closed with a 408 (default 60)",
    )),
    ("--max-connections", dict(
        type=int, default=DEFAULT_MAX_CONNECTIONS,
        help="open connections per HTTP server process; one over it is answered 503 and closed (default 1000)",
    )),
    ("--timeout-keep-alive", dict(
        type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
        help="seconds an idle keep-alive connection stays open (uvicorn's, default 5)")),
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
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP (OpenAI- and SGLang-compatible).",
                                     formatter_class=DefaultsHelpFormatter)
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
    notes = apply_compat_flags(values, engine, parser)
    if engine["max_prefill_wait_steps"] is None:
        # NOTE: DFlash serving keeps more of the offline engine's throughput with arrivals held one step (fewer, larger
        # extend steps, each of which stalls every running cycle); measured in docs/performance.md
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
    if not (math.isfinite(server.body_timeout_s) and server.body_timeout_s > 0):
        parser.error(f"--body-timeout-s must be a finite number > 0, got {server.body_timeout_s}")
    if server.max_connections < 1:
        parser.error(f"--max-connections must be >= 1, got {server.max_connections}")
    if not 1 <= server.api_server_count <= 64:
        parser.error(f"--api-server-count must be in [1, 64], got {server.api_server_count}")
    if server.timeout_keep_alive < 1:
        parser.error(f"--timeout-keep-alive must be >= 1, got {server.timeout_keep_alive}")
    template_parser = CHAT_TEMPLATES.get(engine["chat_template"] or "")
    if template_parser is not None and server.tool_call_parser != template_parser:
        notes.append(f"--chat-template {engine['chat_template']} asks the model for tool calls in the format "
                     f"--tool-call-parser {template_parser} reads; pass it, or requests with tools are not parsed")
    try:
        EngineConfig.from_kwargs(**engine)
    except ValueError as exc:
        parser.error(_flagify(str(exc)))
    return ServeArgs(engine=engine, server=server, notes=notes)


def usable_cpu_count() -> Optional[int]:
    """The CPUs this process may run on (a container's limit), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def default_api_server_count(device: str, cpu_count: Optional[int]) -> int:
    """HTTP server processes when --api-server-count is not given: on a GPU one per 4 CPU cores, at most 4; else 1.
    NOTE: on a GPU one HTTP process cannot keep up with a small model's engine (measured in docs/performance.md); on
    a CPU the engine, not HTTP, is the bottleneck."""
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
