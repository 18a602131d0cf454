"""What keeps slow clients from holding the local server: a read timeout on every request (in uvicorn's HTTP
protocol, where the bytes arrive) and a cap on the requests being served (in the app, where the path is known).

uvicorn alone times out only idle keep-alive connections, after an answer: a connection that sends nothing, or
its request a header line at a time, stays open for ever. Its `limit_concurrency` counts every open connection,
such ones too, so four sockets trickling header lines kept a `--max-connections 4` server answering 503 to
everyone, /healthz included (issue 51). Here half-sent requests are dropped after the read timeout and do not
count against the cap, which counts only requests whose headers have arrived (they are what reads bodies into
memory); health and metrics are never capped.
"""

from __future__ import annotations

import asyncio
import json
import logging

log = logging.getLogger("torchloom.serve")

# Cheap GETs that read no body: a load balancer's probe must get through when the server is full.
UNCAPPED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_TIMEOUT_BODY = b"Request Timeout: the request did not arrive in time\n"
TIMEOUT_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                  b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\nconnection: close\r\n\r\n"
                  + _TIMEOUT_BODY)


def timed_protocol(read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (httptools, else h11), with a read timeout: a request that has not arrived
    whole `read_timeout_s` after its first byte (or after its connection opened) is answered 408, unless an answer
    has begun, and its connection closed. A request that has arrived may take as long as the model needs."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class TimedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self._between_requests():
                self._arm()  # the first byte of the next request on a kept-alive connection
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._disarm()
            super().on_response_complete()  # arms uvicorn's keep-alive timeout for the idle connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(read_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            cycle = None if self._between_requests() else self.cycle
            if self.transport.is_closing() or (cycle is not None and (not cycle.more_body or cycle.response_started)):
                return  # closed already; or arrived whole (or being answered): the app's time is its own
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            part = "headers" if cycle is None else "body"
            log.info("dropped a request from %s: its %s did not arrive within %g s (--read-timeout); answered 408",
                     client, part, read_timeout_s)
            self.transport.write(TIMEOUT_ANSWER)
            self.transport.close()  # the app, if it was reading the body, sees a disconnect (recorded as 499)

    return TimedHTTPProtocol


class RequestCap:
    """At most `limit` requests served at once, counted from their headers to their answer (one per connection:
    HTTP/1.1 answers a connection's requests in turn); past it 503 at once, before the body is read, with
    `Connection: close`. UNCAPPED_PATHS pass."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNCAPPED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            await send_full(send, self.limit)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


async def send_full(send, limit: int) -> None:
    body = json.dumps({"error": {"code": "too_many_connections", "message": f"the server is already serving"
                                 f" {limit} requests (--max-connections); retry after 1 s"}}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
