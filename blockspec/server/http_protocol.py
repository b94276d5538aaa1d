"""uvicorn's h11 protocol with the connection limits uvicorn lacks, and its own error answers in OpenAI's shape.

- A request-head deadline: uvicorn's keep-alive timer is only armed after a response and every received byte disarms
  it, so a client that never finishes its headers held the connection.
- A request-body deadline: once the head is in, the whole body must arrive within `body_timeout_s` (a client that
  stalls mid-body held the connection, and its request's task, forever).
- A cap on open connections per server process: uvicorn's `limit_concurrency` still accepts and holds every
  connection (it answers the request, once one arrives, with a plain-text 503); here the connection over the cap is
  answered at once with a 503 in the OpenAI error shape and closed.
- Malformed framing (h11 refuses the request line, a header such as a negative or non-numeric Content-Length, or the
  chunked encoding): uvicorn's plain-text "Invalid HTTP request received." becomes a 400 in the OpenAI error shape.
"""
from __future__ import annotations

import asyncio
import json
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from blockspec.server.state import APIError

_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


def error_bytes(error: APIError) -> bytes:
    """A whole HTTP/1.1 response (connection: close) carrying `error` in the OpenAI shape.

    NOTE: raw bytes: h11 only lets a server respond to a request it has parsed, and these answer connections that
    have none (a head not received in time, a connection over the cap)."""
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 {error.status} {_REASONS[error.status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class LimitedH11Protocol(H11Protocol):
    """From the moment a connection can take a request (it opened, or the previous response ended), the client has
    `header_timeout_s` to deliver the whole request head, then `body_timeout_s` for its whole body; bytes trickling
    in do not extend either. Then the connection is closed, with a 408 in the OpenAI error shape if part of a head
    arrived or no response has begun. Responses are not timed. At most `max_connections` connections are open."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1000
    _header_timer: Optional[asyncio.TimerHandle] = None
    _body_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            message = (f"this server process has {self.max_connections} connections open (--max-connections); "
                       "retry later")
            self.logger.warning("refused a connection: %d open (--max-connections)", self.max_connections)
            self.transport.write(error_bytes(APIError(503, message, None, "server_overloaded")))
            self.transport.close()
            return
        self._sync_timers()

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_timers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_timers()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, in the OpenAI error shape."""
        message = (f"{msg} The request line, a header (e.g. Content-Length) or the chunked body encoding is "
                   "malformed.")
        self._respond_and_close(APIError(400, message))

    def _respond_and_close(self, error: APIError) -> None:
        """Answers the request in flight with `error` when no response has begun, then closes the connection."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = json.dumps(error.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=error.status, headers=headers,
                                                                  reason=_REASONS[error.status].encode())))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # NOTE: h11 refused to respond at all (no request head was parsed)
                self.transport.write(error_bytes(error))
        self.transport.close()

    def _sync_timers(self) -> None:
        # NOTE: h11 keeps the peer IDLE exactly until a complete request head has been parsed, then SEND_BODY until
        # the body's end (DONE), whatever the framing (Content-Length, chunked, none).
        closing = self.transport.is_closing()
        awaiting_head = self.conn.their_state is h11.IDLE and not closing
        awaiting_body = self.conn.their_state is h11.SEND_BODY and not closing
        if awaiting_head and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)
        elif not awaiting_head and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if awaiting_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._on_body_timeout)
        elif not awaiting_body and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            message = f"request headers not received within {self.header_timeout_s:g} s (--header-timeout-s)"
            self.transport.write(error_bytes(APIError(408, message, None, "timeout")))
        self.transport.close()

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        message = f"body: not received within {self.body_timeout_s:g} s (--body-timeout-s)"
        self.logger.warning("closed a connection: %s", message)
        self._respond_and_close(APIError(408, message, "body", "timeout"))


def limited_h11_protocol(header_timeout: float, body_timeout: float, connections: int) -> type[LimitedH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`: uvicorn builds one per connection from the class alone."""

    class Configured(LimitedH11Protocol):
        header_timeout_s = header_timeout
        body_timeout_s = body_timeout
        max_connections = connections

    return Configured
