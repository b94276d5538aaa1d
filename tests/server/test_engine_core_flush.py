"""EngineCore's flush to several HTTP server processes: a server hears from the engine when it has deltas, when the
engine took its requests, or with the detailed statistics (every DETAIL_INTERVAL_S and when the engine goes idle);
no finish statistic is lost on the way, and every server gets every request's."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import pytest
import zmq

from blockspec import Engine
from blockspec.engine import core as engine_core, wire
from blockspec.engine.core import EngineCore


class TwoServers:
    """Plays two HTTP server processes: binds their sockets, reads back what the engine sent to each."""

    def __init__(self, engine: Engine, root: Path) -> None:
        self.context = zmq.Context()
        to_engine = [f"ipc://{root}/to{i}" for i in range(2)]
        from_engine = [f"ipc://{root}/from{i}" for i in range(2)]
        self.pushes = [self.context.socket(zmq.PUSH) for _ in range(2)]
        self.pulls = [self.context.socket(zmq.PULL) for _ in range(2)]
        for push, pull, to, back in zip(self.pushes, self.pulls, to_engine, from_engine):
            push.bind(to)
            pull.bind(back)
        self.core = EngineCore(engine, to_engine, from_engine)
        self.core.links.connect()
        engine.scheduler.detokenize_all = False

    def received(self, server: int) -> list[wire.Outputs]:
        messages = []
        while self.pulls[server].poll(200 if not messages else 50):
            message = wire.decode_from_engine(self.pulls[server].recv())
            assert isinstance(message, wire.Outputs)
            messages.append(message)
        return messages

    def close(self) -> None:
        self.core.links.close()
        for sock in (*self.pushes, *self.pulls):
            sock.close(linger=0)
        self.context.term()


def add(core: EngineCore, rid: str, max_new_tokens: int, server: int) -> None:
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": max_new_tokens}
    core._handle(wire.AddRequest(rid, [5, 6, 7, 8], params, False, time.monotonic(), frontend=server))


def loop_pass(core: EngineCore) -> None:
    """One pass of EngineCore.run's loop after intake."""
    scheduler = core.engine.scheduler
    core._publish(scheduler.step())
    core._flush(stats=True, detail=not scheduler.has_work)


def test_a_busy_engine_writes_only_to_servers_it_owes(make_engine: Callable[..., Engine], tiny: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_core, "DETAIL_INTERVAL_S", 3600.0)
    servers = TwoServers(make_engine(tiny("llama").path), tmp_path)
    core = servers.core
    try:
        add(core, "short", 2, server=0)
        add(core, "long", 12, server=0)
        loop_pass(core)  # the first pass: both servers get the detailed statistics once
        assert [len(servers.received(s)) for s in (0, 1)] == [1, 1]
        while "short" in core._tracked:
            loop_pass(core)
        first = servers.received(0)
        assert any(d.rid == "short" and d.output is not None for m in first for d in m.deltas)
        assert servers.received(1) == []  # busy, nothing for server 1: its copy of the finish statistic waits
        while core.engine.scheduler.has_work:
            loop_pass(core)
        to_zero, to_one = servers.received(0), servers.received(1)
        assert to_one and to_one[-1].stats is not None and to_one[-1].stats.detailed  # idle: everyone hears
        for messages in (first + to_zero, to_one):
            finished = [f for m in messages if m.stats is not None for f in m.stats.finished]
            assert sorted(f.completion_tokens for f in finished) == [2, 12]
        assert sum(m.stats.handled for m in to_one if m.stats is not None) == 0
    finally:
        servers.close()


def test_stream_deltas_carry_statistics_only_when_they_say_something_new(
        make_engine: Callable[..., Engine], tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady decoding (same running and waiting counts, nothing taken or finished): the deltas go alone; the step
    that finishes a request carries the statistics, with its finish statistic."""
    monkeypatch.setattr(engine_core, "DETAIL_INTERVAL_S", 3600.0)
    servers = TwoServers(make_engine(tiny("llama").path), tmp_path)
    core = servers.core
    try:
        params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 10}
        for rid in ("a", "b"):
            core._handle(wire.AddRequest(rid, [5, 6, 7, 8], params, True, time.monotonic(), frontend=0))
        loop_pass(core)
        assert all(m.stats is not None for m in servers.received(0))  # taken: the counts changed
        steady = []
        while core.engine.scheduler.has_work:
            loop_pass(core)
            steady += servers.received(0)
        with_stats = [m for m in steady if m.stats is not None]
        assert any(m.stats is None and m.deltas for m in steady)  # steady steps: deltas alone
        finished = [f for m in with_stats for f in m.stats.finished]  # type: ignore[union-attr]
        assert sorted(f.completion_tokens for f in finished) == [10, 10]
        assert with_stats[-1].stats.detailed and with_stats[-1].stats.num_running == 0  # type: ignore[union-attr]
        ids = {rid: [i for m in steady for d in m.deltas if d.rid == rid for i in d.ids] for rid in ("a", "b")}
        assert all(len(v) == 9 for v in ids.values())  # NOTE: every id after the first pass's first token
    finally:
        servers.close()


def test_a_server_that_missed_a_count_change_gets_it_with_its_next_deltas(
        make_engine: Callable[..., Engine], tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Server 0's new request changes the running count while server 1's stream owes no delta (stream interval 4):
    server 1's next deltas carry the new count, not the one it heard last."""
    monkeypatch.setattr(engine_core, "DETAIL_INTERVAL_S", 3600.0)
    servers = TwoServers(make_engine(tiny("llama").path), tmp_path)
    core = servers.core
    core.stream_interval = 4
    try:
        params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40}
        core._handle(wire.AddRequest("b", [5, 6, 7, 8], params, True, time.monotonic(), frontend=1))
        loop_pass(core)
        while True:  # NOTE: until a step after which server 1 is owed no delta
            loop_pass(core)
            servers.received(1)
            tracked = core._tracked["b"]
            if len(tracked.ids) - tracked.sent_end < 3:
                break
        core._handle(wire.AddRequest("c", [5, 6, 7, 8], params, True, time.monotonic(), frontend=0))
        loop_pass(core)
        missed = servers.received(1)
        assert all(m.stats is None or m.stats.num_running == 2 for m in missed)
        while not missed or all(m.stats is None for m in missed):
            loop_pass(core)
            missed += servers.received(1)
        first = next(m for m in missed if m.stats is not None)
        assert first.stats is not None and first.stats.num_running == 2
        assert missed.index(first) == next(i for i, m in enumerate(missed) if m.deltas)  # NOTE: its first deltas
        while core.engine.scheduler.has_work:
            loop_pass(core)
    finally:
        servers.close()


def test_stream_deltas_travel_as_arrays() -> None:
    """A streaming step sends one DeltaOut per running request: it goes as [rid, text, ids, ...] (no field
    names) and decodes back to the same delta, a final one's fields included."""
    plain = wire.DeltaOut("r1", None, [7, 8])
    final = wire.DeltaOut("r2", "hi", [9], output={"finish_reason": "stop"}, logprobs=[-0.5])
    frame = msgspec.msgpack.encode(plain)
    assert msgspec.msgpack.decode(frame)[:3] == ["r1", None, [7, 8]]
    decoded = wire.decode_from_engine(wire.encode(wire.Outputs([plain, final])))
    assert isinstance(decoded, wire.Outputs)
    assert decoded.deltas == [plain, final]
