"""The proxy's HTTP/1.1 client of its backends (lightning_grpc.proxy.http1) against real sockets on 127.0.0.1.

Each test's backend is an asyncio server whose connections follow a script (answers as bytes on the wire),
so that keep-alive, chunked and close-delimited bodies, a connection the backend closes, a backend that
stalls, compression and TLS are each met as a real backend would show them.
"""

from __future__ import annotations

import asyncio
import gzip
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lightning_grpc.proxy.backends import Backend
from lightning_grpc.proxy.http1 import HTTP1Client, ProtocolError
from lightning_grpc.proxy.upstream import BackendUnreachable, DirectClient, RetryPolicy

Handler = Callable[["Exchange"], Awaitable[None]]


@dataclass
class Exchange:
    """One request read off a connection, and the means to answer it."""

    head: bytes
    body: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


@dataclass
class Backend1:
    """A scripted backend: ``handler`` answers each request; it counts connections and keeps the requests."""

    handler: Handler
    port: int = 0
    connections: int = 0
    requests: list[Exchange] = field(default_factory=list)
    closed_by_client: list[bool] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        index = len(self.closed_by_client)
        self.closed_by_client.append(False)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                exchange = Exchange(head, await reader.readexactly(length), reader, writer)
                self.requests.append(exchange)
                await self.handler(exchange)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client[index] = True
        finally:
            writer.close()


