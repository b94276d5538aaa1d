"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional, Sequence, cast

from fastapi import APIRouter, Request

from blockspec.server.chat_tools import ChatTools, call_json, chat_tools
from blockspec.server.json_route import FastJSONRoute
from blockspec.server.logprob_format import chat_content, completion_logprobs, from_meta_info
from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from blockspec.server.state import (
    APIError, ClientGone, EventStream, ServerState, finish_fields, get_state, new_id, sse, usage,
)
from blockspec.server.submission import Submission
from blockspec.server.tool_calls import ToolCallStream

router = APIRouter(route_class=FastJSONRoute)
_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_params": "body",
            "json_schema": "response_format"}


def _max_new(
    state: ServerState, body: _SamplingFields, prompt_len: int, requested: Optional[int], default: Optional[int]
) -> int:
    if requested is not None:
        return requested
    room = max(1, state.context_length - prompt_len)
    return room if default is None else min(default, room)


def _submit(
    state: ServerState,
    body: _SamplingFields,
    batch: list[list[int]],
    requested: Optional[int],
    default: Optional[int],
    prompt_param: str,
    rid: str,
    extra: Optional[dict[str, Any]] = None,
) -> Submission:
    """Prompt i's choice j is request i * n + j (the OpenAI choice index); `extra` sampling fields go to every one."""
    n = body.n
    params = [{**body.sampling_params(_max_new(state, body, len(ids), requested, default), j), **(extra or {})}
              for ids in batch for j in range(n)]
    batch = [ids for ids in batch for _ in range(n)]
    rids = [rid] if len(batch) == 1 else [f"{rid}-{i}" for i in range(len(batch))]
    reqs = state.make_requests(batch, params, rids, prompt_param, _RENAMES, body.top_logprobs_num)
    return state.submit(reqs, body.stream)


def _choice_finish(output: dict[str, Any]) -> dict[str, Any]:
    kind, matched = finish_fields(output)
    fields: dict[str, Any] = {"finish_reason": kind, "matched_stop": matched}
    message = (output["meta_info"].get("finish_reason") or {}).get("message")
    if kind == "abort" and message:
        fields["abort_message"] = message
    return fields


def _error_event(status: int, message: str) -> bytes:
    return sse(APIError(status, message).body())


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "blockspec",
            "root": state.info.model_path, "max_model_len": state.context_length}


