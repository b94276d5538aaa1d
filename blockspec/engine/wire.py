"""Messages between the server process and the engine process (ZeroMQ frames, msgspec/msgpack encoded)."""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


# ---- server -> engine ------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    stream: bool
    arrival_time: float  # time.monotonic() in the server process (one clock for every process of a host)
    top_logprobs_num: Optional[int] = None  # None: no logprobs (Req.top_logprobs_num)
    frontend: int = 0  # which HTTP server process sent it (--api-server-count): its deltas go back there


class Abort(msgspec.Struct, tag=True):
    rid: str


class Fail(msgspec.Struct, tag=True):
    """End every request in flight that `frontend` sent (all of them when None) with `message` (503)."""

    message: str
    frontend: Optional[int] = None


class Call(msgspec.Struct, tag=True):
    """Run the Engine method `name` between two steps; answered by a CallResult with the same `call_id`."""

    call_id: int
    name: str
    frontend: int = 0


class Stop(msgspec.Struct, tag=True):
    pass


ToEngine = Union[AddRequest, Abort, Fail, Call, Stop]


# ---- engine -> server ------------------------------------------------------------------------
class EngineInfo(msgspec.Struct):
    """What the server process needs to know of the engine: limits for validation, names for the API."""

    model_path: str
    tokenizer_path: str
    trust_remote_code: bool
    has_tokenizer: bool
    context_length: int
    vocab_size: int
    total_slots: int
    slots_per_decode: int
    decode_slots_per_req: int
    max_running_requests: int
    pid: int
    chat_template: Optional[str] = None  # EngineConfig.chat_template: the HTTP processes' tokenizers use it too
    startup: dict[str, Any] = msgspec.field(default_factory=dict)  # Engine.startup.as_dict()


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo


class LoadFailed(msgspec.Struct, tag=True):
    message: str


class DeltaOut(msgspec.Struct, array_like=True):
    """New output of request `rid` since its previous DeltaOut; `output` or `error` is set on the last one.

    NOTE: encoded as an array, not a map: a streaming step sends one per running request, and the field names made
    up half of each frame and a third of its encode time."""

    rid: str
    text: Optional[str]  # None: the engine does not detokenise this request, the server decodes `ids`
    ids: list[int]
    output: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    status: int = 500
    logprobs: Optional[list[float]] = None  # one per id, when the request asked for logprobs
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None


class FinishStat(msgspec.Struct):
    reason: str
    prompt_tokens: int
    completion_tokens: int
    e2e: float
    ttft: Optional[float]
    decode_s: Optional[float]  # first token to finish
    accept_lengths: list[int]
    # NOTE: the TTFT's phases (None where the request never got there): arrival -> the scheduler received it ->
    # admitted to its first prefill step -> first token
    receive_s: Optional[float] = None
    queue_s: Optional[float] = None
    prefill_s: Optional[float] = None


class VerifyLengthStat(msgspec.Struct):
    """DFlash's verify length at one batch size and why: the expected tokens and cycle time it was chosen on."""

    batch_size: int
    num_draft_tokens: int
    expected_tokens: Optional[float]
    cycle_ms: Optional[float]


class StepStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    handled: int  # requests taken from the socket since the previous StepStats
    kv_total: int
    kv_free: int
    spec_histogram: Optional[list[int]]
    finished: list[FinishStat]
    kernel_compiles_after_startup: Optional[int] = None  # Engine.kernel_compiles_after_startup
    verify_lengths: Optional[list[VerifyLengthStat]] = None
    position_rates: Optional[list[float]] = None  # DFlash: P(d_j accepted | tried, d_1..d_{j-1} accepted), j = 1..B-1
    # NOTE: False: spec_histogram .. position_rates were not read this step (the engine sends them every
    # engine/core.py's DETAIL_INTERVAL_S and when it goes idle); the receiver keeps the last detailed ones
    detailed: bool = True


class Outputs(msgspec.Struct, tag=True):
    deltas: list[DeltaOut]
    stats: Optional[StepStats] = None


class CallResult(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error: Optional[str] = None


class Stopped(msgspec.Struct, tag=True):
    pass


FromEngine = Union[Ready, LoadFailed, Outputs, CallResult, Stopped]

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(list[ToEngine])
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: Union[FromEngine, list[ToEngine]]) -> bytes:
    """One frame: an engine message, or the server's messages of one event-loop pass (a list, in order)."""
    return _encoder.encode(message)


def decode_to_engine(frame: bytes) -> list[ToEngine]:
    return _to_engine.decode(frame)


def decode_from_engine(frame: bytes) -> FromEngine:
    return _from_engine.decode(frame)