@pytest.fixture
async def serve_backend() -> AsyncIterator[Callable[[Handler], Awaitable[Backend1]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler, *, tls: ssl.SSLContext | None = None) -> Backend1:
        backend = Backend1(handler)
        server = await asyncio.start_server(backend.serve, "127.0.0.1", 0, ssl=tls)
        servers.append(server)
        backend.port = server.sockets[0].getsockname()[1]
        return backend

    yield start
    for server in servers:
        server.close()


def answer(body: bytes, status: str = "200 OK", headers: str = "Content-Type: application/json\r\n") -> bytes:
    return f"HTTP/1.1 {status}\r\n{headers}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def ok(exchange: Exchange) -> None:
    exchange.writer.write(answer(b'{"echo":' + exchange.body + b"}"))
    await exchange.writer.drain()


async def test_calls_share_one_kept_alive_connection_and_send_the_request_as_given(serve_backend) -> None:
    backend = await serve_backend(ok)
    client = HTTP1Client()
    try:
        for i in range(3):
            resp = await client.post(backend.url, b'{"n":%d}' % i, {"Authorization": "Bearer k"})
            assert (resp.status, await resp.read()) == (200, b'{"echo":{"n":%d}}' % i)
            assert resp.headers["content-type"] == "application/json"
        await client.close()  # a client closed and used again opens a new connection (a proxy started again)
        assert await (await client.post(backend.url, b"{}", {})).read() == b'{"echo":{}}'
    finally:
        await client.close()
    assert backend.connections == 2
    head = backend.requests[0].head.decode()
    assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{backend.port}\r\n" in head and "Authorization: Bearer k\r\n" in head
    assert "Content-Length: 7\r\n" in head and "Accept-Encoding: identity\r\n" in head


async def test_a_chunked_answer_is_read_whole_and_a_stream_piece_by_piece_as_it_is_sent(
    serve_backend,
) -> None:
    go_on = asyncio.Event()

    async def chunked(exchange: Exchange) -> None:
        exchange.writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        exchange.writer.write(b"7\r\ndata: 1\r\n")
        await exchange.writer.drain()
        await go_on.wait()
        exchange.writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await exchange.writer.drain()

    backend = await serve_backend(chunked)
    client = HTTP1Client()
    try:
        resp = await client.post(backend.url, b"{}", {})
        pieces = resp.chunks()
        assert await asyncio.wait_for(anext(pieces), 5) == b"data: 1"  # before the backend sends the rest
        go_on.set()
        assert [piece async for piece in pieces] == [b"data: 2"]
        again = await client.post(backend.url, b"{}", {})
        assert await again.read() == b"data: 1data: 2"
    finally:
        await client.close()
    assert backend.connections == 1  # a stream read to its end leaves its connection for the next call


async def test_an_answer_without_a_length_ends_with_its_connection(serve_backend) -> None:
    async def until_close(exchange: Exchange) -> None:
        exchange.writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await exchange.writer.drain()
        exchange.writer.close()

    backend = await serve_backend(until_close)
    client = HTTP1Client()
    try:
        for _ in range(2):
            resp = await client.post(backend.url, b"{}", {})
            assert await resp.read() == b"all of it"
    finally:
        await client.close()
    assert backend.connections == 2


async def test_an_idle_connection_the_backend_closed_is_replaced_without_an_error(serve_backend) -> None:
    async def then_close(exchange: Exchange) -> None:
        await ok(exchange)
        await asyncio.sleep(0.05)
        exchange.writer.close()  # after the answer, as a backend's idle timeout does

    backend = await serve_backend(then_close)
    client = HTTP1Client()
    try:
        assert (await (await client.post(backend.url, b"1", {})).read()) == b'{"echo":1}'
        await asyncio.sleep(0.2)
        assert (await (await client.post(backend.url, b"2", {})).read()) == b'{"echo":2}'
    finally:
        await client.close()
    assert backend.connections == 2


async def test_bytes_on_an_idle_connection_are_no_answer_to_the_next_call(serve_backend) -> None:
    async def then_408(exchange: Exchange) -> None:
        await ok(exchange)
        await asyncio.sleep(0.05)  # idle: some servers say 408 before they close a kept-alive connection
        exchange.writer.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        await exchange.writer.drain()

    backend = await serve_backend(then_408)
    client = HTTP1Client()
    try:
        assert await (await client.post(backend.url, b"1", {})).read() == b'{"echo":1}'
        await asyncio.sleep(0.2)
        second = await client.post(backend.url, b"2", {})
        assert (second.status, await second.read()) == (200, b'{"echo":2}')
    finally:
        await client.close()
    assert backend.connections == 2


async def test_a_reused_connection_closed_as_the_request_is_sent_is_retried_once_on_a_new_one(
    serve_backend,
) -> None:
    calls = 0

    async def close_the_second(exchange: Exchange) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            exchange.writer.close()  # the race of a backend's idle timeout: nothing of an answer came back
            return
        await ok(exchange)

    backend = await serve_backend(close_the_second)
    client = HTTP1Client()
    try:
        assert (await (await client.post(backend.url, b"1", {})).read()) == b'{"echo":1}'
        assert (await (await client.post(backend.url, b"2", {})).read()) == b'{"echo":2}'
    finally:
        await client.close()
    assert (calls, backend.connections) == (3, 2)


async def test_an_answer_cut_short_is_a_protocol_error_and_its_connection_is_not_reused(
    serve_backend,
) -> None:
    async def cut(exchange: Exchange) -> None:
        if len(backend.requests) == 1:
            exchange.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
            await exchange.writer.drain()
            exchange.writer.close()
            return
        await ok(exchange)

    backend = await serve_backend(cut)
    client = HTTP1Client()
    try:
        resp = await client.post(backend.url, b"{}", {})
        with pytest.raises(ProtocolError, match="before the end of its answer"):
            await resp.read()
        assert await (await client.post(backend.url, b"2", {})).read() == b'{"echo":2}'
    finally:
        await client.close()
    assert backend.connections == 2


async def test_an_answer_that_is_not_http_is_a_protocol_error(serve_backend) -> None:
    async def garbage(exchange: Exchange) -> None:
        exchange.writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await exchange.writer.drain()

    backend = await serve_backend(garbage)
    client = HTTP1Client()
    try:
        with pytest.raises(ProtocolError, match=r"not HTTP/1\.1"):
            await client.post(backend.url, b"{}", {})
    finally:
        await client.close()


async def test_the_read_timeout_bounds_the_wait_for_each_next_byte_not_the_whole_answer(
    serve_backend,
) -> None:
    async def trickle(exchange: Exchange) -> None:
        if exchange.body == b"stall":
            await asyncio.sleep(10)
            return
        exchange.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        for byte in b"12345":
            await asyncio.sleep(0.1)
            exchange.writer.write(bytes([byte]))
            await exchange.writer.drain()

    backend = await serve_backend(trickle)
    client = HTTP1Client(read_timeout=0.3)
    try:
        started = time.monotonic()
        assert await (await client.post(backend.url, b"slow", {})).read() == b"12345"
        assert time.monotonic() - started > 0.45  # longer than the timeout, a byte at a time
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"no answer from the backend for 0\.3 s"):
            await client.post(backend.url, b"stall", {})
        assert time.monotonic() - started < 2
    finally:
        await client.close()


async def test_a_backend_that_is_not_listening_is_a_connection_error() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = HTTP1Client()
    try:
        with pytest.raises(ConnectionRefusedError):
            await client.post(f"http://127.0.0.1:{port}/v1/x", b"{}", {})
        with pytest.raises(ValueError, match="not an http"):
            await client.post(f"ftp://127.0.0.1:{port}/v1/x", b"{}", {})
        with pytest.raises(ValueError, match="line break"):
            await client.post(
                f"http://127.0.0.1:{port}/v1/x", b"{}", {"Authorization": "Bearer a\r\nX-Evil: 1"}
            )
    finally:
        await client.close()


async def test_a_compressed_answer_is_decoded(serve_backend) -> None:
    async def gzipped(exchange: Exchange) -> None:
        exchange.writer.write(answer(gzip.compress(b'{"a":1}' * 1000), headers="Content-Encoding: gzip\r\n"))
        await exchange.writer.drain()

    backend = await serve_backend(gzipped)
    client = HTTP1Client()
    try:
        assert await (await client.post(backend.url, b"{}", {})).read() == b'{"a":1}' * 1000
    finally:
        await client.close()


