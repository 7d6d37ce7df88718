"""The messages between relay workers and the admission owner, and the channel that carries them.

A frame is a 4-byte big-endian length and a pickled list of messages; each message is a tuple
whose first item is its tag. Pickle is safe here: both ends are this package, in one pod, run by
one user, over a Unix socket in a directory only that user may open (mode 0700). A channel
gathers what one loop tick sends into one frame (one write, one wake-up of the peer), so a burst
of fire-and-forget messages costs one system call, not one each.

Worker to owner (``ask`` and ``res`` are the worker's and the owner's numbers)::

    HELLO      (index, pid)                     first message
    READY      ()                               its engine (prompt counter) is built
    ADMIT      (ask, projection, streamed, klass, prefix, pin, pinnable, key)
    CANCEL     (ask,)                           the client left while it waited
    STARTED    (res,)
    PROGRESSED (res, generated_per_sequence)    only when its block count may change
    RELEASE    (res, completion_tokens)
    REPORT     (metric events, passthrough in flight)

Owner to worker::

    SETTINGS   (settings, workers)              first message
    CONFIG     (engine config or None,)         on connect and whenever it changes
    DRAINING   (draining,)
    DECISION   (ask, outcome, reason, retry_after, message, waited_seconds, grant)

``grant`` is None or ``(res, reserved_blocks, engine, shadow engines)``.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

HELLO = "hello"
READY = "ready"
ADMIT = "admit"
CANCEL = "cancel"
STARTED = "started"
PROGRESSED = "progressed"
RELEASE = "release"
REPORT = "report"
SETTINGS = "settings"
CONFIG = "config"
DRAINING = "draining"
DECISION = "decision"

_HEADER = struct.Struct("!I")
#: a frame larger than this is a broken peer, not a message (a frame is one tick's messages)
MAX_FRAME_BYTES = 256 * 1024 * 1024

Message = tuple[Any, ...]


class ChannelClosed(Exception):
    """The peer went away (or sent something that is not a frame)."""


class Channel:
    """One end of a worker's connection: messages out, batched per loop tick; frames in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._out: list[Message] = []
        self._scheduled = False
        self.closed = False

    def send(self, *message: Any) -> None:
        """Queue one message; it leaves at the end of this loop tick. Never blocks."""
        if self.closed:
            return
        self._out.append(message)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if not self._out or self.closed:
            self._out.clear()
            return
        data = pickle.dumps(self._out, protocol=pickle.HIGHEST_PROTOCOL)
        self._out = []
        if self._writer.is_closing():
            self.closed = True
            return
        self._writer.write(_HEADER.pack(len(data)) + data)

    async def receive(self) -> list[Message]:
        """The next frame's messages; :class:`ChannelClosed` when the peer is gone."""
        try:
            head = await self._reader.readexactly(_HEADER.size)
            (size,) = _HEADER.unpack(head)
            if size > MAX_FRAME_BYTES:
                raise ChannelClosed(f"a frame of {size} bytes")
            messages = pickle.loads(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.closed = True
            raise ChannelClosed(str(exc) or type(exc).__name__) from exc
        if not isinstance(messages, list):
            raise ChannelClosed("a frame that is not a list of messages")
        return messages

    async def drain(self) -> None:
        """Send what is queued now and wait until the socket has taken it."""
        self.flush()
        if not self.closed and not self._writer.is_closing():
            try:
                await self._writer.drain()
            except (ConnectionError, OSError):
                self.closed = True

    def close(self) -> None:
        self.flush()
        self.closed = True
        self._writer.close()
