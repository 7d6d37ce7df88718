"""The worker's end: the proxy's seams (gate, metrics sink, engine, traffic) served by the owner.

:class:`OwnerLink` is a relay worker's connection to the admission owner. Its :class:`RemoteGate`
decides nothing itself: every generation request is an ``ADMIT`` that the owner's one controller
answers (so ``try_admit`` returns None, and the request path awaits :meth:`RemoteGate.wait`);
``started``, ``progressed`` and ``release`` are fire-and-forget, and wait up to
:data:`PROGRESS_WITHIN_S` for a frame (a message that may not wait, an ``ADMIT`` say, takes
them along at once, in order); ``progressed`` leaves for every token a stream gains, every
stream's in one packed batch (``wire.ProgressBatch``), so that the owner's ledger follows each
stream as one process does. :class:`RemoteMetrics` forwards the request path's metric events
in batches, so that the owner's ``/metrics`` stays one exposition. The
engine (its config, and the prompt counter built from it in the worker) and the traffic state
(``draining``) follow the owner's messages; ``passthrough_in_flight`` is reported back for the
drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.admission.ask import Ask
from sidecar.admission.decisions import Decision, Outcome, Reason
from sidecar.admission.retry import MIN_RETRY_AFTER
from sidecar.config import Settings
from sidecar.counting import CountingObserver, PromptShape, TokenCount
from sidecar.engine.discovery import EngineConfig
from sidecar.http.seams import Engine, Gate, MetricsSink, Traffic
from sidecar.http.workers import wire
from sidecar.kv.ledger import Reservation
from sidecar.kv.projection import Projection

log = logging.getLogger("sidecar.worker")

#: seconds between reports of metric events and pass-through counts to the owner
REPORT_INTERVAL = 0.05
#: a stream's progress, start and release wait at most this long for a frame (one frame for
#: every stream's tokens of a few loop ticks, not one a tick; a message that may not wait takes
#: them along, in order)
PROGRESS_WITHIN_S = 0.005
#: seconds a client is told to wait when its worker has lost the owner (the worker is exiting)
OWNER_GONE_RETRY_AFTER = 2.0


class OwnerLink:
    """A relay worker's connection to the admission owner, and the state the owner sends."""

    def __init__(self, channel: wire.Channel, *, index: int) -> None:
        self.channel = channel
        self.index = index
        self.engine: Engine | None = None  # swapped whole, as in the owner
        self.traffic = Traffic()
        self.lost = asyncio.Event()
        self.gate = RemoteGate(self)
        self.metrics = RemoteMetrics(self)
        #: called with each engine config the owner sends (the worker builds its counter)
        self._on_config: Callable[[EngineConfig | None], None] = lambda config: None
        self._asks: dict[int, tuple[asyncio.Future[Decision], Ask]] = {}
        self._orphans: set[int] = set()  # asks whose waiter left: a grant is released at once
        self._next_ask = 0
        self._reported_passthrough = 0
        self._early: list[wire.Message] = []

    async def handshake(self) -> tuple[Settings, int]:
        """Say who we are; the owner answers with the settings and the number of workers."""
        self.channel.send(wire.Hello(self.index, os.getpid()))
        await self.channel.drain()
        while True:
            messages = await self.channel.receive()
            for i, message in enumerate(messages):
                if isinstance(message, wire.Welcome):
                    self._early = messages[i + 1 :]  # for run(), once the worker is built
                    return message.settings, message.workers

    async def run(self) -> None:
        """Read the owner's messages until it goes away; then fail what still waits."""
        reporter = asyncio.ensure_future(self._report_forever())
        try:
            self._dispatch_early()
            while True:
                for message in await self.channel.receive():
                    self._dispatch(message)
        except wire.ChannelClosed as exc:
            log.error("lost the admission owner (%s): exiting", exc)
        except Exception:
            log.exception("a message from the admission owner failed: exiting")
        finally:
            reporter.cancel()
            self.lost.set()
            for future, _ in self._asks.values():
                if not future.done():
                    future.set_result(_owner_gone())
            self._asks.clear()

    def follow_config(self, on_config: Callable[[EngineConfig | None], None]) -> None:
        """Call ``on_config`` with each engine config the owner sends, from the one that came
        with the settings on (the worker builds its prompt counter from it)."""
        self._on_config = on_config
        self._dispatch_early()

    def _dispatch_early(self) -> None:
        """Apply what came with the settings (the engine config, a drain), once the worker
        follows the config."""
        early, self._early = self._early, []
        for message in early:
            self._dispatch(message)

    def ready(self) -> None:
        self.channel.send(wire.Ready())

    # --- from the owner -------------------------------------------------------------------------

    def _dispatch(self, message: wire.Message) -> None:
        match message:
            case wire.Answer():
                self._decided(message)
            case wire.Config(engine):
                self._on_config(engine)
            case wire.Draining(draining):
                self.traffic.draining = draining
            case _:
                log.warning("unexpected message from the owner: %r", message)

    def _decided(self, answer: wire.Answer) -> None:
        ask, grant = answer.ask, answer.grant
        entry = self._asks.pop(ask, None)
        if entry is None or ask in self._orphans:
            self._orphans.discard(ask)
            if grant is not None:  # admitted for a waiter that has gone: hand it back
                self.channel.send(wire.Release(grant.res))
            return
        future, request = entry
        if future.done():  # its waiter was cancelled in this very tick
            if grant is not None:
                self.channel.send(wire.Release(grant.res))
            return
        reservation = None
        if grant is not None:
            reservation = _local_reservation(grant, request)
            self.gate.granted(reservation)
        future.set_result(
            Decision(
                answer.outcome,
                answer.reason,
                reservation=reservation,
                retry_after=answer.retry_after,
                message=answer.message,
                waited_seconds=answer.waited_seconds,
            )
        )

    # --- to the owner ---------------------------------------------------------------------------

    def ask(self, request: Ask) -> tuple[int, asyncio.Future[Decision]]:
        self._next_ask += 1
        ask = self._next_ask
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        if self.lost.is_set():
            future.set_result(_owner_gone())
            return ask, future
        self._asks[ask] = (future, request)
        self.channel.send(wire.Admit(ask, request))
        return ask, future

    def cancel(self, ask: int, *, orphan: bool = False) -> None:
        """The waiter left; with ``orphan`` it will not read the answer (a grant is handed back)."""
        if ask in self._asks:
            if orphan:
                self._orphans.add(ask)
            self.channel.send(wire.Cancel(ask))

    async def _report_forever(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL)
            self.report()

    def report(self) -> None:
        """Metric events since the last report, and the pass-through count when it changed."""
        events = self.metrics.take()
        passthrough = self.traffic.passthrough_in_flight
        if events or passthrough != self._reported_passthrough:
            self._reported_passthrough = passthrough
            self.channel.send(wire.Report(events, passthrough))


