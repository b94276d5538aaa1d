"""What every endpoint shares: turning HTTP input into validated Reqs, submitting them, waiting for results."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterable, Callable, Optional, Sequence, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from blockspec.engine.wire import EngineInfo
from blockspec.request import Req, RequestLimits, SamplingParams, build_requests
from blockspec.server.args import ServerSettings
from blockspec.server.batch_encoder import BatchEncoder
from blockspec.server.detokenize import OutputTexts
from blockspec.server.engine_errors import EngineStoppedError, QueueFullError
from blockspec.server.engine_loop import EngineLoop
from blockspec.server.metrics import ServerMetrics
from blockspec.server.submission import Delta, Submission
from blockspec.tokenizer import ToolsIgnoredError, backend_of, load_tokenizer, render_chat

_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)
DISCONNECT_POLL_S = 0.5
logger = logging.getLogger(__name__)
T = TypeVar("T")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        """`code`: OpenAI's error code when it has one for the case (model_not_found), else the HTTP status."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        code = self.status if self.code is None else self.code
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}


class ClientGone(Exception):
    pass


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# NOTE: JSON leaves U+0085, U+2028 and U+2029 unescaped, but line readers built on str.splitlines (httpx's
# iter_lines, Python's universal newlines) end a line there and would cut the event in two. In UTF-8 JSON these bytes
# occur only inside strings, where the \u escape means the same character.
_LINE_BREAKING = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse(payload: Any) -> bytes:
    """One server-sent event: `payload` as JSON (UTF-8; the only escapes beyond JSON's are the Unicode line
    separators above), or a bare string such as [DONE]."""
    data = payload.encode() if isinstance(payload, str) else msgspec.json.encode(payload)
    for raw, escaped in _LINE_BREAKING:
        data = data.replace(raw, escaped)  # NOTE: returns `data` itself, uncopied, when `raw` is absent
    return b"data: " + data + b"\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response without Starlette's per-response anyio task group and its second task that waits
    for the client's disconnect (stand-in, request-bound load on this CPU: 15–20 % less server CPU per request). The
    streams' own generators notice a client that left (`ServerState.deltas` polls every DISCONNECT_POLL_S and aborts
    the engine's requests: within ≈ 2 × DISCONNECT_POLL_S, where Starlette's listener took milliseconds); uvicorn
    drops writes to a closed connection meanwhile."""

    def __init__(self, content: AsyncIterable[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # NOTE: a task of its own, as Starlette's: resuming it for each chunk does not walk the middleware stack (a
        # cancel of this task reaches the one it awaits)
        await asyncio.ensure_future(self._stream(send))
        if self.background is not None:
            await self.background()

    async def _stream(self, send: Send) -> None:
        try:
            await self.stream_response(send)
        finally:
            # NOTE: cancelled while `send` waited (a full write buffer), the body generator would stay suspended at
            # its yield until the garbage collector broke the traceback's cycle; closing it now runs its cleanup (the
            # abort of the engine's requests) at once
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:  # NOTE: logged, not raised: it would replace the exception that ended the stream
                    logger.exception("closing a response stream failed")


def served_model_name(flag: Optional[str], model_path: str) -> str:
    """--served-model-name, else a readable id: a local model directory's name, or the hub id as given."""
    if flag:
        return flag
    path = Path(model_path).expanduser()
    return path.resolve().name if path.is_dir() else model_path