def _check_model(state: ServerState, model: Optional[str]) -> None:
    """As OpenAI: a request naming a model this server does not serve gets 404 invalid_request_error, code
    model_not_found (no model: the served one)."""
    if model is not None and model not in (state.model_name, state.info.model_path):
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`", "model",
                       code="model_not_found")


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(get_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    _check_model(state, model_id)
    return _model_card(state)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = get_state(request)
    _check_model(state, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
    tools = chat_tools(body, state.settings.tool_call_parser)
    ids = await state.chat_ids([m.as_template_input() for m in body.messages], tools.template_tools)
    rid = new_id("chatcmpl")
    submission = _submit(state, body, [ids], body.requested_max_tokens, None, "messages", rid, tools.sampling_fields())
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    if body.stream:
        return EventStream(_chat_stream(state, submission, request, head, body, tools))
    outputs = await state.collect(submission, request)
    choices = []
    for i, output in enumerate(outputs):
        finish = _choice_finish(output)
        message, finish["finish_reason"] = tools.reply(output["text"], finish["finish_reason"])
        choices.append({"index": i, "message": message, "logprobs": _chat_logprobs(state, body, output), **finish})
    return {**head, "choices": choices, "usage": usage(outputs, body.n)}


def _chat_logprobs(state: ServerState, body: ChatCompletionRequest, output: dict[str, Any]) -> Optional[dict[str, Any]]:
    if not body.logprobs:
        return None
    return {"content": chat_content(state.tokenizer, *from_meta_info(output["meta_info"]))}


async def _chat_stream(state: ServerState, submission: Submission, request: Request, head: dict[str, Any],
                       body: ChatCompletionRequest, tools: ChatTools) -> AsyncIterator[bytes]:
    include_usage, n = body.include_usage, body.n
    calls = {index: ToolCallStream(tools.parser) for index in range(n)} if tools.parser else {}
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    finals: dict[int, dict[str, Any]] = {}

    def chunk(
        index: int, delta: dict[str, Any], finish: Optional[dict[str, Any]] = None, logprobs: Any = None
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, **(finish or {"finish_reason": None})}
        return sse({**head, "choices": [choice], **extra})

    try:
        for index in range(n):
            yield chunk(index, {"role": "assistant", "content": ""})
    except BaseException:  # NOTE: closed or cancelled before the deltas' own cleanup exists: abort here
        state.abort_pending(submission)
        raise
    try:
        async with aclosing(state.deltas(submission, request)) as deltas:
            async for delta in deltas:
                if delta.error is not None:
                    yield _error_event(delta.status, delta.error)
                    break
                stream = calls.get(delta.index)
                text = delta.text if stream is None else stream.push(delta.text)
                if delta.logprobs is not None and delta.ids:
                    content = chat_content(state.tokenizer, delta.ids, delta.logprobs, delta.top_logprobs or [])
                    yield chunk(delta.index, {"content": text}, logprobs={"content": content})
                elif text:
                    yield chunk(delta.index, {"content": text})
                if delta.output is not None:
                    finals[delta.index] = delta.output
                    finish = _choice_finish(delta.output)
                    if stream is not None:
                        rest, found = stream.finish()
                        if rest:
                            yield chunk(delta.index, {"content": rest})
                        if found:
                            yield chunk(delta.index, {"tool_calls": [call_json(c, i) for i, c in enumerate(found)]})
                            finish["finish_reason"] = (
                                "tool_calls" if finish["finish_reason"] == "stop" else finish["finish_reason"]
                            )
                    yield chunk(delta.index, {}, finish)
                    if include_usage and len(finals) == n:
                        yield sse({**head, "choices": [], "usage": usage([finals[i] for i in range(n)], n)})
    except ClientGone:
        return
    yield sse("[DONE]")


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = get_state(request)
    _check_model(state, body.model)
    if body.echo and body.logprobs is not None:
        raise APIError(
            400, "echo: with logprobs it needs the prompt's log-probabilities, which are not computed", "echo"
        )
    prompt = body.prompt
    # NOTE: pydantic matched exactly one member of the Prompt union, so lists are homogeneous.
    if isinstance(prompt, str):
        batch = await state.encode([prompt], "prompt")
    elif isinstance(prompt[0], str):
        batch = await state.encode(cast(list[str], prompt), "prompt")
    elif isinstance(prompt[0], int):
        batch = [list(cast(list[int], prompt))]
    else:
        batch = [list(p) for p in cast(list[list[int]], prompt)]
    rid = new_id("cmpl")
    submission = _submit(state, body, batch, body.max_tokens, 16, "prompt", rid)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    echoes = await _echoes(state, body, batch)
    if body.stream:
        return EventStream(_completion_stream(state, submission, request, head, body, echoes))
    outputs = await state.collect(submission, request)
    choices = [
        {
            "index": i,
            "text": echoes[i] + o["text"],
            "logprobs": _completion_logprobs(state, body, o),
            **_choice_finish(o),
        }
        for i, o in enumerate(outputs)
    ]
    return {**head, "choices": choices, "usage": usage(outputs, body.n)}


def _completion_logprobs(
    state: ServerState, body: CompletionRequest, output: dict[str, Any]
) -> Optional[dict[str, Any]]:
    if body.logprobs is None:
        return None
    return completion_logprobs(state.tokenizer, *from_meta_info(output["meta_info"]), with_top=body.logprobs > 0)


async def _echoes(state: ServerState, body: CompletionRequest, batch: list[list[int]]) -> list[str]:
    """Per choice the text `echo` puts before it: its prompt (token prompts decoded), or nothing."""
    if not body.echo:
        return [""] * (len(batch) * body.n)
    prompt = body.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        texts = [prompt] if isinstance(prompt, str) else cast(list[str], prompt)
    else:
        texts = await state.decode(batch, "echo")
    return [text for text in texts for _ in range(body.n)]


async def _completion_stream(state: ServerState, submission: Submission, request: Request, head: dict[str, Any],
                             body: CompletionRequest, echoes: list[str]) -> AsyncIterator[bytes]:
    include_usage, n = body.include_usage, body.n
    extra = {"usage": None} if include_usage else {}
    finals: dict[int, dict[str, Any]] = {}
    offsets: dict[int, int] = {}

    def chunk(index: int, text: str, finish: Optional[dict[str, Any]] = None, ids: Sequence[int] = (),
              logprobs: Optional[list[float]] = None, tops: Any = None) -> bytes:
        entry = None
        if body.logprobs is not None and logprobs is not None:
            entry = completion_logprobs(
                state.tokenizer, ids, logprobs, tops or [], offsets.get(index, 0), body.logprobs > 0
            )
        offsets[index] = offsets.get(index, 0) + len(text)
        choice = {"index": index, "text": text, "logprobs": entry, **(finish or {"finish_reason": None})}
        return sse({**head, "choices": [choice], **extra})

    try:
        for index, echo in enumerate(echoes):
            if echo:
                yield chunk(index, echo)
    except BaseException:  # NOTE: closed or cancelled before the deltas' own cleanup exists: abort here
        state.abort_pending(submission)
        raise
    try:
        async with aclosing(state.deltas(submission, request)) as deltas:
            async for delta in deltas:
                if delta.error is not None:
                    yield _error_event(delta.status, delta.error)
                    break
                if delta.output is not None:
                    finals[delta.index] = delta.output
                    yield chunk(delta.index, delta.text, _choice_finish(delta.output), delta.ids, delta.logprobs,
                                delta.top_logprobs)
                elif delta.text or (delta.ids and delta.logprobs is not None):
                    yield chunk(delta.index, delta.text, None, delta.ids, delta.logprobs, delta.top_logprobs)
    except ClientGone:
        return
    if include_usage and len(finals) == len(submission.reqs):
        yield sse({**head, "choices": [], "usage": usage([finals[i] for i in sorted(finals)], n)})
    yield sse("[DONE]")
