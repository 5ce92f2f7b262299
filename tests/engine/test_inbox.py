"""The scheduler thread's hand-over to the event loop: every event, in order, one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from lightning_grpc.engine.inbox import LoopInbox


async def test_a_burst_from_another_thread_arrives_whole_and_in_order_on_one_wakeup() -> None:
    inbox = LoopInbox(asyncio.get_running_loop())
    queues: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in range(3)]

    def scheduler_step() -> None:
        for i in range(900):
            inbox.put(queues[i % 3], i)

    worker = threading.Thread(target=scheduler_step)
    worker.start()
    worker.join()  # the loop is held here, as while it serves other requests: the burst waits for it
    got = [[await asyncio.wait_for(q.get(), 5) for _ in range(300)] for q in queues]

    assert got == [list(range(k, 900, 3)) for k in range(3)]
    assert inbox.wakeups == 1
    assert all(q.empty() for q in queues)


async def test_an_event_after_a_drain_wakes_the_loop_again() -> None:
    inbox = LoopInbox(asyncio.get_running_loop())
    queue: asyncio.Queue[Any] = asyncio.Queue()
    for item in ("first", "second"):
        threading.Thread(target=inbox.put, args=(queue, item)).start()
        assert await asyncio.wait_for(queue.get(), 5) == item
    assert inbox.wakeups == 2


def test_a_closed_loop_refuses_every_event_instead_of_parking_it() -> None:
    loop = asyncio.new_event_loop()
    inbox = LoopInbox(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        inbox.put(asyncio.Queue(), "lost")  # the scheduler's _safe_sink cancels that request
    with pytest.raises(RuntimeError):
        inbox.put(asyncio.Queue(), "lost too")  # refused again, not parked behind a wake-up that never comes
