"""The messages between relay workers and the admission owner, and the channel that carries them.

One frozen dataclass per kind of message; each end dispatches on the message's type (``match``),
never on a name. A frame is a 4-byte big-endian length and a pickled list of messages. Pickle is
safe here: both ends are this package, in one pod, run by one user, over a Unix socket in a
directory only that user may open (mode 0700). A channel gathers what one loop tick sends into
one frame (one write, one wake-up of the peer), so a burst of fire-and-forget messages costs one
system call, not one each.

Worker to owner (``ask`` and ``res`` are the worker's and the owner's numbers): :class:`Hello`
first, :class:`Ready` once its engine (prompt counter) is built, then :class:`Admit`,
:class:`Cancel` (the client left while it waited), :class:`Started`, :class:`ProgressBatch`
(each whole token per sequence, of every stream whose count moved since the last batch, as two
packed arrays: :meth:`Channel.progress`), :class:`Release` and :class:`Report` (metric events,
one :data:`MetricEvent` each, and the pass-through count).

Owner to worker: :class:`Welcome` first (the settings and the number of workers), :class:`Config`
on connect and whenever the engine config changes, :class:`Draining`, and one :class:`Answer` per
:class:`Admit`.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.admission.ask import Ask
from sidecar.admission.decisions import Outcome, Reason
from sidecar.counting import PromptShape, TokenCount
from sidecar.kv.projection import Projection

if TYPE_CHECKING:
    from sidecar.config import Settings
    from sidecar.engine.discovery import EngineConfig


class _Message:
    """Pickled as its class and its fields (2x faster than a slotted dataclass's default)."""

    __slots__: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[type[_Message], tuple[object, ...]]:
        return type(self), tuple([getattr(self, name) for name in self.__slots__])


# --- worker to owner -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(_Message):
    index: int
    pid: int


@dataclass(frozen=True, slots=True)
class Ready(_Message):
    pass


@dataclass(frozen=True, slots=True)
class Admit(_Message):
    ask: int
    request: Ask


@dataclass(frozen=True, slots=True)
class Cancel(_Message):
    ask: int


@dataclass(frozen=True, slots=True)
class Started(_Message):
    res: int


@dataclass(frozen=True, slots=True)
class ProgressBatch(_Message):
    """The tokens generated per sequence of several reservations, as two packed arrays (native
    ``int64`` reservation numbers and ``float64`` counts, one entry each): one message, two byte
    strings to pickle, however many streams moved (one object a stream cost each end a pickled
    object, a dispatch and a dataclass each)."""

    res: bytes
    generated: bytes

    @classmethod
    def of(cls, progress: dict[int, float]) -> ProgressBatch:
        return cls(array("q", progress).tobytes(), array("d", progress.values()).tobytes())

    def items(self) -> Iterator[tuple[int, float]]:
        """(reservation, tokens per sequence), in the order sent; a batch whose arrays do not
        pair up is a broken peer (:class:`ChannelClosed`)."""
        res, generated = memoryview(self.res), memoryview(self.generated)
        if len(res) % 8 or len(res) != len(generated):
            raise ChannelClosed("a progress batch whose arrays do not pair up")
        return zip(res.cast("q"), generated.cast("d"), strict=True)


@dataclass(frozen=True, slots=True)
class Release(_Message):
    res: int
    completion_tokens: int | None = None


# the request path's metric events (the MetricsSink's calls and the counter's observer)


@dataclass(frozen=True, slots=True)
class Counted(_Message):
    count: TokenCount


@dataclass(frozen=True, slots=True)
class Projected(_Message):
    projection: Projection
    bytes_per_block: int | None


@dataclass(frozen=True, slots=True)
class DecisionTimed(_Message):
    seconds: float


@dataclass(frozen=True, slots=True)
class Answered(_Message):
    seconds: float


@dataclass(frozen=True, slots=True)
class Decided(_Message):
    outcome: Outcome
    reason: Reason
    retry_after: float | None


@dataclass(frozen=True, slots=True)
class Refused(_Message):
    reason: Reason
    retry_after: float | None


@dataclass(frozen=True, slots=True)
class UpstreamFailed(_Message):
    kind: str


@dataclass(frozen=True, slots=True)
class Completed(_Message):
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class SelfChecked(_Message):
    shape: PromptShape
    matched: bool


MetricEvent = (
    Counted
    | Projected
    | DecisionTimed
    | Answered
    | Decided
    | Refused
    | UpstreamFailed
    | Completed
    | SelfChecked
)


@dataclass(frozen=True, slots=True)
class Report(_Message):
    events: list[MetricEvent]
    passthrough_in_flight: int


# --- owner to worker -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Welcome(_Message):
    settings: Settings
    workers: int


@dataclass(frozen=True, slots=True)
class Config(_Message):
    engine: EngineConfig | None


@dataclass(frozen=True, slots=True)
class Draining(_Message):
    draining: bool


@dataclass(frozen=True, slots=True)
class Grant(_Message):
    """The owner's reservation, as the worker's request path needs it."""

    res: int
    reserved_blocks: int
    engine: str
    shadow_engines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Answer(_Message):
    ask: int
    outcome: Outcome
    reason: Reason
    retry_after: float | None
    message: str
    waited_seconds: float
    grant: Grant | None


ToOwner = Hello | Ready | Admit | Cancel | Started | ProgressBatch | Release | Report
ToWorker = Welcome | Config | Draining | Answer
Message = ToOwner | ToWorker

_HEADER = struct.Struct("!I")
#: a frame larger than this is a broken peer, not a message (a frame is one tick's messages)
MAX_FRAME_BYTES = 256 * 1024 * 1024


class ChannelClosed(Exception):
    """The peer went away (or sent something that is not a frame)."""


class Channel:
    """One end of a worker's connection: messages out, batched per loop tick; frames in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._out: list[Message] = []
        #: progress not yet in ``_out``: the latest count per reservation, in first-sent order
        self._progress: dict[int, float] = {}
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    def send(self, message: Message, *, within: float = 0.0) -> None:
        """Queue one message; it leaves at the end of this loop tick, or (``within`` > 0) at
        most that many seconds later, with the next message that may not wait. Messages leave
        in the order sent (progress queued before it goes ahead of it). Never blocks."""
        if self.closed:
            return
        if self._progress:
            self._out.append(ProgressBatch.of(self._progress))
            self._progress = {}
        self._out.append(message)
        self._schedule(within)

    def progress(self, res: int, generated: float, *, within: float = 0.0) -> None:
        """Queue a reservation's tokens per sequence, as :meth:`send` would a message: every
        count queued until the next message (or the frame) leaves as one :class:`ProgressBatch`
        ahead of it, a reservation's later count in place of its earlier one (the owner keeps
        only the latest: a count only grows)."""
        if self.closed:
            return
        self._progress[res] = generated
        self._schedule(within)

    def _schedule(self, within: float) -> None:
        if self._scheduled:
            return
        loop = asyncio.get_running_loop()
        if within <= 0:
            self._scheduled = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            loop.call_soon(self.flush)
        elif self._timer is None:
            self._timer = loop.call_later(within, self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._progress:
            self._out.append(ProgressBatch.of(self._progress))
            self._progress = {}
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
