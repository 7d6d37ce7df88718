"""The owner's end: every relay worker's asks, mapped onto the pod's one admission controller.

:class:`AdmissionOwner` serves the private Unix socket the workers connect to. An ``ADMIT`` is
:meth:`AdmissionController.try_admit`, then, when that says "queue it",
:meth:`AdmissionController.wait` in a task (``CANCEL`` sets its ``cancelled`` event); the
decision goes back with the owner's number for the reservation, which ``STARTED``,
``PROGRESS_BATCH`` and ``RELEASE`` then name. Since every promise of KV blocks is made here, by one
controller on one event loop, no two workers can promise the same blocks. Messages are dispatched
by their type (``sidecar.http.workers.wire``). The workers' metric events are recorded on the
pod's one registry; their pass-through counts add up into the
owner's :class:`~sidecar.http.seams.Traffic` for the drain. When a worker's connection closes
(it crashed, was killed, or exited), its reservations are released and its queued asks
cancelled at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import Decision, Reason
from sidecar.config import Settings
from sidecar.engine.discovery import EngineConfig
from sidecar.http.seams import Traffic
from sidecar.http.workers import wire
from sidecar.kv.ledger import Reservation
from sidecar.observability.exporter import Metrics

log = logging.getLogger("sidecar.owner")

#: seconds between the owner's checks for a new engine config or a drain to tell the workers
SYNC_INTERVAL = 0.05


@dataclass(eq=False)
class WorkerLink:
    """One connected worker: its asks in the queue and its reservations in the ledger."""

    channel: wire.Channel
    index: int = -1
    pid: int = 0
    ready: bool = False
    passthrough_in_flight: int = 0
    asks: dict[int, asyncio.Event] = field(default_factory=dict)
    reservations: dict[int, Reservation] = field(default_factory=dict)
    next_res: int = 0


class AdmissionOwner:
    """The Unix-socket server the relay workers ask."""

    def __init__(
        self,
        admission: AdmissionController,
        metrics: Metrics,
        *,
        settings: Settings,
        workers: int,
        engine: Callable[[], EngineConfig | None],
        traffic: Traffic,
        on_lost: Callable[[int], None] = lambda pid: None,
    ) -> None:
        self.admission = admission
        self.metrics = metrics
        self.settings = settings
        self.workers = workers
        self.engine = engine
        self.traffic = traffic
        self.on_lost = on_lost  # told the pid of a worker whose connection closed
        self.links: set[WorkerLink] = set()
        self.requests_by_worker: Counter[int] = Counter()  # generation requests decided
        self.lost_total = 0
        self._all_ready_once = False
        self._server: asyncio.AbstractServer | None = None
        self._sync: asyncio.Task[None] | None = None
        self._sent_config: EngineConfig | None = None
        self._sent_draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path)
        self._sync = asyncio.ensure_future(self._sync_forever())

    async def stop(self) -> None:
        if self._sync is not None:
            self._sync.cancel()
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.channel.close()
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def ready(self) -> bool:
        """Every worker was ready once, and one is now (a replaced worker is a short gap)."""
        count = sum(1 for link in self.links if link.ready)
        if count >= self.workers:
            self._all_ready_once = True
        return self._all_ready_once and count > 0

    # --- the connection ----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = WorkerLink(wire.Channel(reader, writer))
        try:
            while link.index < 0:
                for message in await link.channel.receive():
                    if isinstance(message, wire.Hello):
                        link.index, link.pid = message.index, message.pid
            self.links.add(link)
            log.info("relay worker %d (pid %d) connected", link.index, link.pid)
            link.channel.send(wire.Welcome(self.settings, self.workers))
            link.channel.send(wire.Config(self._sent_config))
            link.channel.send(wire.Draining(self._sent_draining))
            while True:
                for message in await link.channel.receive():
                    self._dispatch(link, message)
        except wire.ChannelClosed:
            pass
        except Exception:  # a bug must not leave the worker's reservations behind
            log.exception("relay worker %d: unexpected message", link.index)
        finally:
            link.channel.close()
            self._lost(link)

    def _lost(self, link: WorkerLink) -> None:
        if link not in self.links:
            return  # never said hello
        self.links.discard(link)
        self.lost_total += 1
        asks = list(link.asks.values())
        for cancelled in asks:
            cancelled.set()  # the waits end with CANCEL; a grant that crossed is released
        reservations = list(link.reservations.values())
        link.reservations.clear()
        for res in reservations:
            self.admission.release(res)
        self.traffic.passthrough_in_flight = sum(x.passthrough_in_flight for x in self.links)
        level = logging.INFO if not (asks or reservations) else logging.WARNING
        log.log(
            level,
            "relay worker %d (pid %d) disconnected: released %d reservations, cancelled %d "
            "queued requests",
            link.index,
            link.pid,
            len(reservations),
            len(asks),
        )
        self.on_lost(link.pid)

    # --- messages ----------------------------------------------------------------------------

    def _dispatch(self, link: WorkerLink, message: wire.Message) -> None:
        admission = self.admission
        if type(message) is wire.ProgressBatch:  # most messages: no match to walk
            held, progressed = link.reservations, admission.progressed
            for res_id, generated in message.items():
                if (res := held.get(res_id)) is not None:
                    progressed(res, generated)
            return
        match message:
            case wire.Admit(ask, request):
                self._admit(link, ask, request)
            case wire.Started(res_id):
                if (res := link.reservations.get(res_id)) is not None:
                    admission.started(res)
            case wire.Release(res_id, completion_tokens):
                if (res := link.reservations.pop(res_id, None)) is not None:
                    admission.release(res, completion_tokens)
            case wire.Cancel(ask):
                if (cancelled := link.asks.get(ask)) is not None:
                    cancelled.set()
            case wire.Report(events, passthrough):
                self._record(link, events)
                link.passthrough_in_flight = passthrough
                self.traffic.passthrough_in_flight = sum(
                    x.passthrough_in_flight for x in self.links
                )
            case wire.Ready():
                link.ready = True
                log.info("relay worker %d (pid %d) ready", link.index, link.pid)
            case _:
                log.warning("relay worker %d: unexpected message %r", link.index, message)

    def _admit(self, link: WorkerLink, ask: int, request: Ask) -> None:
        decision = self.admission.try_admit(request)
        if decision is not None:
            self._answer(link, ask, decision)
            return
        cancelled = asyncio.Event()
        link.asks[ask] = cancelled
        task = asyncio.ensure_future(self._wait(link, ask, cancelled, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait(
        self, link: WorkerLink, ask: int, cancelled: asyncio.Event, request: Ask
    ) -> None:
        try:
            decision = await self.admission.wait(request, cancelled)
        finally:
            link.asks.pop(ask, None)
        self.metrics.queue_waited(decision.waited_seconds)
        self._answer(link, ask, decision)

    def _answer(self, link: WorkerLink, ask: int, decision: Decision) -> None:
        grant = None
        res = decision.reservation
        if res is not None:
            if link not in self.links:  # the worker is gone: nobody will release it
                self.admission.release(res)
                return
            link.next_res += 1
            link.reservations[link.next_res] = res
            shadows = tuple(shadow.engine for shadow in res.shadows)
            grant = wire.Grant(link.next_res, res.reserved_blocks, res.engine, shadows)
        link.channel.send(
            wire.Answer(
                ask,
                decision.outcome,
                decision.reason,
                decision.retry_after,
                decision.message,
                decision.waited_seconds,
                grant,
            )
        )

    def _record(self, link: WorkerLink, events: list[wire.MetricEvent]) -> None:
        metrics = self.metrics
        for event in events:
            match event:
                case wire.Counted(count):
                    metrics.counted(count)
                case wire.Projected(projection, bytes_per_block):
                    metrics.projected(projection, bytes_per_block)
                case wire.DecisionTimed(seconds):
                    metrics.decision_time(seconds)
                case wire.Answered(seconds):
                    metrics.answered(seconds)
                case wire.Decided(outcome, reason, retry_after):
                    metrics.decided(Decision(outcome, reason, retry_after=retry_after))
                    self.requests_by_worker[link.index] += 1
                case wire.Refused(reason, retry_after):
                    metrics.refused(reason, retry_after)
                    if reason is not Reason.ENGINE_QUEUE_FULL:  # that one was decided already
                        self.requests_by_worker[link.index] += 1
                case wire.UpstreamFailed(kind):
                    metrics.upstream_failed(kind)
                case wire.Completed(tokens):
                    metrics.completed(tokens)
                case wire.SelfChecked(shape, matched):
                    metrics.self_checked(shape, matched)

    # --- what the workers follow ---------------------------------------------------------------

    async def _sync_forever(self) -> None:
        while True:
            self.sync()
            await asyncio.sleep(SYNC_INTERVAL)

    def sync(self) -> None:
        """Tell every worker a new engine config or a drain (a config is swapped whole: a new
        value is a new object)."""
        config = self.engine()
        if config is not self._sent_config:
            self._sent_config = config
            for link in self.links:
                link.channel.send(wire.Config(config))
        draining = self.traffic.draining
        if draining != self._sent_draining:
            self._sent_draining = draining
            for link in self.links:
                link.channel.send(wire.Draining(draining))


class WorkersCollector(Collector):
    """``kv_sidecar_relay_workers``, ``kv_sidecar_relay_worker_requests_total{worker}`` and
    ``kv_sidecar_relay_worker_disconnects_total``, at scrape time."""

    def __init__(self, owner: AdmissionOwner) -> None:
        self.owner = owner

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        owner = self.owner
        yield GaugeMetricFamily(
            "kv_sidecar_relay_workers",
            "Relay worker processes connected to the admission owner.",
            value=len(owner.links),
        )
        by_worker = CounterMetricFamily(
            "kv_sidecar_relay_worker_requests",
            "Generation requests decided, by the relay worker (slot) that received them.",
            labels=["worker"],
        )
        for index in range(owner.workers):
            by_worker.add_metric([str(index)], owner.requests_by_worker[index])
        yield by_worker
        yield CounterMetricFamily(
            "kv_sidecar_relay_worker_disconnects",
            "Relay workers whose connection to the owner closed (crashed, killed or stopped).",
            value=owner.lost_total,
        )
