"""Fair turns between client requests, and the threads that process inputs.

``RoundRobin`` keeps items by group (a client request: all the prompts of one
``POST /v1/completions``) and hands them out one group at a time, in turn: a
group that queued 5,000 prompts gets one turn, then a group that came later
with one prompt gets the next. ``AsyncLLM`` uses it twice: ``InputPool``'s
threads take the jobs of processing requests' inputs (tokenizing, decoding
audio, validating) in that order, and its engine thread feeds the processed
requests to the scheduler in that order.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Hashable
from concurrent.futures import Future
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class RoundRobin(Generic[T]):
    """Items in groups; :meth:`pop` takes the oldest item of the group whose turn it is.
    Not thread-safe: its owner locks."""

    def __init__(self) -> None:
        self._groups: OrderedDict[Hashable, deque[T]] = OrderedDict()  # in turn order
        self._len = 0

    def push(self, group: Hashable, item: T) -> None:
        items = self._groups.get(group)
        if items is None:  # a new group takes its turn after those waiting
            items = self._groups[group] = deque()
        items.append(item)
        self._len += 1

    def pop(self) -> T:
        """``IndexError`` when empty."""
        if not self._groups:
            raise IndexError("pop from an empty RoundRobin")
        group, items = next(iter(self._groups.items()))
        item = items.popleft()
        self._len -= 1
        if items:
            self._groups.move_to_end(group)  # its next item waits for every other group's turn
        else:
            del self._groups[group]
        return item

    def __len__(self) -> int:
        return self._len


class InputPool:
    """Worker threads running submitted calls, groups in turn (started on first use)."""

    def __init__(self, workers: int, name: str = "tandem-input") -> None:
        self._workers, self._name = workers, name
        self._jobs: RoundRobin[tuple[Future, Callable, tuple]] = RoundRobin()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, group: Hashable, fn: Callable[..., Any], *args: Any) -> Future:
        """A future of ``fn(*args)``; cancelling it before a worker takes it skips the call."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the input pool is shut down")
            if not self._threads:
                for i in range(self._workers):
                    t = threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            self._jobs.push(group, (future, fn, args))
            self._cond.notify()
        return future

    def shutdown(self, error: BaseException) -> None:
        """Fail the calls not started with ``error`` (a cancelled future would read as
        its awaiter's own cancellation); the running ones finish on their (daemon) threads."""
        with self._cond:
            self._closed = True
            while len(self._jobs):
                future = self._jobs.pop()[0]
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not len(self._jobs) and not self._closed:
                    self._cond.wait()
                if not len(self._jobs):
                    return
                future, fn, args = self._jobs.pop()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the submitter's to handle
                future.set_exception(e)
            del future, fn, args  # hold no request's data while waiting for the next
