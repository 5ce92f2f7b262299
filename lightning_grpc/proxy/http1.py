"""The proxy's HTTP/1.1 client for the backends it relays byte for byte (vLLM and the embedded engine).

Each call is one POST on a pooled keep-alive connection, its response read by httptools (llhttp, the
parser of Node.js). It does what the relay needs and nothing more: no cookies, no redirects, no proxies
from the environment, no request signals; compressed answers are not asked for (``Accept-Encoding:
identity``) and gzip or deflate ones are still decoded. aiohttp's client, which did the same work before,
took 86-98 us of CPU a call on a 2-core host and this one 28 us (32 concurrent calls to a backend that answers
at once). Through the whole proxy, against such a backend, 2,200-2,700 calls/s became 3,300-3,600; against
the embedded engine at 32 agents (``bench/run.py``'s proxy workload at full size, 4 alternating pairs) the
proxy kept 0.59-0.70 of direct calls/s before and 0.64-0.85 after (means 0.65 and 0.75).

- A connection goes back to the pool only after a whole response that lets it stay open; one the
  backend closed while idle is dropped, and a request sent on it is sent again on a new connection
  when nothing of its answer came back (a pooled connection can be closed by the backend at any time).
- ``connect_timeout`` bounds opening a connection (TLS included); ``read_timeout`` the wait for each
  next byte of the answer, as aiohttp's ``sock_read``: a stream that keeps sending never times out.
- A stream's body is read as it comes (:meth:`Response.chunks`), and the socket stops being read while
  more than :data:`STREAM_BUFFER` bytes wait for the reader. :meth:`Response.close` drops the
  connection of an answer not read to its end, which is how a backend learns to stop generating.

Errors: :class:`TimeoutError` for the two timeouts, :class:`OSError` (:class:`ConnectionError`, ``ssl``'s
errors) for a connection that could not be opened or broke, :class:`ProtocolError` (a
:class:`ConnectionError`) for an answer that is not HTTP/1.1 or ends early.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from lightning_grpc._extras import extra_imports

with extra_imports("proxy"):
    import httptools

#: Bytes of a streamed answer that may wait for its reader before the socket stops being read.
STREAM_BUFFER = 256 * 1024
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class ProtocolError(ConnectionError):
    """The backend's answer is not well-formed HTTP/1.1, or the connection closed before its end."""


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int

    @property
    def netloc(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def _origin_and_target(url: str) -> tuple[_Origin, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Origin(parts.scheme, parts.hostname, port), target


def _head(method: str, target: str, origin: _Origin, headers: Mapping[str, str], length: int) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {origin.netloc}", f"Content-Length: {length}"]
    lines += ["Accept-Encoding: identity", "User-Agent: lightning-grpc-proxy"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"header {name!r} has a line break or its name a colon")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Connection(asyncio.Protocol):
    """One connection and the response being read on it (httptools' callbacks fill it in)."""

    def __init__(self, read_timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._last_read = 0.0
        #: One timer a connection, left running across its calls (see _check_timeout), not one a call.
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.in_use = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received_any = False
        self.error: BaseException | None = None
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self._waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------ asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.in_use:
            # bytes on an idle connection (a 408 before the backend closes it) answer no call
            self.close()
            return
        self.received_any = True
        self._last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"the answer is not HTTP/1.1: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost ends the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if not self.in_use or self.complete:
            return
        if self.headers_done and self._reads_to_close():
            self.on_message_complete()  # an answer without a length ends with its connection
        else:
            reason = f": {exc}" if exc else ""
            self._fail(
                ProtocolError(f"the backend closed the connection before the end of its answer{reason}")
            )

    # ------------------------------------------------------------ httptools' side
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > STREAM_BUFFER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        # only known here: should_keep_alive() reads False once feed_data has returned
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # ------------------------------------------------------------ the caller's side
    def send(self, head: bytes, data: bytes) -> None:
        assert self.transport is not None
        self.in_use = True
        self.transport.write(head + data if len(data) < 65536 else head)
        if len(data) >= 65536:
            self.transport.write(data)
        self._last_read = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_later(self.read_timeout, self._check_timeout)

    async def wait(self) -> None:
        """Until something new: the headers, a piece of the body, the end, or an error."""
        if self.error is not None:
            raise self.error
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def take_body(self) -> bytes:
        chunk = b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def recycle(self) -> None:
        self._reset()
        self.idle_since = time.monotonic()

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------ inside
    def _reads_to_close(self) -> bool:
        return "content-length" not in self.headers and "chunked" not in self.headers.get(
            "transfer-encoding", ""
        )

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _check_timeout(self) -> None:
        """The read timeout: re-armed for what is left of it while an answer is awaited, else let go."""
        if not self.in_use or self.complete:
            self._timer = None  # between calls: the next call's send sets it again
            return
        left = self._last_read + self.read_timeout - self.loop.time()
        if left > 0:
            self._timer = self.loop.call_later(left, self._check_timeout)
            return
        self._timer = None
        self._fail(TimeoutError(f"no answer from the backend for {self.read_timeout:g} s"))
        self.close()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Response:
    """An answer whose headers have come; its body is read with :meth:`read` or :meth:`chunks`."""

    def __init__(self, client: HTTP1Client, origin: _Origin, connection: _Connection, url: str) -> None:
        self.url = url
        self.status = connection.status
        #: Header names in lower case; a header sent more than once has its values joined with ", ".
        self.headers = connection.headers
        self._client = client
        self._origin = origin
        self._connection: _Connection | None = connection
        encoding = connection.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", "", *_DECODERS):
            self.close()
            raise ProtocolError(f"the backend answered in an encoding the proxy does not read: {encoding}")
        self._decoder = zlib.decompressobj(_DECODERS[encoding]) if encoding in _DECODERS else None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes (decoded); the connection goes back to the pool after the last piece."""
        connection = self._connection
        if connection is None:
            return
        try:
            while True:
                if connection.body:
                    yield self._decoded(connection.take_body())
                    continue
                if connection.complete:
                    break
                await connection.wait()
        except BaseException:
            self.close()
            raise
        if self._decoder is not None:
            tail = self._decoder.flush()
            if tail:
                yield tail
        self.release()

    async def read(self) -> bytes:
        """The whole body (decoded)."""
        return b"".join([chunk async for chunk in self.chunks()])

    def release(self) -> None:
        """Done with this answer: its connection goes back to the pool if it was read to its end and may stay
        open, and is closed otherwise."""
        connection, self._connection = self._connection, None
        if connection is not None:
            self._client._release(self._origin, connection)

    def close(self) -> None:
        """Done with this answer, read or not: a connection whose answer has not ended is dropped (a backend stops
        generating when it sees this); one whose answer has is released."""
        connection, self._connection = self._connection, None
        if connection is not None and connection.complete:
            self._client._release(self._origin, connection)
        elif connection is not None:
            connection.close()

    def _decoded(self, data: bytes) -> bytes:
        if self._decoder is None:
            return data
        try:
            return self._decoder.decompress(data)
        except zlib.error as exc:
            raise ProtocolError(f"the backend's compressed answer does not decode: {exc}") from None


class HTTP1Client:
    """Pooled keep-alive HTTP/1.1 connections, per origin (scheme, host, port); no limit on their number."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        keepalive_timeout: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive_timeout = keepalive_timeout
        self._ssl = ssl_context
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._closed = False

    async def post(self, url: str, data: bytes, headers: Mapping[str, str]) -> Response:
        """Send ``data`` and wait for the answer's headers. Raises ``ValueError`` for a URL that is not http(s)."""
        self._closed = False  # used again after close(): new connections, as a proxy started again needs
        origin, target = _origin_and_target(url)
        head = _head("POST", target, origin, headers, len(data))
        while True:
            connection, reused = await self._connection(origin)
            connection.send(head, data)
            try:
                while not connection.headers_done:
                    await connection.wait()
            except ConnectionError:
                connection.close()
                if reused and not connection.received_any:
                    continue  # the backend had closed this idle connection: once more on another
                raise
            except BaseException:
                connection.close()
                raise
            return Response(self, origin, connection, url)

    async def close(self) -> None:
        """Close the idle connections, and the others as their answers end."""
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    async def _connection(self, origin: _Origin) -> tuple[_Connection, bool]:
        """An idle connection to ``origin`` that is still open (True), else a new one (False)."""
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive_timeout:
                return connection, True
            connection.close()
        return await self._open(origin), False

    async def _open(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.scheme == "https":
            tls = self._ssl or ssl.create_default_context()
            self._ssl = tls
        opening = loop.create_connection(
            lambda: _Connection(self.read_timeout),
            origin.host,
            origin.port,
            ssl=tls,
            server_hostname=origin.host if tls is not None else None,
        )
        try:
            _, connection = await asyncio.wait_for(opening, self.connect_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"no connection to {origin.netloc} within {self.connect_timeout:g} s"
            ) from None
        return connection

    def _release(self, origin: _Origin, connection: _Connection) -> None:
        if self._closed or not connection.reusable():
            connection.close()
            return
        connection.recycle()
        idle = self._idle.setdefault(origin, [])
        now = time.monotonic()
        while idle and now - idle[0].idle_since >= self.keepalive_timeout:
            idle.pop(0).close()
        idle.append(connection)