async def test_closing_an_unfinished_stream_drops_its_connection(serve_backend) -> None:
    async def endless(exchange: Exchange) -> None:
        exchange.writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(500):
            exchange.writer.write(b"5\r\ntoken\r\n")
            await exchange.writer.drain()
            await asyncio.sleep(0.01)

    backend = await serve_backend(endless)
    client = HTTP1Client()
    try:
        resp = await client.post(backend.url, b"{}", {})
        assert await anext(resp.chunks())
        resp.close()
        for _ in range(100):
            if backend.closed_by_client[0]:
                break
            await asyncio.sleep(0.05)
        assert backend.closed_by_client == [True]  # the backend saw the connection go: it stops generating
    finally:
        await client.close()


async def test_a_stream_nobody_reads_stops_being_read_off_the_socket(serve_backend) -> None:
    piece, pieces = b"x" * 65536, 512  # 32 MiB, far beyond the socket buffers and STREAM_BUFFER
    sent_all = asyncio.Event()

    async def flood(exchange: Exchange) -> None:
        exchange.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(piece) * pieces))
        for _ in range(pieces):
            exchange.writer.write(piece)
            await exchange.writer.drain()
        sent_all.set()

    backend = await serve_backend(flood)
    client = HTTP1Client()
    try:
        resp = await client.post(backend.url, b"{}", {})
        chunks = resp.chunks()
        received = len(await anext(chunks))
        await asyncio.sleep(0.5)
        assert not sent_all.is_set()  # the backend waits for the reader, as it would for a slow agent
        received += sum([len(chunk) async for chunk in chunks])
    finally:
        await client.close()
    assert received == len(piece) * pieces and sent_all.is_set()


async def test_idle_connections_older_than_the_keepalive_timeout_are_not_reused(serve_backend) -> None:
    backend = await serve_backend(ok)
    client = HTTP1Client(keepalive_timeout=0.1)
    try:
        await (await client.post(backend.url, b"1", {})).read()
        await (await client.post(backend.url, b"2", {})).read()
        await asyncio.sleep(0.2)
        await (await client.post(backend.url, b"3", {})).read()
    finally:
        await client.close()
    assert backend.connections == 2


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        [
            *(
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
            ),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_an_https_backend_is_verified_against_the_trusted_certificates(
    serve_backend, certificate
) -> None:
    cert, key = certificate
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    backend = await serve_backend(ok, tls=served)
    url = backend.url.replace("http://", "https://")
    trusting = ssl.create_default_context(cafile=str(cert))
    client = HTTP1Client(ssl_context=trusting)
    untrusting = HTTP1Client()
    try:
        assert await (await client.post(url, b"1", {})).read() == b'{"echo":1}'
        assert await (await client.post(url, b"2", {})).read() == b'{"echo":2}'
        with pytest.raises(ssl.SSLCertVerificationError):
            await untrusting.post(url, b"3", {})
    finally:
        await client.close()
        await untrusting.close()
    # both trusted calls on one connection; the untrusting client's never passed its handshake
    assert backend.connections == 1


# ---------------------------------------------------------------- the proxy's client of vLLM-dialect backends


async def test_direct_client_retries_a_busy_backend_then_relays_its_answer(serve_backend) -> None:
    async def busy_then_ok(exchange: Exchange) -> None:
        if len(backend.requests) < 3:
            exchange.writer.write(
                answer(b'{"error":"busy"}', "503 Service Unavailable", "Retry-After: 0.01\r\n")
            )
            await exchange.writer.drain()
            return
        exchange.writer.write(
            answer(b'{"ok":true}', headers="Content-Type: application/json\r\nx-policy-version: 7\r\n")
        )
        await exchange.writer.drain()

    backend = await serve_backend(busy_then_ok)
    client = DirectClient(RetryPolicy(retries=2, initial_backoff=0.01))
    try:
        call = await client.open(
            Backend("m", f"http://127.0.0.1:{backend.port}/v1", api_key="secret"),
            "chat/completions",
            {},
            False,
            encoded='{"model":"m"}',
        )
    finally:
        await client.close()
    assert (call.status, call.body, call.policy_version()) == (200, b'{"ok":true}', 7)
    assert len(backend.requests) == 3 and backend.connections == 1
    assert all(
        b"Authorization: Bearer secret\r\n" in r.head and r.body == b'{"model":"m"}' for r in backend.requests
    )


async def test_direct_client_names_an_unreachable_backend_after_its_retries() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = DirectClient(RetryPolicy(retries=1, initial_backoff=0.01))
    try:
        with pytest.raises(
            BackendUnreachable, match=f"127.0.0.1:{port}/v1/chat/completions: ConnectionRefusedError"
        ):
            await client.open(
                Backend("m", f"http://127.0.0.1:{port}/v1"), "chat/completions", {}, False, encoded="{}"
            )
    finally:
        await client.close()
