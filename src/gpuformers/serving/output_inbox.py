"""OutputInbox: where a request's engine outputs wait for its handler in the event loop (job.py), only the latest
output of each choice kept.

Each output the engine publishes holds everything its request has so far (all its tokens, logprobs, status), so an
output that arrives while an earlier one of the same choice is still unread replaces it. When the event loop is
behind the engine (a busy API server, a CPU shared with the engine), one read then covers several engine steps: one
detokenizer pass, one SSE chunk and one socket write for several tokens, instead of one each per token, so a server
that falls behind does less work per token and catches up, instead of queueing outputs without bound. A loop that
keeps up reads every output, one chunk per token as before.

    engine step k:    put(0, out_k)                      inbox {0: out_k}
    engine step k+1:  put(0, out_k+1)                    inbox {0: out_k+1}   (out_k never read: out_k+1 holds it)
    handler:          get() -> (0, out_k+1)

Used in one event loop's thread (LoopRelay delivers into it there; loop_relay.py). Offers: OutputInbox.
"""

from __future__ import annotations

import asyncio
from typing import Any


class OutputInbox:
    """`put_nowait((choice, output))` keeps the choice's latest output; `put_nowait(marker)` (any other object, e.g.
    job.CHECK_CLIENT) is returned once by a get() when no output waits; `await get()` -> (choice, output) or the
    marker. Choices come out in the order their first unread output came in."""

    def __init__(self):
        self._latest: dict[int, Any] = {}
        self._marker: Any = None
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        if type(item) is tuple:
            choice, output = item
            self._latest[choice] = output
        else:
            self._marker = item
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._latest and self._marker is None

    async def get(self) -> Any:
        while not self._latest and self._marker is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._latest:
            choice = next(iter(self._latest))
            return choice, self._latest.pop(choice)
        marker, self._marker = self._marker, None
        return marker
