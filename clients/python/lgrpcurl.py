#!/usr/bin/env python3
"""lgrpcurl: call any gRPC server that offers server reflection, from the command line.

    python lgrpcurl.py [options] HOST:PORT list [SERVICE]
    python lgrpcurl.py [options] HOST:PORT describe SYMBOL
    python lgrpcurl.py [options] HOST:PORT call METHOD [-d JSON | -d @FILE | -d @-]

The schema comes from the server (grpc.reflection.v1alpha.ServerReflection), so no .proto file
or generated stub is needed. Requests are written in the canonical Protobuf JSON mapping; every
response is printed as one JSON object per line. For client- and bidi-streaming methods, ``-d``
holds a sequence of JSON documents (one per line is the usual way) and each becomes one
message; ``-d @-`` reads them from stdin as they arrive.

Exit status: 0 on success, 2 for a usage or request error, 64 + the gRPC status code when the
call fails (NOT_FOUND -> 69, UNAUTHENTICATED -> 80, UNAVAILABLE -> 78), 130 on Ctrl-C. A failed
call prints its status as JSON on stderr, with google.rpc error details (ErrorInfo, ...) decoded.

Needs only grpcio, grpcio-reflection, grpcio-status (with googleapis-common-protos) and protobuf.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor, descriptor_pool, json_format, message_factory
from google.protobuf.any_pb2 import Any as AnyMessage
from google.protobuf.message import Message
from google.rpc import error_details_pb2  # noqa: F401  (puts the standard error detail types in the default pool)
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_RPC_BASE = 64
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A bad command line, an unknown symbol or a request that is not valid JSON for its type."""


# --------------------------------------------------------------------------------------------
# Channel: TLS or plaintext, with extra metadata on every call (reflection included).


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class MetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata (an authorization header, say) to every call on the channel."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def _with_metadata(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self._metadata),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_metadata(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_metadata(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_metadata(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_metadata(details), requests)


def parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise UsageError(f"header {text!r} is not 'name: value'")
    return name.strip().lower(), value.strip()


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if args.plaintext:
        channel = grpc.insecure_channel(args.address)
    else:
        roots = Path(args.cacert).read_bytes() if args.cacert else None
        channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(root_certificates=roots))
    metadata = [parse_header(h) for h in args.header]
    if args.token:
        metadata.append(("authorization", f"Bearer {args.token}"))
    if metadata:
        channel = grpc.intercept_channel(channel, MetadataInterceptor(metadata))
    return channel


# --------------------------------------------------------------------------------------------
# Schema: a DescriptorPool fed lazily by the server's reflection service.


class Schema:
    def __init__(self, channel: grpc.Channel) -> None:
        self.database = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self.database)

    def services(self) -> list[str]:
        return sorted(self.database.get_services())

    def service(self, name: str) -> descriptor.ServiceDescriptor:
        found = self._find(self.pool.FindServiceByName, name)
        if found is None:
            raise UsageError(f"the server has no service {name!r}")
        return found

    def method(self, name: str) -> descriptor.MethodDescriptor:
        """Accepts pkg.Service/Method, /pkg.Service/Method or pkg.Service.Method."""
        text = name.strip().lstrip("/")
        service_name, sep, method_name = text.rpartition("/") if "/" in text else text.rpartition(".")
        if not sep or not service_name or not method_name:
            raise UsageError(f"{name!r} is not a method name like package.Service/Method")
        method = self.service(service_name).methods_by_name.get(method_name)
        if method is None:
            raise UsageError(f"service {service_name!r} has no method {method_name!r}")
        return method

    def symbol(self, name: str) -> Any:
        """A service, method, message or enum descriptor."""
        name = name.strip().lstrip(".")
        for find in (
            self.pool.FindServiceByName,
            self.pool.FindMessageTypeByName,
            self.pool.FindEnumTypeByName,
        ):
            found = self._find(find, name)
            if found is not None:
                return found
        try:
            return self.method(name)
        except UsageError:
            raise UsageError(f"the server knows no symbol {name!r}") from None

    @staticmethod
    def _find(find: Callable[[str], Any], name: str) -> Any:
        try:
            return find(name)
        except (KeyError, AssertionError):  # AssertionError: the reflection client's "unexpected error"
            return None


