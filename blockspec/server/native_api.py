"""SGLang-native endpoints: /generate, /server_info, /health, /health_generate, /metrics, /abort_request,
/flush_cache, /get_model_info."""
from __future__ import annotations

import asyncio
import logging
import os
from contextlib import aclosing
from typing import Any, AsyncIterator, cast

from fastapi import APIRouter, Request
from fastapi.responses import Response

import blockspec
from blockspec.request import SamplingParams, logprob_request
from blockspec.server.engine_errors import EngineStoppedError
from blockspec.server.json_route import FastJSONRoute
from blockspec.server.metrics import CONTENT_TYPE
from blockspec.server.protocol import AbortRequest, GenerateRequest
from blockspec.server.state import APIError, ClientGone, EventStream, ServerState, get_state, new_id, sse
from blockspec.server.submission import Submission

logger = logging.getLogger(__name__)
router = APIRouter(route_class=FastJSONRoute)
HEALTH_GENERATE_TIMEOUT_S = 20.0
METRICS_CALL_TIMEOUT_S = 5.0
_RENAMES = {name: f"sampling_params.{name}" for name in SamplingParams.__dataclass_fields__}
_RENAMES["sampling_params"] = "sampling_params"


async def _inputs(state: ServerState, body: GenerateRequest) -> tuple[list[list[int]], bool, str]:
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "text: pass exactly one of text or input_ids", "text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        return await state.encode(texts, "text"), isinstance(body.text, str), "text"
    ids = body.input_ids
    assert ids is not None
    if isinstance(ids[0], int):
        return [list(cast(list[int], ids))], True, "input_ids"
    return [list(row) for row in cast(list[list[int]], ids)], False, "input_ids"


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> Any:
    state = get_state(request)
    batch, single, prompt_param = await _inputs(state, body)
    raw = body.sampling_params
    if isinstance(raw, list):
        if len(raw) != len(batch):
            raise APIError(400, f"sampling_params: got {len(raw)} for {len(batch)} prompts", "sampling_params")
        params = [dict(p) for p in raw]
    else:
        params = [dict(raw or {}) for _ in batch]
    rids = [body.rid] if isinstance(body.rid, str) else body.rid
    if rids is None:
        base = new_id("gen")
        rids = [base] if single else [f"{base}-{i}" for i in range(len(batch))]
    elif len(rids) != len(batch):
        raise APIError(400, f"rid: got {len(rids)} for {len(batch)} prompts", "rid")
    try:
        top_logprobs_num = logprob_request(body.return_logprob, body.top_logprobs_num)
    except ValueError as exc:
        raise APIError(400, f"top_logprobs_num: {exc}", "top_logprobs_num") from exc
    reqs = state.make_requests(batch, params, rids, prompt_param, _RENAMES, top_logprobs_num)
    submission = state.submit(reqs, body.stream)
    if body.stream:
        return EventStream(_generate_stream(state, submission, request, single))
    outputs = await state.collect(submission, request, keep_aborted=True)
    return outputs[0] if single else outputs


async def _generate_stream(
    state: ServerState, submission: Submission, request: Request, single: bool
) -> AsyncIterator[bytes]:
    """SGLang's default streaming: every chunk carries the cumulative text and output_ids."""
    texts = [""] * len(submission.reqs)
    ids: list[list[int]] = [[] for _ in submission.reqs]
    try:
        async with aclosing(state.deltas(submission, request)) as deltas:
            async for delta in deltas:
                if delta.error is not None and delta.output is None:
                    yield sse(APIError(delta.status, delta.error).body())
                    break
                texts[delta.index] += delta.text
                ids[delta.index] += delta.ids
                req = submission.reqs[delta.index]
                if delta.output is not None:
                    meta = delta.output["meta_info"]
                else:
                    meta = {
                        "id": req.rid,
                        "prompt_tokens": req.prompt_len,
                        "completion_tokens": len(ids[delta.index]),
                        "finish_reason": None,
                    }
                chunk: dict[str, Any] = {
                    "text": texts[delta.index],
                    "output_ids": list(ids[delta.index]),
                    "meta_info": meta,
                }
                if not single:
                    chunk["index"] = delta.index
                yield sse(chunk)
    except ClientGone:
        return
    yield sse("[DONE]")


@router.get("/health")
async def health(request: Request) -> Response:
    loop = get_state(request).loop
    return Response(status_code=200 if loop.alive and not loop.draining else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """SGLang's deep health check: 200 once a one-token generation went through the engine, else 503."""
    state = get_state(request)
    if not state.loop.alive or state.loop.draining:
        return Response(status_code=503)
    reqs = state.make_requests([[0]], [{"max_new_tokens": 1, "temperature": 0}], [new_id("health")], "input_ids")
    try:
        outputs = await asyncio.wait_for(state.collect(state.submit(reqs, False), request), HEALTH_GENERATE_TIMEOUT_S)
    except (APIError, asyncio.TimeoutError):
        return Response(status_code=503)
    return Response(status_code=200 if outputs and outputs[0]["meta_info"]["completion_tokens"] == 1 else 503)


async def _server_info(request: Request) -> dict[str, Any]:
    state = get_state(request)
    try:
        info = await state.loop.call("get_server_info")
    except EngineStoppedError as exc:
        raise APIError(503, str(exc)) from exc
    info.update(
        served_model_name=state.model_name,
        vocab_size=state.vocab_size,
        max_queued_requests=state.settings.max_queued_requests,
        num_queued_requests=state.loop.num_queued,
        version=blockspec.__version__,
        engine_pid=state.info.pid,
        api_server={"index": state.loop.frontend, "count": state.settings.api_server_count, "pid": os.getpid()},
    )
    return info


@router.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    return await _server_info(request)


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    return await _server_info(request)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    info = get_state(request).info
    return {"model_path": info.model_path, "tokenizer_path": info.tokenizer_path, "is_generation": True}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = get_state(request)
    try:  # NOTE: the radix cache's numbers live in the engine process; the rest arrive with every step
        stats = await asyncio.wait_for(state.loop.call("radix_cache_stats"), METRICS_CALL_TIMEOUT_S)
        state.metrics.set_cache_stats(stats)
    except EngineStoppedError:
        pass  # NOTE: /health reports a stopped engine; the last values stay
    except (asyncio.TimeoutError, RuntimeError) as exc:
        logger.warning("/metrics: radix cache stats not refreshed (%s: %s)", type(exc).__name__, exc)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """SGLang's /flush_cache: empties the radix cache; 400 while requests are queued or running."""
    try:
        flushed = await get_state(request).loop.call("flush_cache")
    except EngineStoppedError as exc:
        raise APIError(503, str(exc)) from exc
    if flushed:
        return Response("Cache flushed.\n", status_code=200)
    return Response("Cache not flushed: requests are queued or running.\n", status_code=400)


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    get_state(request).loop.abort(body.rid)
    return {"rid": body.rid, "status": "abort requested"}
