"""The sidecar's relay run on an answer in hand, its ASGI messages kept: for tests of what a
client is sent, with no server on either side."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from sidecar.http.relay import ClientWatch, Relay


async def relay_into(sent: list[dict[str, Any]], response: httpx.Response, **kwargs: Any) -> bool:
    """``Relay.relay`` of ``response`` to a client that never leaves, each ASGI message it sends
    appended to ``sent`` (kept when the relay raises); ``kwargs`` go to ``Relay.relay``."""

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    relay = Relay(httpx.AsyncHTTPTransport(), "http://127.0.0.1:1", httpx.Timeout(1.0))
    watch = ClientWatch(receive)
    try:
        return await relay.relay(response, send, watch, **kwargs)
    finally:
        watch.close()