# --------------------------------------------------------------------------------------------
# describe: a .proto-like rendering of one symbol.

_SCALAR_NAMES = {
    getattr(descriptor.FieldDescriptor, name): name.removeprefix("TYPE_").lower()
    for name in dir(descriptor.FieldDescriptor)
    if name.startswith("TYPE_")
}


def field_type(field: descriptor.FieldDescriptor) -> str:
    if field.message_type is not None:
        if field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            return f"map<{field_type(key)}, {field_type(value)}>"
        return field.message_type.full_name
    if field.enum_type is not None:
        return field.enum_type.full_name
    return _SCALAR_NAMES.get(field.type, f"type{field.type}")


def _is_synthetic_oneof(oneof: descriptor.OneofDescriptor) -> bool:
    return len(oneof.fields) == 1 and oneof.name == f"_{oneof.fields[0].name}"


def describe_field(field: descriptor.FieldDescriptor, indent: str) -> str:
    kind = field_type(field)
    if field.is_repeated and not kind.startswith("map<"):
        kind = f"repeated {kind}"
    elif field.containing_oneof is not None and _is_synthetic_oneof(field.containing_oneof):
        kind = f"optional {kind}"
    return f"{indent}{kind} {field.name} = {field.number};"


def describe_message(message: descriptor.Descriptor, indent: str = "") -> list[str]:
    lines = [f"{indent}message {message.name} {{"]
    inner = indent + "  "
    for nested in message.nested_types:
        if not nested.GetOptions().map_entry:
            lines += describe_message(nested, inner)
    for enum in message.enum_types:
        lines += describe_enum(enum, inner)
    real_oneofs = [o for o in message.oneofs if not _is_synthetic_oneof(o)]
    in_real_oneof = {f.name for o in real_oneofs for f in o.fields}
    lines += [describe_field(f, inner) for f in message.fields if f.name not in in_real_oneof]
    for oneof in real_oneofs:
        lines.append(f"{inner}oneof {oneof.name} {{")
        lines += [describe_field(f, inner + "  ") for f in oneof.fields]
        lines.append(f"{inner}}}")
    lines.append(f"{indent}}}")
    return lines


def describe_enum(enum: descriptor.EnumDescriptor, indent: str = "") -> list[str]:
    values = [f"{indent}  {v.name} = {v.number};" for v in enum.values]
    return [f"{indent}enum {enum.name} {{", *values, f"{indent}}}"]


def describe_method(method: descriptor.MethodDescriptor, indent: str = "") -> str:
    request = ("stream " if method.client_streaming else "") + method.input_type.full_name
    response = ("stream " if method.server_streaming else "") + method.output_type.full_name
    return f"{indent}rpc {method.name}({request}) returns ({response});"


def describe(symbol: Any) -> str:
    if isinstance(symbol, descriptor.ServiceDescriptor):
        kind, lines = (
            "service",
            [f"service {symbol.name} {{", *(describe_method(m, "  ") for m in symbol.methods), "}"],
        )
    elif isinstance(symbol, descriptor.MethodDescriptor):
        kind, lines = "method", [describe_method(symbol)]
    elif isinstance(symbol, descriptor.Descriptor):
        kind, lines = "message", describe_message(symbol)
    else:
        kind, lines = "enum", describe_enum(symbol)
    return "\n".join([f"// {symbol.full_name} ({kind})", *lines])


# --------------------------------------------------------------------------------------------
# Requests: JSON documents to messages.


