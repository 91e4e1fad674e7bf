"""Server-sent events and stream merging for the streaming endpoints.

An SSE stream is a sequence of `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`.
A completion request with several prompts runs one engine request per prompt; `merge_streams`
interleaves their outputs in arrival order, tagged with the prompt's index.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Type names only: the proxy (pagedserve/proxy/) uses the SSE helpers without loading an engine.
    from pagedserve.engine.async_llm import RequestStream
    from pagedserve.outputs import RequestOutput

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(json_text: str) -> str:
    return f"data: {json_text}\n\n"


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (stream index, output) from all streams as outputs arrive; aborts them all if closed early.

    One stream is iterated directly (the common case, no extra tasks). Errors of any stream
    (EngineDeadError) propagate to the caller.
    """
    try:
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, output
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
                queue.put_nowait((index, None))
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((index, error))

        tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
        try:
            num_open = len(streams)
            while num_open:
                index, item = await queue.get()
                if item is None:
                    num_open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
    finally:
        for stream in streams:
            stream.close()
