"""Answering a client stream while its next messages are already taken: in order, or as each is done.

A bidirectional stream whose answers wait for something slow (a span batch for its commit) would otherwise
take one message, wait, answer and only then read the next: one batch a commit per stream, however many the
client has sent. :func:`answers_in_order` reads on while earlier answers wait, so a stream's batches share
commits, and still answers each message, in the order the messages came, once its answer is ready.
:func:`answers_as_done` handles each message on its own and answers it as soon as it is done, whatever came
before it: a RunnerSession's claim that waits for a rollout does not hold up the outcomes sent after it, and
the span shipper's in-process sink hands each batch to the Store without waiting for the commits of those before.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

#: Whether tasks can start eagerly (Python 3.12 and later).
_EAGER = sys.version_info >= (3, 12)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def answers_in_order(
    messages: AsyncIterator[Req],
    take: Callable[[Req], Resp | asyncio.Future[Resp]],
    depth: int,
) -> AsyncGenerator[Resp, None]:
    """The answers to ``messages``, one each, in their order.

    ``take`` handles a message as soon as it is read, in the order read, and returns its answer or a future
    (a task) that ends with it; at most ``depth`` answers wait at once (the stream is read no further until
    the oldest is ready). When reading or taking a message raises, the answers already owed are given first
    and the error then ends the stream; when a future raises, its error ends the stream at its turn (the
    messages after it stay unanswered: a client resends what it has not seen answered).
    """
    owed: deque[Resp | asyncio.Future[Resp]] = deque()
    reading: asyncio.Future[Req] | None = None
    try:
        while True:
            while owed and _ready(owed[0]):
                yield _answer(owed.popleft())
            oldest = owed[0] if owed else None  # not ready: a future still pending
            if isinstance(oldest, asyncio.Future) and len(owed) >= depth:
                await asyncio.wait((oldest,))
                continue
            try:
                if reading is None and not isinstance(oldest, asyncio.Future):
                    message = await anext(messages)  # nothing owed: no task needed to read
                else:
                    if reading is None:
                        reading = asyncio.ensure_future(anext(messages))
                    waits: set[asyncio.Future[Any]] = {reading}
                    if isinstance(oldest, asyncio.Future):
                        waits.add(oldest)
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if not reading.done():
                        continue
                    done, reading = reading, None
                    message = done.result()
                owed.append(take(message))
            except StopAsyncIteration:
                break
            except Exception:
                while owed:
                    yield await _settled(owed.popleft())
                raise
        while owed:
            yield await _settled(owed.popleft())
    finally:
        if reading is not None:
            reading.cancel()
        for item in owed:  # unanswered: their errors are not news to anyone
            if isinstance(item, asyncio.Future):
                item.add_done_callback(_swallow)


def _ready(item: object) -> bool:
    return not isinstance(item, asyncio.Future) or item.done()


def _answer(item: Resp | asyncio.Future[Resp]) -> Resp:
    return item.result() if isinstance(item, asyncio.Future) else item


async def _settled(item: Resp | asyncio.Future[Resp]) -> Resp:
    return await item if isinstance(item, asyncio.Future) else item


def _swallow(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def answers_as_done(
    messages: AsyncIterator[Req],
    handle: Callable[[Req], Coroutine[Any, Any, Resp]],
    depth: int,
) -> AsyncGenerator[Resp, None]:
    """The answers to ``messages``, one each, as each is done (answers say which message they answer).

    Each message is handled as soon as it is read, in the order read, by a task of its own (on Python 3.12
    and later one started eagerly: a handler that finishes without waiting, as the memory store's calls do,
    is answered without a trip around the event loop); at most ``depth`` are handled at once (the stream is
    read no further until one is done). A handler runs as its own task from its first line, so
    ``asyncio.timeout`` and ``asyncio.wait_for`` in it (3.12 builds the latter on the former) cancel that
    handler and nothing else. When reading raises
    (the server drains), the messages already read are still answered and the error then ends the stream;
    when handling raises, the error ends the stream at once and the other handlers are cancelled (their
    messages stay unanswered: a client sends again what it has not seen answered).
    """
    done: asyncio.Queue[tuple[Resp | None, BaseException | None]] = asyncio.Queue()
    handling: set[asyncio.Task[Resp]] = set()
    room = asyncio.Semaphore(depth)

    def finished(task: asyncio.Task[Resp]) -> None:
        handling.discard(task)
        room.release()
        if not task.cancelled():
            error = task.exception()
            done.put_nowait((None, error) if error is not None else (task.result(), None))

    async def read() -> None:
        try:
            async for message in messages:
                await room.acquire()
                task = _started(handle(message))
                if task.done():  # answered without waiting
                    finished(task)
                    if task.cancelled() or task.exception() is not None:
                        return
                    continue
                handling.add(task)
                task.add_done_callback(finished)
        except Exception as exc:
            await _all_done(handling)
            done.put_nowait((None, exc))
            return
        await _all_done(handling)
        done.put_nowait((None, StopAsyncIteration()))

    def read_ended(task: asyncio.Task[None]) -> None:
        if task.cancelled():  # not by this generator (it stops waiting first): end the stream, not hang it
            done.put_nowait((None, RuntimeError("the stream's reader was cancelled")))

    reader = asyncio.ensure_future(read())
    reader.add_done_callback(read_ended)
    try:
        while True:
            answer, error = await done.get()
            if isinstance(error, StopAsyncIteration):
                return
            if error is not None:
                raise error
            yield answer  # type: ignore[misc]
    finally:
        reader.cancel()
        for task in list(handling):
            task.cancel()


def _started(coroutine: Coroutine[Any, Any, Resp]) -> asyncio.Task[Resp]:
    """``coroutine`` as a task: started at once where Python can (3.12's eager start: up to its first wait
    it runs right here, with the task as the current one), else on the loop's next turn."""
    if _EAGER:
        loop = asyncio.get_running_loop()
        return asyncio.Task(coroutine, loop=loop, eager_start=True)  # type: ignore[call-arg,unused-ignore]
    return asyncio.ensure_future(coroutine)


async def _all_done(tasks: set[asyncio.Task[Any]]) -> None:
    """Wait until ``tasks`` (a set that shrinks as its tasks end) is empty."""
    while tasks:
        await asyncio.wait(list(tasks))
