"""The Connect protocol (https://connectrpc.com/docs/protocol/), translated to gRPC calls on one channel.

A browser cannot speak gRPC: ``fetch`` gives no access to HTTP/2 trailers, where gRPC puts a call's
status. Connect can be spoken with ``fetch``: a unary call is a plain POST of one message (JSON or
binary) answered by one message or by an error as JSON with an HTTP status, and a server stream is one
response whose body is a series of length-prefixed messages, closed by an end-of-stream message that
carries the status. So the dashboard's code, generated from ``proto/lightning/v1`` by protoc-gen-es
and called through ``@connectrpc/connect-web``, reaches the same services as every other client.

Nothing here is written per RPC. :func:`procedures` reads every route from the services' descriptors
(``POST /<package.Service>/<Method>``), and :class:`ConnectGateway` forwards each call over a grpc.aio
channel to the server's own gRPC port, with the caller's ``Authorization`` header as the call's
``authorization`` metadata and ``Connect-Timeout-Ms`` as its deadline. The server then authenticates,
authorizes, validates and answers as it does for any gRPC client: the gateway holds no credential and
adds no privilege of its own. Binary requests pass through as they came; JSON ones are parsed with the
canonical Protobuf JSON mapping (unknown fields ignored, as Connect servers do, so that a newer
dashboard works with an older server).

- **unary**: ``application/json`` or ``application/proto`` in, the same out; errors as Connect error
  JSON with the HTTP status of their code (:data:`CODES`), the gRPC status's details (the server's
  ``google.rpc.ErrorInfo``) as ``details``. ``GET`` too, for procedures marked ``NO_SIDE_EFFECTS``.
- **server streaming**: ``application/connect+json`` or ``application/connect+proto``; one enveloped
  request, then each answer enveloped as the gRPC stream yields it, then the end-of-stream envelope.
- **client and bidirectional streaming**: ``unimplemented`` (browsers cannot stream a request body
  over HTTP/1.1).
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2, descriptor, descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from lightning_grpc._extras import extra_imports

with extra_imports("dashboard"):
    from aiohttp import web

from lightning_grpc import logs
from lightning_grpc.errors import ERROR_DOMAIN, Reason
from lightning_grpc.logs import clip
from lightning_grpc.v1 import proxy_service_pb2, store_service_pb2, trainer_service_pb2

log = logs.get_logger(__name__)

#: The services the gateway can translate, when the server hosts them.
SERVICES: tuple[descriptor.ServiceDescriptor, ...] = tuple(
    service
    for module in (store_service_pb2, trainer_service_pb2, proxy_service_pb2)
    for service in module.DESCRIPTOR.services_by_name.values()
)

#: Connect's name and HTTP status of every gRPC status code (https://connectrpc.com/docs/protocol/#error-codes).
CODES: dict[grpc.StatusCode, tuple[str, int]] = {
    grpc.StatusCode.CANCELLED: ("canceled", 499),
    grpc.StatusCode.UNKNOWN: ("unknown", 500),
    grpc.StatusCode.INVALID_ARGUMENT: ("invalid_argument", 400),
    grpc.StatusCode.DEADLINE_EXCEEDED: ("deadline_exceeded", 504),
    grpc.StatusCode.NOT_FOUND: ("not_found", 404),
    grpc.StatusCode.ALREADY_EXISTS: ("already_exists", 409),
    grpc.StatusCode.PERMISSION_DENIED: ("permission_denied", 403),
    grpc.StatusCode.RESOURCE_EXHAUSTED: ("resource_exhausted", 429),
    grpc.StatusCode.FAILED_PRECONDITION: ("failed_precondition", 400),
    grpc.StatusCode.ABORTED: ("aborted", 409),
    grpc.StatusCode.OUT_OF_RANGE: ("out_of_range", 400),
    grpc.StatusCode.UNIMPLEMENTED: ("unimplemented", 501),
    grpc.StatusCode.INTERNAL: ("internal", 500),
    grpc.StatusCode.UNAVAILABLE: ("unavailable", 503),
    grpc.StatusCode.DATA_LOSS: ("data_loss", 500),
    grpc.StatusCode.UNAUTHENTICATED: ("unauthenticated", 401),
}

#: Envelope flags of a streaming body: the payload is compressed; the envelope ends the stream.
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
CODECS = ("json", "proto")
#: The most a request may carry, as on the gRPC port.
MAX_REQUEST_BYTES = 64 * 1024 * 1024
MAX_MESSAGE_CHARS = 1000

#: gRPC metadata: (key, value) pairs.
Metadata = Sequence[tuple[str, str | bytes]]


class ConnectError(Exception):
    """An error as Connect sends it: a code, a message, details (packed messages) and metadata."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        details: Sequence[any_pb2.Any] = (),
        *,
        metadata: Metadata = (),
        http_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code if code in CODES else grpc.StatusCode.UNKNOWN
        self.message = message
        self.details = list(details)
        self.metadata = metadata
        self.http_status = http_status or CODES[self.code][1]

    @classmethod
    def of(
        cls, code: grpc.StatusCode, message: str, reason: str, *, http_status: int | None = None, **info: str
    ) -> ConnectError:
        """An error the gateway itself answers, with one ErrorInfo as the server's errors have."""
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=info))
        return cls(code, clip(message, MAX_MESSAGE_CHARS), [detail], http_status=http_status)

    @classmethod
    def invalid(cls, message: str) -> ConnectError:
        return cls.of(
            grpc.StatusCode.INVALID_ARGUMENT, f"request: {message}", Reason.INVALID_ARGUMENT, field="request"
        )

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> ConnectError:
        """The status a gRPC call ended with: code, message, and the details of its google.rpc.Status."""
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        message = (exc.details() if hasattr(exc, "details") else "") or ""
        trailing: Any = (exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else ()
        details: list[any_pb2.Any] = []
        try:
            status = rpc_status.from_call(exc)  # type: ignore[arg-type]
        except Exception:  # a status that does not match its code: keep the code and message
            status = None
        if status is not None:
            message, details = status.message, list(status.details)
        return cls(code, message, details, metadata=tuple(trailing))

    @property
    def name(self) -> str:
        return CODES[self.code][0]

    def to_json(self) -> dict[str, Any]:
        """The Connect error JSON: ``{"code", "message", "details": [{"type", "value", "debug"}]}``."""
        body: dict[str, Any] = {"code": self.name}
        if self.message:
            body["message"] = self.message
        if self.details:
            body["details"] = [_detail_json(detail) for detail in self.details]
        return body

    def response(self) -> web.Response:
        """The answer to a unary call."""
        headers = _headers_of(self.metadata)
        headers["Content-Type"] = "application/json"
        return web.Response(status=self.http_status, body=_dumps(self.to_json()), headers=headers)

    def end_stream(self) -> dict[str, Any]:
        """The end-of-stream message of a stream that ended with this error."""
        end: dict[str, Any] = {"error": self.to_json()}
        if self.metadata:
            end["metadata"] = _metadata_json(self.metadata)
        return end


def _detail_json(detail: any_pb2.Any) -> dict[str, Any]:
    """One detail: its type name, its bytes in base64 without padding, and (for people) its JSON."""
    entry: dict[str, Any] = {
        "type": detail.TypeName(),
        "value": base64.b64encode(detail.value).decode("ascii").rstrip("="),
    }
    try:
        message_class = message_factory.GetMessageClass(
            descriptor_pool.Default().FindMessageTypeByName(detail.TypeName())
        )
        entry["debug"] = json_format.MessageToDict(message_class.FromString(detail.value))
    except Exception:  # a detail of a type this process does not know: its bytes are enough
        pass
    return entry


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _public(key: str) -> bool:
    """Metadata the caller may see: not gRPC's own (status, its details, encodings) nor HTTP/2's."""
    return not key.startswith(("grpc-", ":")) and key not in ("content-type", "te", "user-agent")


def _value_text(key: str, value: str | bytes) -> str:
    if isinstance(value, bytes) or key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else value.encode("latin-1")
        return base64.b64encode(raw).decode("ascii").rstrip("=")
    return value


def _headers_of(metadata: Metadata, prefix: str = "") -> dict[str, str]:
    headers: dict[str, str] = {}
    for key, value in metadata:
        if _public(key):
            headers[prefix + key] = _value_text(key, value)
    return headers


def _metadata_json(metadata: Metadata) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, value in metadata:
        if _public(key):
            out.setdefault(key, []).append(_value_text(key, value))
    return out


@dataclass(frozen=True)
class Procedure:
    """One RPC as Connect names it, with its message classes."""

    path: str
    method: descriptor.MethodDescriptor
    request_class: type[Message]
    response_class: type[Message]

    @property
    def name(self) -> str:
        return self.path.lstrip("/")

    @property
    def client_streaming(self) -> bool:
        return bool(self.method.client_streaming)

    @property
    def server_streaming(self) -> bool:
        return bool(self.method.server_streaming)

    @property
    def side_effect_free(self) -> bool:
        """Marked ``option idempotency_level = NO_SIDE_EFFECTS``: callable with GET."""
        level = self.method.GetOptions().idempotency_level
        return bool(level == descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS)


def procedures(services: Iterable[descriptor.ServiceDescriptor]) -> dict[str, Procedure]:
    """Every RPC of ``services``, by its path ``/<package.Service>/<Method>``."""
    table: dict[str, Procedure] = {}
    for service in services:
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            table[path] = Procedure(
                path,
                method,
                message_factory.GetMessageClass(method.input_type),
                message_factory.GetMessageClass(method.output_type),
            )
    return table


def envelope(flags: int, payload: bytes) -> bytes:
    """One message of a streaming body: a flags byte, the payload's length (4 bytes, big-endian), the payload."""
    return struct.pack(">BI", flags, len(payload)) + payload


def unenvelope(body: bytes, encoding: str | None) -> bytes:
    """The one message of a server-streaming request's body."""
    if len(body) < 5:
        raise ConnectError.invalid("a streaming request body is one enveloped message (5-byte prefix)")
    flags, length = struct.unpack(">BI", body[:5])
    if len(body) != 5 + length:
        raise ConnectError.invalid(
            f"the envelope announces {length} bytes but {len(body) - 5} follow; send exactly one message"
        )
    if flags & ~FLAG_COMPRESSED:
        raise ConnectError.invalid(f"unexpected envelope flags 0x{flags:02x} in a request")
    payload = body[5:]
    if flags & FLAG_COMPRESSED:
        payload = _decompress(payload, encoding)
    return payload


def _decompress(payload: bytes, encoding: str | None) -> bytes:
    if (encoding or "identity") == "identity":
        raise ConnectError.invalid("a compressed message, but no Connect-Content-Encoding says how")
    if encoding != "gzip":
        raise ConnectError.of(
            grpc.StatusCode.UNIMPLEMENTED,
            f"compression {encoding!r} is not supported; use gzip or none",
            Reason.UNIMPLEMENTED,
        )
    try:
        return gzip.decompress(payload)
    except (OSError, EOFError, ValueError) as exc:
        raise ConnectError.invalid(f"the gzip-compressed message does not decompress: {exc}") from None


def _timeout(request: web.Request) -> float | None:
    """``Connect-Timeout-Ms`` as the call's deadline, in seconds."""
    raw = request.headers.get("Connect-Timeout-Ms")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 10:
        raise ConnectError.invalid(
            f"Connect-Timeout-Ms must be a positive integer of at most 10 digits: {raw!r}"
        )
    if int(raw) == 0:  # gRPC would read a zero timeout as none
        raise ConnectError.of(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "Connect-Timeout-Ms is 0: no time left",
            Reason.DEADLINE_EXCEEDED,
        )
    return int(raw) / 1000


def _call_metadata(request: web.Request) -> tuple[tuple[str, str], ...]:
    """The caller's credential, and nothing else: the gateway adds none of its own."""
    authorization = request.headers.get("Authorization")
    if authorization is None:
        return ()
    if not authorization.isascii() or not authorization.isprintable():
        raise ConnectError.of(
            grpc.StatusCode.UNAUTHENTICATED,
            "the Authorization header is not printable ASCII; send 'Bearer <credential>'",
            Reason.BAD_TOKEN,
        )
    return (("authorization", authorization),)


def _check_protocol_version(request: web.Request) -> None:
    version = request.headers.get("Connect-Protocol-Version")
    if version is not None and version != "1":
        raise ConnectError.invalid(f"Connect-Protocol-Version {version!r} is not supported; send 1")


def _codec_of(content_type: str, prefix: str) -> str | None:
    """``json`` from ``application/json; charset=utf-8`` (prefix ``application/``), or None."""
    media = content_type.split(";", 1)[0].strip().lower()
    if not media.startswith(prefix):
        return None
    codec = media[len(prefix) :]
    return codec if codec in CODECS else None


def _unsupported_media(procedure: Procedure | None, content_type: str) -> ConnectError:
    if procedure is not None and procedure.server_streaming:
        wanted = "application/connect+json or application/connect+proto"
    else:
        wanted = "application/json or application/proto"
    name = procedure.name if procedure else "a procedure"
    return ConnectError.of(
        grpc.StatusCode.UNIMPLEMENTED,
        f"Content-Type {content_type or '(none)'!r}: {name} takes {wanted}",
        Reason.UNIMPLEMENTED,
        http_status=415,
    )


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ConnectError.of(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the request is larger than {MAX_REQUEST_BYTES // (1024 * 1024)} MiB",
            Reason.RESOURCE_EXHAUSTED,
        ) from None


class ConnectGateway:
    """Answers Connect requests for ``services`` by calling them on ``channel`` (the server's own port)."""

    def __init__(self, channel: grpc.aio.Channel, services: Iterable[descriptor.ServiceDescriptor]) -> None:
        self.channel = channel
        self.services = tuple(services)
        self.service_names = frozenset(service.full_name for service in self.services)
        self.procedures = procedures(self.services)
        # requests and answers travel as bytes: no serializer, so gRPC passes them through unchanged
        self._unary: dict[str, Any] = {
            path: channel.unary_unary(path)
            for path, p in self.procedures.items()
            if not (p.client_streaming or p.server_streaming)
        }
        self._server_streams: dict[str, Any] = {
            path: channel.unary_stream(path)
            for path, p in self.procedures.items()
            if p.server_streaming and not p.client_streaming
        }

    async def close(self) -> None:
        await self.channel.close()

    # ------------------------------------------------------------------ dispatch
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Answer one Connect request; never raises, and never shows a traceback to the caller."""
        procedure = self.procedures.get(request.path)
        try:
            if procedure is None:
                raise ConnectError.of(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"{request.path} is not a procedure this server serves "
                    f"(services: {', '.join(sorted(self.service_names)) or 'none'})",
                    Reason.UNIMPLEMENTED,
                    http_status=404,
                    procedure=clip(request.path, 200),
                )
            if request.method == "GET":
                return await self._get(request, procedure)
            if request.method != "POST":
                error = ConnectError.of(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"{procedure.name} is called with POST, not {request.method}",
                    Reason.UNIMPLEMENTED,
                    http_status=405,
                )
                response = error.response()
                response.headers["Allow"] = "POST"
                return response
            content_type = request.headers.get("Content-Type", "")
            stream_codec = _codec_of(content_type, "application/connect+")
            if stream_codec is not None:
                return await self._stream(request, procedure, stream_codec)
            codec = _codec_of(content_type, "application/")
            if codec is None:
                raise _unsupported_media(procedure, content_type)
            if procedure.client_streaming:
                raise self._no_client_streams(procedure)
            if procedure.server_streaming:
                raise _unsupported_media(procedure, content_type)
            _check_protocol_version(request)
            return await self._unary_call(request, procedure, codec, await _read_body(request))
        except ConnectError as error:
            return error.response()
        except Exception as exc:
            return _internal(request, exc).response()

    @staticmethod
    def _no_client_streams(procedure: Procedure) -> ConnectError:
        kind = "bidirectional" if procedure.server_streaming else "client"
        return ConnectError.of(
            grpc.StatusCode.UNIMPLEMENTED,
            f"{procedure.name} is a {kind}-streaming RPC, which the dashboard's gateway does not serve "
            "(a browser cannot stream a request body over HTTP/1.1); call it over gRPC",
            Reason.UNIMPLEMENTED,
            procedure=procedure.path,
        )

    # ------------------------------------------------------------------ messages
    @staticmethod
    def _request_bytes(procedure: Procedure, codec: str, data: bytes) -> bytes:
        """The request's binary form: as sent for proto (the server parses it), parsed from JSON otherwise."""
        if codec == "proto":
            return data
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConnectError.invalid("the JSON body is not UTF-8 text") from None
        if not text.strip():
            return b""
        try:
            message = json_format.Parse(text, procedure.request_class(), ignore_unknown_fields=True)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
            raise ConnectError.invalid(
                f"not a valid {procedure.method.input_type.full_name} in JSON: {exc}"
            ) from None
        return message.SerializeToString()

    @staticmethod
    def _answer_bytes(procedure: Procedure, codec: str, data: bytes) -> bytes:
        if codec == "proto":
            return data
        message = procedure.response_class.FromString(data)
        return _dumps(json_format.MessageToDict(message))

    # ------------------------------------------------------------------ unary
    async def _unary_call(
        self, request: web.Request, procedure: Procedure, codec: str, body: bytes
    ) -> web.Response:
        payload = self._request_bytes(procedure, codec, body)
        call = self._unary[procedure.path](
            payload, metadata=_call_metadata(request), timeout=_timeout(request)
        )
        try:
            answer = await call
            initial = await call.initial_metadata()
            trailing = await call.trailing_metadata()
        except grpc.RpcError as exc:
            raise ConnectError.from_rpc_error(exc) from None
        headers = _headers_of(tuple(initial or ()))
        headers.update(_headers_of(tuple(trailing or ()), prefix="trailer-"))
        headers["Content-Type"] = f"application/{codec}"
        return web.Response(status=200, body=self._answer_bytes(procedure, codec, answer), headers=headers)

    async def _get(self, request: web.Request, procedure: Procedure) -> web.StreamResponse:
        """Connect's GET form of a unary call: the message in the query (``?encoding=json&message=...``)."""
        if procedure.client_streaming or procedure.server_streaming or not procedure.side_effect_free:
            error = ConnectError.of(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{procedure.name} is not marked free of side effects (idempotency_level = NO_SIDE_EFFECTS); "
                "POST it",
                Reason.UNIMPLEMENTED,
                http_status=405,
            )
            response = error.response()
            response.headers["Allow"] = "POST"
            return response
        query = request.query
        if query.get("connect", "v1") != "v1":
            raise ConnectError.invalid(f"connect={query['connect']!r} is not supported; send connect=v1")
        codec = query.get("encoding", "")
        if codec not in CODECS:
            raise _unsupported_media(procedure, f"encoding={codec}")
        text = query.get("message", "")
        if query.get("base64") == "1":
            try:
                data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            except (binascii.Error, ValueError):
                raise ConnectError.invalid("the message parameter is not URL-safe base64") from None
        else:
            data = text.encode("utf-8")
        compression = query.get("compression")
        if compression not in (None, "", "identity"):
            data = _decompress(data, compression)
        return await self._unary_call(request, procedure, codec, data)

    # ------------------------------------------------------------------ streams
    async def _stream(self, request: web.Request, procedure: Procedure, codec: str) -> web.StreamResponse:
        """A streaming call: always HTTP 200, the outcome in the end-of-stream message."""
        response = web.StreamResponse(status=200, headers={"Content-Type": f"application/connect+{codec}"})
        call: Any = None
        end: dict[str, Any] = {}
        try:
            try:
                if procedure.client_streaming:
                    raise self._no_client_streams(procedure)
                _check_protocol_version(request)
                body = await _read_body(request)
                payload = self._request_bytes(
                    procedure, codec, unenvelope(body, request.headers.get("Connect-Content-Encoding"))
                )
                call = self._server_streams[procedure.path](
                    payload, metadata=_call_metadata(request), timeout=_timeout(request)
                )
                await response.prepare(request)
                async for answer in call:
                    await response.write(envelope(0, self._answer_bytes(procedure, codec, answer)))
                trailing = tuple(await call.trailing_metadata() or ())
                if _metadata_json(trailing):
                    end["metadata"] = _metadata_json(trailing)
            except ConnectError as error:
                end = error.end_stream()
            except grpc.RpcError as exc:
                end = ConnectError.from_rpc_error(exc).end_stream()
            except ConnectionResetError:
                return response  # the caller left; the finally below cancels the call
            except Exception as exc:
                end = _internal(request, exc).end_stream()
            if not response.prepared:
                await response.prepare(request)
            await response.write(envelope(FLAG_END_STREAM, _dumps(end)))
            await response.write_eof()
        except ConnectionResetError:
            pass
        finally:
            if call is not None and not call.done():
                call.cancel()
        return response


def _internal(request: web.Request, exc: BaseException) -> ConnectError:
    log.error("event=dashboard_internal_error path=%s error=%r", request.path, exc, exc_info=exc)
    return ConnectError.of(
        grpc.StatusCode.INTERNAL,
        "internal error in the dashboard's gateway; the server log has the details",
        Reason.INTERNAL,
    )
