"""LoopRelay: items put by other threads, delivered into asyncio queues of one event loop, with one wakeup of the loop
per burst instead of one per item.

The engine's thread publishes each streaming request's outputs through the request's on_output callback (job.py),
which must hand them to the server's event loop. At 256 streaming requests an engine step publishes 256 outputs at
once; waking the loop for each (`call_soon_threadsafe` writes a byte to the loop's self-pipe, the loop reads it back
and runs one callback) cost more than the rest of the token's path. Here a put appends to one deque, and only the
put that finds no delivery scheduled schedules one; the delivery, in the loop, empties the deque:

    engine thread: put(q1, a)  put(q2, b)  put(q1, c)        (deque: a b c; one call_soon_threadsafe, for a)
    event loop:    _deliver -> q1.put_nowait(a), q2.put_nowait(b), q1.put_nowait(c)

Items of one thread arrive in the order it put them. Offers: LoopRelay.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any


class LoopRelay:
    """`put(queue, item)` from any thread -> `queue.put_nowait(item)` in `loop`'s thread, soon."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: collections.deque = collections.deque()  # (queue, item), oldest first
        # True from the put that schedules a delivery until that delivery starts: later puts ride along with it.
        # The delivery clears it before it empties the deque, so an item appended after the clear gets a new one.
        self._scheduled = False

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        """Hand `item` to `queue` in the loop; RuntimeError when the loop is closed (as call_soon_threadsafe)."""
        self._pending.append((queue, item))
        if not self._scheduled:
            self._scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:
                self._scheduled = False
                raise

    def _deliver(self) -> None:
        self._scheduled = False
        pending = self._pending
        while pending:
            queue, item = pending.popleft()
            queue.put_nowait(item)
