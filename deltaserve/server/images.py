"""Image parts of chat requests -> prompt ids + the tower's embeddings, admitted cheaply first.

Order (a refused request pays as little as possible): the model takes images at all, the image
count, the queue has room; then, off the event loop, every image's header (format, pixels, and the
request's visual tokens counted from the sizes), decoding and slicing, the context limit; the
tower runs last, on the engine thread between steps.
"""

from __future__ import annotations

import asyncio

from deltaserve.errors import RequestError
from deltaserve.server.errors import ApiError, context_overflow


def check_image_parts(llm, sources: list) -> None:
    """Refusals that need no decoding: a text-only model, too many images, a full queue."""
    if llm.images is None:
        raise ApiError(400, f"messages: {llm.no_images_reason}", param="messages")
    for source in sources:  # never a path on the server's disk, never a fetch
        if not (isinstance(source, str) and source.startswith("data:")):
            shown = source[:40] + "..." if isinstance(source, str) and len(source) > 40 else source
            what = ("http(s) URLs are not fetched" if isinstance(source, str)
                    and source.startswith(("http://", "https://")) else f"got {shown!r}")
            raise ApiError(400, f"messages: an image_url must be a data: URL ({what})",
                           "invalid_image", "messages")
    limit = llm.images.limits.max_images
    if len(sources) > limit:
        raise ApiError(400, f"messages: {len(sources)} images in one request; the limit is "
                       f"{limit}", param="messages")
    engine = llm._engine  # not llm.engine: while the host rebuilds it, that would build another
    scheduler = engine.scheduler if engine is not None else None
    if scheduler is not None and scheduler.num_waiting >= scheduler.config.max_waiting:
        raise ApiError(503, f"the queue is full (max_waiting={scheduler.config.max_waiting}); "
                       "retry later", "queue_full")


async def image_prompt(llm, driver, text: str, sources: list, mode: str | None,
                       markers: dict[str, str]):
    """(prompt ids, ImageInputs) for a rendered chat text with one placeholder per image
    (markers: chat.ChatText's, special-token strings from the messages kept as text)."""
    check_image_parts(llm, sources)
    try:
        processed = await asyncio.to_thread(llm.images.process, sources, mode)
        ids = await asyncio.to_thread(llm.images.expand, text, processed,
                                      lambda t: llm.tokenizer.encode_chat(t, markers))
    except RequestError as exc:
        raise ApiError(400, f"messages: {exc}", "invalid_image", "messages") from exc
    if len(ids) >= llm.max_model_len:
        raise context_overflow(len(ids), llm.max_model_len, 1)
    return ids, await driver.call(lambda: llm.images.inputs(ids, processed))