@dataclass
class ServerState:
    loop: EngineLoop
    settings: ServerSettings
    metrics: ServerMetrics
    # the HTTP thread's own copy: HF tokenizers aren't shared across threads
    tokenizer: Optional[PreTrainedTokenizerBase]
    context_length: int
    vocab_size: int
    created: int
    # NOTE: one thread, so the tokenizer copy is never used concurrently (HF fast tokenizers mutate their state
    # per call) and tokenization never runs on the event loop.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="blockspec-tokenize")
    )
    encoder: Optional[BatchEncoder] = None  # texts → ids, batched (a tokenizer copy of its own)
    model_name: str = ""  # the id /v1/models reports (served_model_name)

    @classmethod
    def build(cls, loop: EngineLoop, settings: ServerSettings) -> "ServerState":
        info = loop.info
        assert info is not None and loop.metrics is not None, "the engine must be launched (or in-process) first"
        tokenizer = None
        if info.has_tokenizer:
            tokenizer = load_tokenizer(info.tokenizer_path, info.trust_remote_code, info.chat_template)
        encoder = None
        if tokenizer is not None:  # NOTE: copies of their own: one on the event loop, one on the encoder's thread
            loop.texts = OutputTexts(backend_of(load_tokenizer(info.tokenizer_path, info.trust_remote_code)))
            encoder = BatchEncoder(backend_of(load_tokenizer(info.tokenizer_path, info.trust_remote_code)))
        return cls(loop, settings, loop.metrics, tokenizer, info.context_length, info.vocab_size, int(time.time()),
                   encoder=encoder, model_name=served_model_name(settings.served_model_name, info.model_path))

    @property
    def info(self) -> EngineInfo:
        assert self.loop.info is not None
        return self.loop.info

    @property
    def limits(self) -> RequestLimits:
        info = self.info
        return RequestLimits(
            info.vocab_size, info.context_length, info.total_slots, info.slots_per_decode, info.has_tokenizer
        )


    # ---- inputs --------------------------------------------------------------------------------
    async def _off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn)

    async def encode(self, texts: list[str], param: str) -> list[list[int]]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError(
                400, f"{param}: text input needs a tokenizer; this server runs with --skip-tokenizer-init", param
            )
        assert self.encoder is not None  # NOTE: built with the tokenizer
        try:
            return list(await asyncio.gather(*(self.encoder.encode(text) for text in texts)))
        except Exception as exc:
            raise APIError(400, f"{param}: the tokenizer rejected it: {exc}", param) from exc

    async def decode(self, batch: list[list[int]], param: str) -> list[str]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError(400, f"{param}: needs a tokenizer; this server runs with --skip-tokenizer-init", param)
        return await self._off_loop(lambda: [tokenizer.decode(ids) for ids in batch])

    async def chat_ids(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError(
                400, "messages: chat needs a tokenizer; this server runs with --skip-tokenizer-init", "messages"
            )
        assert self.encoder is not None
        try:
            rendered = await self._off_loop(lambda: render_chat(tokenizer, messages, tools))
            return await self.encoder.encode(rendered, add_special_tokens=False)
        except ToolsIgnoredError as exc:
            raise APIError(400, f"tools: {exc}", "tools") from exc
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", "messages") from exc
        except Exception as exc:  # a chat template may raise anything (e.g. jinja's TemplateError)
            raise APIError(400, f"messages: the chat template rejected them: {exc}", "messages") from exc

    def make_requests(
        self,
        batch: Sequence[list[int]],
        params: Sequence[dict[str, Any]],
        rids: Sequence[str],
        prompt_param: str,
        renames: Optional[dict[str, str]] = None,
        top_logprobs_num: Optional[int] = None,
    ) -> list[Req]:
        """Validates with the engine's own checks; every failure is a 400 naming the field."""
        renames = renames or {}
        for ids, p in zip(batch, params):
            max_new = p.get("max_new_tokens", SamplingParams.max_new_tokens)
            if (
                isinstance(max_new, int)
                and 0 < len(ids) < self.context_length
                and len(ids) + max_new > self.context_length
            ):
                name = renames.get("max_new_tokens", "max_new_tokens")
                raise APIError(
                    400,
                    f"{name}: {len(ids)} prompt tokens + {max_new} new tokens exceed the context length "
                    f"{self.context_length}; lower {name}",
                    name,
                )
        try:
            reqs = build_requests([list(ids) for ids in batch], list(params), list(rids), self.limits)
        except ValueError as exc:
            param = _param_of(str(exc), prompt_param, renames)
            raise APIError(400, f"{param}: {exc}", param) from exc
        for req in reqs:
            req.top_logprobs_num = top_logprobs_num
        return reqs

    def submit(self, reqs: list[Req], stream: bool) -> Submission:
        try:
            return self.loop.submit(reqs, stream)
        except QueueFullError as exc:
            raise APIError(503, str(exc), None, "server_overloaded") from exc
        except EngineStoppedError as exc:
            raise APIError(503, str(exc), None, "server_unavailable") from exc

    # ---- outputs -------------------------------------------------------------------------------
    async def deltas(self, submission: Submission, request: Request) -> AsyncGenerator[Delta, None]:
        """Yields every Delta; aborts what is unfinished when the client leaves or the consumer stops early."""
        last_poll = time.monotonic()
        try:
            while not submission.done:
                delta = await submission.next_within(DISCONNECT_POLL_S)
                if time.monotonic() - last_poll >= DISCONNECT_POLL_S:
                    last_poll = time.monotonic()
                    if await request.is_disconnected():
                        raise ClientGone()
                if delta is not None:
                    yield delta
        finally:
            self.abort_pending(submission)

    def abort_pending(self, submission: Submission) -> None:
        """Aborts the submission's unfinished requests in the engine (a no-op once all have finished)."""
        for index in submission.pending:
            self.loop.abort(submission.reqs[index].rid)

    async def collect(
        self, submission: Submission, request: Request, keep_aborted: bool = False
    ) -> list[dict[str, Any]]:
        """Final outputs in submission order; an error (or an abort, unless `keep_aborted`) becomes an APIError."""
        outputs: list[Optional[dict[str, Any]]] = [None] * len(submission.reqs)
        stream = self.deltas(submission, request)
        try:
            async for delta in stream:
                if delta.error is not None and not (keep_aborted and delta.output is not None):
                    raise APIError(delta.status, delta.error)
                if delta.output is not None:
                    outputs[delta.index] = delta.output
        finally:
            await stream.aclose()
        return [o for o in outputs if o is not None]


def _param_of(message: str, prompt_param: str, renames: dict[str, str]) -> str:
    head = message.split(" ", 1)[0]
    if head in _SAMPLING_FIELDS:
        return renames.get(head, head)
    if message.startswith("stop strings"):
        return renames.get("stop", "stop")
    if "sampling" in message:
        return renames.get("sampling_params", "sampling_params")
    if "rid" in message:
        return "rid"
    return prompt_param


def usage(outputs: list[dict[str, Any]], choices_per_prompt: int = 1) -> dict[str, int]:
    """OpenAI usage: a prompt sampled n times counts once (outputs are grouped n per prompt)."""
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outputs[::choices_per_prompt])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_fields(output: dict[str, Any]) -> tuple[Optional[str], Any]:
    """(OpenAI finish_reason, SGLang's matched_stop)."""
    finish = output["meta_info"].get("finish_reason") or {}
    kind = finish.get("type")
    matched = finish.get("matched") if kind == "stop" else None
    return kind, matched


def get_state_of(app: FastAPI) -> ServerState:
    state: ServerState = app.state.blockspec
    return state


def get_state(request: Request) -> ServerState:
    """The server state of the app that is answering `request` (a FastAPI dependency of the routers)."""
    return get_state_of(request.app)
