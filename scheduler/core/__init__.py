"""The pure scheduling core: header parsing and bands, scores and settings, the waiting
queue and its pick, the trace simulator. It imports nothing of Django, asyncio, httpx or a
clock: time comes in as an argument, so every ordering question is a table test."""
