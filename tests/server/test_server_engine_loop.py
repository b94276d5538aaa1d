"""The engine thread on its own: stop-string hold-back, queue limit, shutdown with requests in flight."""
from __future__ import annotations

import asyncio

import pytest

from blockspec import Engine
from blockspec.request import Req, SamplingParams
from blockspec.server.engine_errors import EngineStoppedError, QueueFullError
from blockspec.server.engine_loop import EngineLoop
from blockspec.server.metrics import ServerMetrics
from blockspec.server.submission import Delta
from tests.support.server_support import save_text_model
from blockspec.tokenizer import held_back as _held_back


def test_held_back_suffix() -> None:
    assert _held_back("hello wor", ["world"]) == 3
    assert _held_back("hello", ["world"]) == 0
    assert _held_back("abc\n", ["\n\n", "x"]) == 1
    assert _held_back("", ["stop"]) == 0
    assert _held_back("xxab", ["abc", "bcd"]) == 2
    assert _held_back("xyz", []) == 0


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = save_text_model(tmp_path_factory.mktemp("loop_model"))
    return Engine(model_path=str(path), device="cpu", dtype="float32", max_total_tokens=8192, max_running_requests=1)


def test_engine_checks_what_reaches_it_unchecked(engine: Engine) -> None:
    """Requests the server did not validate get a 400 each from the engine (which no longer runs Engine.make_requests
    on them); a valid one sent beside them still runs."""
    loop = EngineLoop(engine, ServerMetrics())
    bad_params = SamplingParams(max_new_tokens=2)
    bad_params.temperature = -1.0
    reqs = [Req([5, engine.scheduler.vocab_size], SamplingParams(max_new_tokens=2), "vocab"),
            Req([], SamplingParams(), "empty"), Req([5, 6], bad_params, "params"),
            Req([5, 6], SamplingParams(max_new_tokens=2, ignore_eos=True), "good")]

    async def scenario() -> list[Delta]:
        loop.start()
        submission = loop.submit(reqs, stream=False)
        finals: list[Delta] = []
        while not submission.done:
            delta = await asyncio.wait_for(submission.next(), 30)
            if delta.final:
                finals.append(delta)
        await loop.stop()
        return sorted(finals, key=lambda d: d.index)

    vocab, empty, params, good = asyncio.run(scenario())
    assert vocab.status == 400 and vocab.error is not None and "outside the vocabulary" in vocab.error
    assert empty.status == 400 and empty.error is not None and "empty" in empty.error
    assert params.status == 400 and params.error is not None and "temperature" in params.error
    assert good.error is None and good.output is not None and good.output["meta_info"]["completion_tokens"] == 2
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_queue_limit_and_shutdown_with_requests_in_flight(engine: Engine) -> None:
    loop = EngineLoop(engine, ServerMetrics(), max_queued_requests=2)

    async def scenario() -> None:
        loop.start()
        long = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
        subs = []
        for i in range(3):  # one runs (max_running_requests=1), two wait
            reqs, _ = engine.make_requests(input_ids=[5, 6, i + 7], sampling_params=long)
            subs.append(loop.submit(reqs, stream=True))
            while i == 0 and loop.num_queued:  # let the first one start running
                await asyncio.sleep(0.01)
        reqs, _ = engine.make_requests(input_ids=[5], sampling_params=long)
        with pytest.raises(QueueFullError):
            loop.submit(reqs, stream=False)
        first = await asyncio.wait_for(subs[0].next(), 10)
        assert first.ids and not first.final  # streaming deltas flow
        await loop.stop()
        for sub in subs:
            while not sub.done:
                delta = await asyncio.wait_for(sub.next(), 10)
            assert delta.error is not None and delta.status == 503
        with pytest.raises(EngineStoppedError):
            loop.submit(reqs, stream=False)
        with pytest.raises(EngineStoppedError):
            await loop.call("get_server_info")

    asyncio.run(scenario())
    assert not loop.alive
    info = engine.get_server_info()
    assert info["kv_cache"]["free_slots"] == info["kv_cache"]["total_slots"]
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_a_submission_reaches_the_engine_socket_before_the_event_loop_moves_on() -> None:
    """The AddRequest frame is sent inside `submit` (a busy event loop's pass would otherwise delay every prefill);
    an abort queued earlier in the same pass goes in the same frame, ahead of it."""
    import os

    import zmq

    from blockspec.engine import wire
    from blockspec.engine.process import RemoteEngine
    from blockspec.server.frontends import EngineAddresses

    addresses = EngineAddresses.create(1)
    info = wire.EngineInfo("m", "t", False, False, 64, 100, 1024, 1, 1, 4, os.getpid())
    loop = EngineLoop(RemoteEngine(info), ServerMetrics(), addresses=addresses)
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    try:
        loop.launch()  # NOTE: another process "launched" the engine: this one only binds its sockets
        pull.connect(addresses.to_engine[0])

        async def scenario() -> tuple[bool, list[wire.ToEngine]]:
            loop.abort("earlier")
            loop.submit([Req([5, 6], SamplingParams(max_new_tokens=2), "now")], stream=True)
            sent_in_submit = bool(pull.poll(1000))  # NOTE: no await since submit: the loop has not moved on
            await loop.stop()
            return sent_in_submit, wire.decode_to_engine(pull.recv()) if sent_in_submit else []

        sent_in_submit, messages = asyncio.run(scenario())
        assert sent_in_submit, "the submission waited for the end of the event-loop pass"
        assert [type(m).__name__ for m in messages] == ["Abort", "AddRequest"]
        assert isinstance(messages[1], wire.AddRequest) and messages[1].rid == "now" and messages[1].input_ids == [5, 6]
    finally:
        pull.close(linger=0)
        context.term()
        addresses.cleanup()
