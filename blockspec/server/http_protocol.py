"""uvicorn's h11 protocol with a request-head deadline, which uvicorn lacks: its keep-alive timer is only armed after
a response and every received byte disarms it, so a client that never finishes its headers holds the connection."""
from __future__ import annotations

import asyncio
import json
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from blockspec.server.state import APIError


class HeaderTimeoutH11Protocol(H11Protocol):
    """From the moment a connection can take a request (it opened, or the previous response ended), the client has
    `header_timeout_s` to deliver the whole request head; bytes trickling in do not extend it. Then the connection is
    closed, with a 408 in the OpenAI error shape if part of a head arrived. Bodies and responses are not timed."""

    header_timeout_s: float = 10.0
    _header_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._sync_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_header_timer()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _sync_header_timer(self) -> None:
        # NOTE: h11 keeps the peer IDLE exactly until a complete request head has been parsed.
        awaiting_head = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if awaiting_head and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)
        elif not awaiting_head:
            self._cancel_header_timer()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            message = f"request headers not received within {self.header_timeout_s:g} s (--header-timeout-s)"
            body = json.dumps(APIError(408, message, None, "timeout").body()).encode()
            # NOTE: raw bytes: h11 only lets a server respond to a request it has parsed.
            head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                    "connection: close\r\n\r\n")
            self.transport.write(head.encode() + body)
        self.transport.close()


def h11_protocol_with_header_timeout(timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`."""

    class Configured(HeaderTimeoutH11Protocol):
        header_timeout_s = timeout_s

    return Configured
