"""Reading a whole HTTP answer body with a size cap (aiohttp).

`StreamReader.read(n)` returns *up to* n bytes, whatever has arrived so far, so
it cannot be used to read "the body, at most n bytes": a JSON answer split
across TCP segments would come back cut. `read_capped` reads to the end, and
stops as soon as the body is known to exceed the cap (declared Content-Length
or bytes received), so a runaway answer cannot fill memory.
"""

from __future__ import annotations

import aiohttp

__all__ = ["READ_CHUNK_BYTES", "read_capped"]

#: Bytes per read from the connection while collecting a body.
READ_CHUNK_BYTES = 64 * 1024


async def read_capped(response: aiohttp.ClientResponse, limit_bytes: int) -> bytes | None:
    """The whole body of `response`, or None when it is longer than `limit_bytes`."""
    declared = response.content_length
    if declared is not None and declared > limit_bytes:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
        body += chunk
        if len(body) > limit_bytes:
            return None
    return bytes(body)