def iter_json_documents(lines: Iterable[str]) -> Iterator[Any]:
    """Yields each JSON document of a text as soon as it is complete (NDJSON or pretty-printed)."""
    decoder = json.JSONDecoder()
    pending = ""
    for line in lines:
        pending += line
        while pending.strip():
            text = pending.lstrip()
            try:
                document, end = decoder.raw_decode(text)
            except json.JSONDecodeError:
                pending = text
                break
            yield document
            pending = text[end:]
    if pending.strip():
        raise UsageError(f"request data is not valid JSON: {pending.strip()[:120]!r}")


def request_lines(data: str | None) -> Iterable[str]:
    if data is None:
        return ["{}"]
    if data == "@-":
        return iter(sys.stdin.readline, "")
    if data.startswith("@"):
        try:
            return Path(data[1:]).read_text().splitlines(keepends=True)
        except OSError as exc:
            raise UsageError(f"cannot read request data: {exc}") from None
    return [data]


class MessageCodec:
    """JSON <-> Protobuf for one method, with message classes built from reflected descriptors."""

    def __init__(self, method: descriptor.MethodDescriptor, pool: descriptor_pool.DescriptorPool) -> None:
        self.pool = pool
        self.request_class = message_factory.GetMessageClass(method.input_type)
        self.response_class = message_factory.GetMessageClass(method.output_type)

    def request(self, document: Any, label: str = "request") -> Message:
        if not isinstance(document, dict):
            raise UsageError(f"{label} must be a JSON object, got {json.dumps(document)[:80]}")
        try:
            return json_format.ParseDict(document, self.request_class(), descriptor_pool=self.pool)
        except json_format.ParseError as exc:
            raise UsageError(f"{label}: {exc}") from None

    def response_json(self, response: Message, emit_defaults: bool) -> str:
        as_dict = json_format.MessageToDict(
            response, descriptor_pool=self.pool, always_print_fields_with_no_presence=emit_defaults
        )
        return json.dumps(as_dict, ensure_ascii=False)


class RequestFeed:
    """The request iterator of a client stream; a bad document cancels the call instead of ending it."""

    def __init__(self, documents: Iterator[Any], codec: MessageCodec) -> None:
        self._documents = documents
        self._codec = codec
        self._call: grpc.Future | None = None
        self._attached = threading.Event()
        self.error: str | None = None

    def attach(self, call: Any) -> None:
        self._call = call
        self._attached.set()

    def __iter__(self) -> Iterator[Message]:
        count = 0
        try:
            for document in self._documents:
                count += 1
                yield self._codec.request(document, f"request {count}")
        except UsageError as exc:
            self.error = str(exc)
            self._attached.wait(10)
            if self._call is not None:
                self._call.cancel()


# --------------------------------------------------------------------------------------------
# Calls of the four kinds.


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def rpc_kind(method: descriptor.MethodDescriptor) -> str:
    """unary_unary, unary_stream, stream_unary or stream_stream: the grpc.Channel factory to use."""
    sending = "stream" if method.client_streaming else "unary"
    receiving = "stream" if method.server_streaming else "unary"
    return f"{sending}_{receiving}"


def call_method(
    channel: grpc.Channel, schema: Schema, method: descriptor.MethodDescriptor, args: argparse.Namespace
) -> int:
    codec = MessageCodec(method, schema.pool)
    path = f"/{method.containing_service.full_name}/{method.name}"
    multicallable = getattr(channel, rpc_kind(method))(
        path,
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=codec.response_class.FromString,
    )
    documents = iter_json_documents(request_lines(args.data))
    feed: RequestFeed | None = None
    try:
        if method.client_streaming:
            feed = RequestFeed(documents, codec)
            if method.server_streaming:
                call = multicallable(iter(feed), timeout=args.timeout)
                feed.attach(call)
                responses: Iterable[Message] = call
            else:
                future = multicallable.future(iter(feed), timeout=args.timeout)
                feed.attach(future)
                responses = [future.result()]
        else:
            request = codec.request(single_document(documents))
            call = multicallable(request, timeout=args.timeout)
            responses = call if method.server_streaming else [call]
        for response in responses:
            emit(codec.response_json(response, args.emit_defaults))
    except (grpc.RpcError, grpc.FutureCancelledError) as error:
        if feed is not None and feed.error is not None:  # we cancelled the call over a bad request
            raise UsageError(feed.error) from None
        if not isinstance(error, grpc.RpcError):
            raise
        return report_rpc_error(error, schema.pool)
    return EXIT_OK


