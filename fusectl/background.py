"""Work on a thread of its own beside the caller's: :class:`Background`.

fusectl runs one piece of GIL-free work (``memcmp`` of mapped pages, ``zlib.crc32``,
``preadv``) beside the caller's own and then waits for it; the thread is a daemon, so an
interrupted command is not kept waiting for it.

>>> Background(lambda: 6 * 7).result()
42
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """``work()`` on a daemon thread from now; ``result()`` waits for it and returns its value
    or raises its error."""

    def __init__(self, work: Callable[[], T], name: str = "fusectl-background"):
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._value = work()
        except BaseException as e:  # handed to result()
            self._error = e

    def result(self) -> T:
        """The work's value, once it is done; its error raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