def _owner_gone() -> Decision:
    return Decision(
        Outcome.REJECT,
        Reason.NOT_READY,
        retry_after=OWNER_GONE_RETRY_AFTER,
        message="the sidecar is restarting; retry shortly",
    )


def _local_reservation(grant: wire.Grant, request: Ask) -> Reservation:
    """The worker's copy of the owner's reservation: what the request path reads (its id is the
    owner's number for it). Never changed once made: the gate keeps its progress apart."""
    projection = request.projection
    local = Reservation(
        id=grant.res,
        projection=projection,
        ends=projection.max_tokens,
        reserved_blocks=grant.reserved_blocks,
        predicted_blocks=0,
        streamed=request.streamed,
        admitted_at=time.monotonic(),
        klass=request.klass,
        engine=grant.engine,
    )
    local.shadows = [
        dataclasses.replace(local, engine=other, shadows=[]) for other in grant.shadow_engines
    ]
    return local


@dataclass(slots=True)
class _Progress:
    """What the worker has told the owner of one reservation."""

    started: bool = False
    generated: float = 0.0  # the tokens per sequence last sent


class RemoteGate:
    """The :class:`~sidecar.http.seams.Gate` of a relay worker: the owner decides."""

    def __init__(self, link: OwnerLink) -> None:
        self.link = link
        self._held: dict[int, _Progress] = {}  # granted and not yet released, by owner number

    def granted(self, reservation: Reservation) -> None:
        self._held[reservation.id] = _Progress()

    def try_admit(self, ask: Ask) -> Decision | None:
        """Only a drain is known here; everything else is the owner's to decide (:meth:`wait`)."""
        if self.link.traffic.draining:
            return Decision(
                Outcome.REJECT,
                Reason.DRAINING,
                retry_after=MIN_RETRY_AFTER,
                message="the sidecar is shutting down; retry on another replica",
            )
        return None

    async def wait(self, ask: Ask, cancelled: asyncio.Event | None = None) -> Decision:
        """Ask the owner and await its decision; a client that leaves cancels the ask (the
        owner's answer still comes, and a grant that crossed the cancel is released by the
        caller as with any admission)."""
        number, future = self.link.ask(ask)
        watch: asyncio.Future[Any] | None = (
            asyncio.ensure_future(cancelled.wait()) if cancelled is not None else None
        )
        try:
            if watch is not None:
                waitables: set[asyncio.Future[Any]] = {future, watch}
                await asyncio.wait(waitables, return_when=asyncio.FIRST_COMPLETED)
                if not future.done():
                    self.link.cancel(number)
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                granted = future.result().reservation  # decided as the waiter was cancelled
                if granted is not None:
                    self.release(granted)
            else:
                self.link.cancel(number, orphan=True)
                future.cancel()
            raise
        finally:
            if watch is not None:
                watch.cancel()

    def started(self, reservation: Reservation) -> None:
        held = self._held.get(reservation.id)
        if held is None or held.started:
            return
        held.started = True
        # late by at most PROGRESS_WITHIN_S: meanwhile the owner takes the request to be
        # able to start at any moment and never to free anything (its trajectory's worst)
        self.link.channel.send(wire.Started(reservation.id), within=PROGRESS_WITHIN_S)

    def progressed(self, reservation: Reservation, generated_per_sequence: float) -> None:
        """Sent for every whole token per sequence, not only when the block count changes.

        The owner's trajectories take a request to end its reserved tokens after the progress
        it last heard of. Heard of only at block boundaries, streams that vLLM decodes in
        lockstep seemed up to a block's worth of steps apart: they were taken to end apart and
        their peaks to pass one by one, where vLLM holds them at once (eight streams of 100 +
        700 tokens on two workers in worst-case mode: two more admitted at the crossings, 64
        blocks at the true peak, one more than vLLM's pool). Progress waits up to
        :data:`PROGRESS_WITHIN_S` for its frame, so that the tokens of every stream over a few
        loop ticks leave in one frame, as one packed batch (``wire.ProgressBatch``: each
        stream's latest count); the owner hears of each within that, every stream of a worker
        at once."""
        held = self._held.get(reservation.id)
        if held is None or int(generated_per_sequence) <= int(held.generated):
            return
        held.generated = generated_per_sequence
        self.link.channel.progress(reservation.id, generated_per_sequence, within=PROGRESS_WITHIN_S)

    def release(self, reservation: Reservation, completion_tokens: int | None = None) -> None:
        if self._held.pop(reservation.id, None) is None:
            return
        # late by at most PROGRESS_WITHIN_S: the owner holds its blocks that much longer
        self.link.channel.send(
            wire.Release(reservation.id, completion_tokens), within=PROGRESS_WITHIN_S
        )


