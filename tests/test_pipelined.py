"""answers_in_order and answers_as_done: a client stream read on while earlier answers wait, answered in the
order it came or as each answer is ready."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from lightning_grpc.pipelined import answers_as_done, answers_in_order


class Stream:
    """A client stream the test feeds one message at a time, recording when each one was read."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.read: list[object] = []

    async def messages(self) -> AsyncIterator[object]:
        while True:
            item = await self.queue.get()
            if item is StopAsyncIteration:
                return
            if isinstance(item, Exception):
                raise item
            self.read.append(item)
            yield item


async def collect(answers: AsyncIterator[str], into: list[str]) -> None:
    async for answer in answers:
        into.append(answer)


async def settle() -> None:
    """Long enough for the loop to run everything that is ready."""
    await asyncio.sleep(0.05)


async def test_later_messages_are_taken_while_an_answer_waits_and_answers_keep_their_order() -> None:
    stream = Stream()
    commits: dict[int, asyncio.Future[str]] = {}

    def take(message: object) -> str | asyncio.Task[str]:
        n = int(str(message))
        if n % 2:  # odd messages answer at once, even ones when the test says so
            return f"answer {n}"
        commits[n] = asyncio.get_running_loop().create_future()
        return asyncio.ensure_future(commits[n])

    got: list[str] = []
    task = asyncio.ensure_future(collect(answers_in_order(stream.messages(), take, depth=8), got))
    for n in (1, 2, 3, 4, 5):
        stream.queue.put_nowait(n)
    await settle()
    assert stream.read == [1, 2, 3, 4, 5]  # read on although 2 is not answered
    assert got == ["answer 1"]  # 3 and 5 wait behind 2
    commits[4].set_result("answer 4")
    await settle()
    assert got == ["answer 1"]
    commits[2].set_result("answer 2")
    await settle()
    assert got == ["answer 1", "answer 2", "answer 3", "answer 4", "answer 5"]
    stream.queue.put_nowait(StopAsyncIteration)
    await asyncio.wait_for(task, 1)


async def test_no_more_than_depth_answers_wait_before_the_stream_is_read_further() -> None:
    stream = Stream()
    pending: list[asyncio.Future[str]] = []

    def take(message: object) -> asyncio.Task[str]:
        pending.append(asyncio.get_running_loop().create_future())
        return asyncio.ensure_future(pending[-1])

    got: list[str] = []
    task = asyncio.ensure_future(collect(answers_in_order(stream.messages(), take, depth=3), got))
    for n in range(6):
        stream.queue.put_nowait(n)
    await settle()
    assert stream.read == [0, 1, 2]
    pending[0].set_result("a0")
    await settle()
    assert got == ["a0"] and stream.read == [0, 1, 2, 3]
    for i in range(1, 6):  # each answer given lets one more message in
        assert len(stream.read) == min(6, i + 3)
        pending[i].set_result(f"a{i}")
        await settle()
    stream.queue.put_nowait(StopAsyncIteration)
    await asyncio.wait_for(task, 1)
    assert got == [f"a{i}" for i in range(6)]


async def test_a_stream_that_ends_or_fails_first_gets_every_answer_already_owed() -> None:
    for ending in (StopAsyncIteration, ConnectionError("the client went away")):
        stream = Stream()
        commit: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def take(message: object, commit: asyncio.Future[str] = commit) -> asyncio.Task[str]:
            return asyncio.ensure_future(commit)

        got: list[str] = []
        task = asyncio.ensure_future(collect(answers_in_order(stream.messages(), take, depth=4), got))
        stream.queue.put_nowait(1)
        stream.queue.put_nowait(ending)
        await settle()
        assert not task.done()  # the answer owed is waited for
        commit.set_result("stored")
        await settle()
        assert got == ["stored"]
        if ending is StopAsyncIteration:
            await asyncio.wait_for(task, 1)
        else:
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(task, 1)


async def test_an_answer_that_fails_ends_the_stream_at_its_turn() -> None:
    stream = Stream()

    async def fail() -> str:
        raise RuntimeError("the commit failed")

    def take(message: object) -> str | asyncio.Task[str]:
        return asyncio.ensure_future(fail()) if message == 2 else f"answer {message}"

    got: list[str] = []
    for n in (1, 2, 3):
        stream.queue.put_nowait(n)
    with pytest.raises(RuntimeError, match="the commit failed"):
        await asyncio.wait_for(collect(answers_in_order(stream.messages(), take, depth=4), got), 1)
    assert got == ["answer 1"]


# ---------------------------------------------------------------------- answers_as_done


class Handler:
    """Handles message n by waiting until the test releases n (or fails it)."""

    def __init__(self) -> None:
        self.release: dict[int, asyncio.Future[None]] = {}
        self.started: list[int] = []

    async def __call__(self, message: object) -> str:
        n = int(str(message))
        self.started.append(n)
        self.release[n] = asyncio.get_running_loop().create_future()
        await self.release[n]
        return f"answer {n}"


async def test_each_message_is_answered_as_soon_as_it_is_done_whatever_came_before() -> None:
    stream, handle = Stream(), Handler()
    got: list[str] = []
    task = asyncio.ensure_future(collect(answers_as_done(stream.messages(), handle, depth=8), got))
    for n in (1, 2, 3):
        stream.queue.put_nowait(n)
    await settle()
    assert handle.started == [1, 2, 3]  # all handled at once
    handle.release[3].set_result(None)
    await settle()
    assert got == ["answer 3"]  # 1 and 2 still wait, and do not hold 3 up
    handle.release[1].set_result(None)
    handle.release[2].set_result(None)
    stream.queue.put_nowait(StopAsyncIteration)
    await asyncio.wait_for(task, 2)
    assert got == ["answer 3", "answer 1", "answer 2"]


