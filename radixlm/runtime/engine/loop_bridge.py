"""Calling coroutines and async iterators that live on another thread's event loop.

The RequestTracker runs on one loop, the Engine's own, in its background thread; callers
may sit on any thread or loop (a server's among them). These helpers run the work on its
loop and hand the results back, and run it directly, with no hop, when the caller is
already on that loop.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

_END = object()


async def run_on_loop(coroutine: Coroutine, loop: asyncio.AbstractEventLoop) -> Any:
    """Awaits ``coroutine`` on ``loop`` from the caller's loop."""
    if asyncio.get_running_loop() is loop:
        return await coroutine
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, loop))


def run_on_loop_blocking(coroutine: Coroutine, loop: asyncio.AbstractEventLoop,
                         timeout: float | None = None) -> Any:
    """Runs ``coroutine`` on ``loop`` and blocks this thread until it is done. Refused on
    ``loop``'s own thread, where it would wait on itself forever. Interrupted (Ctrl-C in a
    notebook) or timed out, the coroutine is cancelled, so its cleanup runs."""
    if _running_loop() is loop:
        coroutine.close()
        raise RuntimeError("a blocking Engine call from the event loop the Engine runs on "
                           "would wait on itself: await the async_ method instead")
    future = asyncio.run_coroutine_threadsafe(coroutine, loop)
    try:
        return future.result(timeout)
    except BaseException:
        future.cancel()
        raise


def iterate_on_loop(iterator: AsyncIterator, loop: asyncio.AbstractEventLoop,
                    async_consumer: bool = False) -> Iterator | AsyncIterator:
    """``iterator`` (which runs on ``loop``) as a plain iterator for a thread, or with
    ``async_consumer`` as an async iterator for another loop. Closing the result early
    stops ``iterator`` (so its own cleanup runs); its errors reach the consumer."""
    if async_consumer:
        return _async_bridge(iterator, loop)
    if _running_loop() is loop:
        raise RuntimeError("a blocking stream from the event loop the Engine runs on would "
                           "wait on itself: use async_generate instead")
    return _sync_bridge(iterator, loop)


def _sync_bridge(iterator: AsyncIterator, loop: asyncio.AbstractEventLoop) -> Iterator:
    items: queue.Queue = queue.Queue()

    async def pump() -> None:
        try:
            async for item in iterator:
                items.put(item)
            items.put(_END)
        except BaseException as err:  # handed to the consumer's thread
            items.put(err)

    future = asyncio.run_coroutine_threadsafe(pump(), loop)
    try:
        while (item := items.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        if not future.done():
            future.cancel()  # the iterator's own cleanup runs on its loop


async def _async_bridge(iterator: AsyncIterator, loop: asyncio.AbstractEventLoop) -> AsyncIterator:
    consumer = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in iterator:
                consumer.call_soon_threadsafe(items.put_nowait, item)
            consumer.call_soon_threadsafe(items.put_nowait, _END)
        except BaseException as err:
            consumer.call_soon_threadsafe(items.put_nowait, err)

    future = asyncio.run_coroutine_threadsafe(pump(), loop)
    try:
        while (item := await items.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        if not future.done():
            future.cancel()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