def single_document(documents: Iterator[Any]) -> Any:
    found = list(documents)
    if len(found) > 1:
        raise UsageError(f"this method takes one request message, got {len(found)} JSON documents")
    return found[0] if found else {}


# --------------------------------------------------------------------------------------------
# Errors: the status, with google.rpc details decoded where the type is known.


def detail_to_dict(detail: AnyMessage, pool: descriptor_pool.DescriptorPool) -> dict[str, Any]:
    for candidate in (descriptor_pool.Default(), pool):
        try:
            return json_format.MessageToDict(detail, descriptor_pool=candidate)
        except (TypeError, KeyError, AssertionError, grpc.RpcError):
            continue
    return {"@type": detail.type_url, "value": base64.b64encode(detail.value).decode()}


def status_as_dict(error: grpc.RpcError, pool: descriptor_pool.DescriptorPool) -> dict[str, Any]:
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    report: dict[str, Any] = {"code": code.name, "message": error.details()}  # type: ignore[attr-defined]
    try:
        rich = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:
        rich = None
    if rich is not None and rich.details:
        report["details"] = [detail_to_dict(d, pool) for d in rich.details]
    return report


def report_rpc_error(error: grpc.RpcError, pool: descriptor_pool.DescriptorPool) -> int:
    print(json.dumps(status_as_dict(error, pool), indent=2, ensure_ascii=False), file=sys.stderr)
    return EXIT_RPC_BASE + error.code().value[0]  # type: ignore[attr-defined, no-any-return]


# --------------------------------------------------------------------------------------------
# Command line.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lgrpcurl", description="Call a gRPC server through its reflection service; JSON in, JSON out."
    )
    parser.add_argument("--plaintext", action="store_true", help="no TLS (h2c)")
    parser.add_argument("--cacert", help="PEM file of the CA that signed the server certificate (TLS)")
    parser.add_argument("--token", help="send 'authorization: Bearer TOKEN' on every call")
    parser.add_argument(
        "-H", "--header", action="append", default=[], help="extra metadata 'name: value' (repeatable)"
    )
    parser.add_argument("address", help="HOST:PORT")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="services, or the methods of one service")
    listing.add_argument("service", nargs="?")
    describing = commands.add_parser("describe", help="a service, method, message or enum")
    describing.add_argument("symbol")
    calling = commands.add_parser("call", help="invoke a method")
    calling.add_argument("method", help="package.Service/Method")
    calling.add_argument("-d", "--data", help="JSON request; @FILE or @- (stdin) for a file of documents")
    calling.add_argument("--timeout", type=float, help="deadline of the call in seconds")
    calling.add_argument(
        "--emit-defaults", action="store_true", help="also print fields holding default values"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    channel = open_channel(args)
    try:
        schema = Schema(channel)
        if args.command == "list" and args.service is None:
            print("\n".join(schema.services()))
        elif args.command == "list":
            service = schema.service(args.service)
            print("\n".join(f"{service.full_name}/{m.name}" for m in service.methods))
        elif args.command == "describe":
            print(describe(schema.symbol(args.symbol)))
        else:
            return call_method(channel, schema, schema.method(args.method), args)
        return EXIT_OK
    except grpc.RpcError as error:  # reflection itself failed: no server, no reflection, refused
        return report_rpc_error(error, descriptor_pool.Default())
    finally:
        channel.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as exc:
        print(f"lgrpcurl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (| head): not an error
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