async def test_no_more_than_depth_messages_are_handled_at_once() -> None:
    stream, handle = Stream(), Handler()
    got: list[str] = []
    task = asyncio.ensure_future(collect(answers_as_done(stream.messages(), handle, depth=2), got))
    for n in (1, 2, 3, 4):
        stream.queue.put_nowait(n)
    await settle()
    assert handle.started == [1, 2]  # 3 waits for room
    handle.release[2].set_result(None)
    await settle()
    assert handle.started == [1, 2, 3] and got == ["answer 2"]
    for n in (1, 3):
        handle.release[n].set_result(None)
    await settle()
    handle.release[4].set_result(None)
    stream.queue.put_nowait(StopAsyncIteration)
    await asyncio.wait_for(task, 2)
    assert sorted(got) == ["answer 1", "answer 2", "answer 3", "answer 4"]


async def test_a_read_error_ends_the_stream_after_the_messages_read_are_answered() -> None:
    stream, handle = Stream(), Handler()
    got: list[str] = []
    task = asyncio.ensure_future(collect(answers_as_done(stream.messages(), handle, depth=8), got))
    stream.queue.put_nowait(1)
    stream.queue.put_nowait(ConnectionError("drained"))
    await settle()
    assert not task.done()  # message 1 is still owed its answer
    handle.release[1].set_result(None)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(task, 2)
    assert got == ["answer 1"]


async def test_a_handler_error_ends_the_stream_at_once_and_cancels_the_others() -> None:
    stream, handle = Stream(), Handler()
    got: list[str] = []
    task = asyncio.ensure_future(collect(answers_as_done(stream.messages(), handle, depth=8), got))
    stream.queue.put_nowait(1)
    stream.queue.put_nowait(2)
    await settle()
    handle.release[2].set_exception(RuntimeError("store gone"))
    with pytest.raises(RuntimeError, match="store gone"):
        await asyncio.wait_for(task, 2)
    await settle()
    assert got == [] and handle.release[1].cancelled()


async def test_a_handler_that_never_waits_is_answered_at_once_while_another_waits() -> None:
    stream, waiting = Stream(), Handler()

    async def handle(message: object) -> str:
        n = int(str(message))
        if n == 1:
            return await waiting(message)
        if n == 3:
            raise LookupError("no such thing")
        return f"at once {n}"

    got: list[str] = []
    task = asyncio.ensure_future(collect(answers_as_done(stream.messages(), handle, depth=8), got))
    stream.queue.put_nowait(1)
    stream.queue.put_nowait(2)
    await settle()
    assert got == ["at once 2"]  # answered while 1 waits
    stream.queue.put_nowait(3)
    with pytest.raises(LookupError):
        await asyncio.wait_for(task, 2)
    await settle()
    assert waiting.release[1].cancelled()


async def test_a_handler_whose_wait_times_out_cancels_itself_and_the_stream_goes_on() -> None:
    """asyncio.timeout (and, from Python 3.12, asyncio.wait_for, built on it) cancels the task that entered it:
    each handler is that task from its first line, so a claim's wait that runs out does not stop the stream
    being read (a session that stopped reading left its runner's heartbeats and claims unanswered)."""
    stream = Stream()
    never = asyncio.Event()
    tasks: dict[object, tuple[asyncio.Task[object] | None, asyncio.Task[object] | None]] = {}

    async def handle(message: object) -> str:
        first = asyncio.current_task()
        try:
            if message == "timeout":
                async with asyncio.timeout(0.05):
                    await never.wait()
            else:
                await asyncio.wait_for(never.wait(), 0.05)
        except TimeoutError:
            tasks[message] = (first, asyncio.current_task())
            return f"{message}: waited out"
        return f"{message}: woken"

    got: list[str] = []
    task = asyncio.ensure_future(collect(answers_as_done(stream.messages(), handle, depth=8), got))
    for message in ("timeout", "wait_for"):
        stream.queue.put_nowait(message)
        await asyncio.sleep(0.2)
    stream.queue.put_nowait("wait_for again")
    await asyncio.sleep(0.2)
    stream.queue.put_nowait(StopAsyncIteration)
    await asyncio.wait_for(task, 2)
    assert got == ["timeout: waited out", "wait_for: waited out", "wait_for again: waited out"]
    for first, last in tasks.values():
        assert first is last and first is not None  # one task of its own, from its first line


async def test_a_stream_whose_reader_is_cancelled_ends_with_an_error_instead_of_hanging() -> None:
    async def messages() -> AsyncIterator[object]:
        yield 1
        reader = asyncio.current_task()
        assert reader is not None
        reader.cancel()  # what a stray timeout did to the reader before each handler was its own task
        await asyncio.sleep(1)
        yield 2

    async def handle(message: object) -> str:
        return f"answer {message}"

    got: list[str] = []
    with pytest.raises(RuntimeError, match="reader was cancelled"):
        await asyncio.wait_for(collect(answers_as_done(messages(), handle, depth=8), got), 2)
    assert got == ["answer 1"]
