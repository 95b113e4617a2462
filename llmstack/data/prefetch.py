"""Batches read ahead of training in a background thread, with a resume state that stays exact.

    batches = Prefetcher(stream.micro_batches(...), depth=2, snapshot=stream.state_dict)
    batch = next(batches)          # waits only if the reader fell behind
    state = batches.state_dict()   # the position after the batch last *returned*, not the last read

The reader thread runs the iterator `depth` items ahead, plus the one it waits to queue (reading,
tokenizing, packing and collating overlap the model's forward and backward, whose kernels release
the GIL).
A stream whose position is saved in checkpoints gives `snapshot`: it is called in the reader thread
right after each item, while the iterator is suspended just past it, and `state_dict()` returns the
snapshot that came with the item last handed out. So a checkpoint records what training consumed,
however far the reader ran ahead. With `depth=0` items are read on demand, in the caller's thread.
"""

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_END = object()  # the iterator is exhausted


class Prefetcher(Generic[T]):
    def __init__(self, iterator: Iterator[T], depth: int = 2, snapshot: Callable[[], Any] | None = None) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self._iterator, self._snapshot = iterator, snapshot
        self._state: Any = None
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[Any, Any]] = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._read, name="llmstack-prefetch", daemon=True)
            self._thread.start()

    def _next_with_state(self) -> tuple[Any, Any]:
        item = next(self._iterator, _END)
        return item, (self._snapshot() if self._snapshot is not None and item is not _END else None)

    def _read(self) -> None:
        """The reader thread: items with their snapshots into the queue until the end, an error, or close()."""
        while not self._stop.is_set():
            try:
                entry = self._next_with_state()
            except BaseException as error:  # handed to the consumer, raised there
                entry = (error, None)
            while not self._stop.is_set():
                try:
                    self._queue.put(entry, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if entry[0] is _END or isinstance(entry[0], BaseException):
                return

    def __iter__(self) -> "Prefetcher[T]":
        return self

    def __next__(self) -> T:
        item, state = self._queue.get() if self._thread is not None else self._next_with_state()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self._state = state
        return item

    def state_dict(self) -> Any:
        """The snapshot taken just after the item last returned (None before the first, or without `snapshot`)."""
        return self._state

    def close(self) -> None:
        """Stop the reader thread (items it read ahead are dropped)."""
        self._stop.set()
        if self._thread is not None:
            while True:  # unblock a reader waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=10)