class RemoteMetrics:
    """The :class:`~sidecar.http.seams.MetricsSink` of a relay worker: events batched to the
    owner, who records them on the pod's one registry. The queue wait is recorded by the owner,
    where the queue is (every request here "waits" for the owner's answer)."""

    def __init__(self, link: OwnerLink) -> None:
        self.link = link
        self._events: list[wire.MetricEvent] = []

    def take(self) -> list[wire.MetricEvent]:
        events, self._events = self._events, []
        return events

    def counted(self, count: TokenCount) -> None:
        # the block hashes are the ledger's business, sent with ADMIT; not the exporter's
        self._events.append(wire.Counted(dataclasses.replace(count, prefix=None)))

    def projected(self, projection: Projection, bytes_per_block: int | None) -> None:
        self._events.append(wire.Projected(projection, bytes_per_block))

    def decision_time(self, seconds: float) -> None:
        self._events.append(wire.DecisionTimed(seconds))

    def queue_waited(self, seconds: float) -> None:
        return None

    def answered(self, seconds: float) -> None:
        self._events.append(wire.Answered(seconds))

    def decided(self, decision: Decision) -> None:
        self._events.append(wire.Decided(decision.outcome, decision.reason, decision.retry_after))

    def refused(self, reason: Reason, retry_after: float | None = None) -> None:
        self._events.append(wire.Refused(reason, retry_after))

    def upstream_failed(self, kind: str) -> None:
        self._events.append(wire.UpstreamFailed(kind))

    def completed(self, completion_tokens: int) -> None:
        self._events.append(wire.Completed(completion_tokens))

    def self_checked(self, shape: PromptShape, matched: bool) -> None:
        """The prompt counter's observer (its checks against vLLM's /tokenize)."""
        self._events.append(wire.SelfChecked(shape, matched))


# checked by mypy: the stand-ins are what the request path and the counter expect
_GATE: type[Gate] = RemoteGate
_SINK: type[MetricsSink] = RemoteMetrics
_OBSERVER: type[CountingObserver] = RemoteMetrics
