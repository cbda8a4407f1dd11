"""``globalConcurrencyLimit``: how many inference requests are in the server, counted from
their arrival until their task ends (their answer sent or their client gone), every model
and peer together. One over the limit is refused with 429 at once, before it is parsed or
queued (llama-swap's semaphore at the top of its inference chain, #1086)."""

from __future__ import annotations

import asyncio

_active = 0


def active() -> int:
    """Inference requests in the server now."""
    return _active


def enter(limit: int) -> bool:
    """Count the current task's request in; False (not counted) when ``limit`` (> 0) are
    already in. The count drops when the task ends, whatever ends it."""
    global _active
    task = asyncio.current_task()
    if task is None:
        return True
    if _active >= limit:
        return False
    _active += 1
    task.add_done_callback(_leave)
    return True


def _leave(_task: asyncio.Task[object]) -> None:
    global _active
    _active -= 1
