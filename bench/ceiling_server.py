"""The Python gRPC ceiling: a grpc.aio server that parses span batches and stores nothing.

It answers the same methods with the same messages as the Store, so the same driver measures
both; the gap between them is what storing costs.

    python bench/ceiling_server.py --port 0      # prints "READY <port>"
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_grpc.v1 import store_service_pb2 as pb

SERVICE = "lightning.v1.StoreService"


async def add_spans(request: pb.AddSpansRequest, context: grpc.aio.ServicerContext) -> pb.AddSpansResponse:
    return pb.AddSpansResponse(stored_count=len(request.spans))


async def add_spans_stream(
    requests: AsyncIterator[pb.AddSpansStreamRequest], context: grpc.aio.ServicerContext
) -> AsyncIterator[pb.AddSpansStreamResponse]:
    async for batch in requests:
        yield pb.AddSpansStreamResponse(batch_id=batch.batch_id, stored_count=len(batch.spans))


async def main(port: int) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
    )
    handlers = {
        "AddSpans": grpc.unary_unary_rpc_method_handler(
            add_spans,
            request_deserializer=pb.AddSpansRequest.FromString,
            response_serializer=pb.AddSpansResponse.SerializeToString,
        ),
        "AddSpansStream": grpc.stream_stream_rpc_method_handler(
            add_spans_stream,
            request_deserializer=pb.AddSpansStreamRequest.FromString,
            response_serializer=pb.AddSpansStreamResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(main(parser.parse_args().port))
