"""The application's message handler, as a worker pool calls it.

A handler is ``async def handler(message)`` (run on the event loop) or a plain function (run in
a thread pool of the pool's size, so a blocking call does not stall the loop). What it does to
the message is said by how it ends: it returns (ack), raises :class:`RetryMessage` (retry after
the delay it asks for), raises :class:`RejectMessage` (dead-letter now), raises any other
exception (retry with the topic's backoff policy). A handler may also settle the message itself
(``await message.reject(...)``); the pool then leaves it as the handler settled it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tracker.errors import InvalidDelay
from tracker.protocol import MAX_DELAY_MS

from .message import KmqMessage

#: What ``KmqConsumer.run`` accepts: ``async def handler(message)`` or ``def handler(message)``.
Handler = Callable[[KmqMessage], Any]


class RetryMessage(Exception):
    """Raised by a handler: redeliver this message after ``delay`` (None: the topic's backoff).

    Unlike any other exception, it is not logged as a failure: the handler chose to retry.
    """

    def __init__(self, reason: str = "", *, delay: timedelta | None = None) -> None:
        super().__init__(reason)
        if delay is not None:
            if not isinstance(delay, timedelta):
                raise InvalidDelay(f"delay must be a datetime.timedelta, got {delay!r}")
            if not timedelta(0) <= delay <= timedelta(milliseconds=MAX_DELAY_MS):
                raise InvalidDelay(f"a retry delay of {delay} is out of range")
        self.reason = reason
        self.delay = delay


class RejectMessage(Exception):
    """Raised by a handler: the message is poison; dead-letter it now with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class HandlerReturnedAwaitable(TypeError):
    """A handler run in a thread returned an awaitable: it should be declared ``async def``
    (or passed with ``blocking=False``)."""


def is_async_handler(handler: Handler) -> bool:
    """Whether ``handler`` is a coroutine function (a partial of one, or an object whose
    ``__call__`` is one)."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - the callable object's method
    )


class HandlerCaller:
    """Calls the handler for one message: awaited on the loop, or in the pool's threads."""

    def __init__(self, handler: Handler, *, blocking: bool | None, threads: int) -> None:
        if not callable(handler):
            raise TypeError(f"the handler must be callable, got {type(handler).__name__}")
        self._handler = handler
        self.blocking = not is_async_handler(handler) if blocking is None else blocking
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        #: the thread of each worker's call the worker stopped waiting for
        self._threads: dict[asyncio.Task[None], asyncio.Future[Any]] = {}
        if self.blocking:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix="kmq-handler"
            )

    async def __call__(self, message: KmqMessage) -> None:
        if self._executor is None:
            result = self._handler(message)
            if inspect.isawaitable(result):
                await result
            return
        thread = asyncio.wrap_future(self._executor.submit(self._handler, message))
        task = asyncio.current_task()
        if task is not None:
            self._threads[task] = thread
        try:
            # Shielded: cancelling the caller (a time-out, a stop) cannot stop the thread;
            # thread_ended() waits for it.
            result = await asyncio.shield(thread)
        finally:
            if task is not None and thread.done():
                del self._threads[task]
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()  # never awaited: no "coroutine was never awaited" warning
            raise HandlerReturnedAwaitable(
                "the handler ran in a thread and returned an awaitable; declare it "
                "`async def`, or pass blocking=False"
            )

    async def thread_ended(self, task: asyncio.Task[None]) -> None:
        """Wait until the thread of ``task``'s last (cancelled) call has returned."""
        thread = self._threads.pop(task, None)
        if thread is not None:
            await asyncio.wait((thread,))
            if not thread.cancelled():
                thread.exception()  # its outcome is not used; retrieved, so not "lost"

    def close(self) -> None:
        """Let the threads go; a thread still inside a handler (one that outlived
        ``max_processing``) finishes on its own, its result unused."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
