"""The pod's lifecycle as Kubernetes sees it: ready or not, the drain, and the one shutdown
sequence of the single process and of the relay workers' owner.

:class:`ReadyCheck` is ``/readyz``'s verdict and its reasons. :func:`drain` stops admitting and
gives what runs (and queued requests that can still start) a deadline to finish.
:func:`serve_until_stopped` runs this process's servers (uvicorn's, and the HAProxy agent's) until
the first SIGTERM or SIGINT, or a permanent configuration error, then drains the :class:`Service`
and stops it; a second signal stops at once. The error is raised once everything has stopped (the
CLI prints it).

    code = await serve_until_stopped(sidecar, [proxy, ops], stop_timeout_seconds=10)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from sidecar.admission.controller import AdmissionController
from sidecar.engine.health import HealthMonitor
from sidecar.engine.scraper import Scraper
from sidecar.errors import ConfigError
from sidecar.http.ops import Readiness, finite
from sidecar.http.seams import Traffic

log = logging.getLogger("sidecar")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ReadyCheck:
    """Whether the pod should get traffic: the engine found, no drain, vLLM healthy, its metrics
    fresh, and (with relay workers) the workers able to serve."""

    def __init__(
        self,
        *,
        discovered: Callable[[], bool],
        traffic: Traffic,
        health: HealthMonitor,
        scraper: Scraper,
        stale_after_seconds: float,
        discovery_error: Callable[[], str | None],
        relays_ready: Callable[[], bool] | None = None,
    ) -> None:
        self.discovered = discovered
        self.traffic = traffic
        self.health = health
        self.scraper = scraper
        self.stale_after_seconds = stale_after_seconds
        self.discovery_error = discovery_error
        self.relays_ready = relays_ready

    def ready(self) -> bool:
        return (
            self.discovered()
            and not self.traffic.draining
            and self.health.healthy
            # the snapshot's age, not the last scrape's outcome: one failed scrape (a loop
            # lagging under a burst) must not take the pod out of service; stale data does
            and self.scraper.latest is not None
            and self.scraper.age() <= self.stale_after_seconds
            and (self.relays_ready is None or self.relays_ready())
        )

    def why_not(self) -> str:
        """Why the pod is not ready, in a few words ("" when it is): for the HAProxy agent."""
        if self.traffic.draining:
            return "draining"
        if not self.discovered():
            return f"engine not found yet: {self.discovery_error() or 'asking vLLM'}"
        if not self.health.healthy:
            return "vLLM not healthy"
        if self.scraper.latest is None:
            return "no scrape of vLLM's metrics yet"
        if self.scraper.age() > self.stale_after_seconds:
            return f"vLLM's metrics {self.scraper.age():.0f}s old"
        if self.relays_ready is not None and not self.relays_ready():
            return "relay workers not ready"
        return ""

    def report(self) -> Readiness:
        """The verdict with its reasons; ``last_error``: the latest failed scrape, else (while
        the engine is not found) why discovery's latest attempt failed."""
        discovered = self.discovered()
        return Readiness(
            ready=self.ready(),
            discovered=discovered,
            draining=self.traffic.draining,
            vllm_up=self.scraper.up,
            vllm_healthy=self.health.healthy,
            vllm_metrics_age_seconds=finite(self.scraper.age()),
            last_error=self.scraper.last_error or (None if discovered else self.discovery_error()),
        )


async def drain(admission: AdmissionController, traffic: Traffic, deadline_seconds: float) -> None:
    """Stop admitting, let what runs (and queued requests that can still start) finish."""
    traffic.draining = True
    admission.draining = True
    log.info(
        "draining: %d in flight, %d queued, deadline %.0fs",
        admission.in_flight,
        admission.queue_depth,
        deadline_seconds,
    )

    def busy() -> bool:
        return bool(admission.in_flight or admission.queue_depth or traffic.passthrough_in_flight)

    deadline = time.monotonic() + deadline_seconds
    # polled: in-flight requests end in many places (answer, error, disconnect)
    while busy() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    admission.fail_queue()
    if admission.in_flight or traffic.passthrough_in_flight:
        log.warning(
            "drain deadline reached with %d generation and %d other requests in flight",
            admission.in_flight,
            traffic.passthrough_in_flight,
        )
    else:
        log.info("drained")


class Serving(Protocol):
    """A server :func:`serve_until_stopped` runs: a uvicorn server, or the HAProxy agent."""

    should_exit: bool
    force_exit: bool
    started: bool

    async def serve(self) -> None:
        """Serve until ``should_exit``; ``started`` once listening."""


class Service(Protocol):
    """What :func:`serve_until_stopped` runs: the sidecar, with or without relay workers."""

    async def drain(self) -> None:
        """Not ready, new generation requests refused; what runs finishes (and the relay
        workers stop, with nothing left to relay)."""

    def stop_now(self) -> None:
        """A second signal: stop without waiting (kill the relay workers)."""

    async def stop(self, *, hurried: bool) -> None:
        """Stop every part once the servers have ended (``hurried``: after a second signal)."""

    async def failed(self) -> ConfigError:
        """Return a configuration error that no retry can mend (never, while there is none)."""


async def serve_until_stopped(
    service: Service, servers: Sequence[Serving], *, stop_timeout_seconds: float
) -> int:
    """Serve until a signal or a permanent configuration error, drain, stop; the exit code (1:
    a server failed or could not bind its port). The configuration error is raised, after the
    stop."""
    loop = asyncio.get_running_loop()
    signals: list[int] = []
    signalled = asyncio.Event()
    fatal: list[ConfigError] = []

    def stop_servers(*, now: bool) -> None:
        for server in servers:
            server.should_exit = True
            server.force_exit = server.force_exit or now

    def on_signal(sig: int) -> None:
        signals.append(sig)
        if len(signals) > 1:
            log.warning("second signal: exiting without waiting")
            service.stop_now()
            stop_servers(now=True)
        signalled.set()

    async def lifecycle() -> None:
        failed = asyncio.ensure_future(service.failed())
        waits = {failed, asyncio.ensure_future(signalled.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if failed.done() and not failed.cancelled():
            fatal.append(failed.result())
            log.info("a configuration error no retry can mend: not ready, stopping")
        else:
            log.info(
                "signal %s: not ready, refusing new requests, draining",
                signal.Signals(signals[0]).name,
            )
        await service.drain()
        stop_servers(now=False)

    for sig in _SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    watcher = asyncio.ensure_future(lifecycle())
    try:
        results = await asyncio.gather(*(s.serve() for s in servers), return_exceptions=True)
    finally:
        watcher.cancel()
        await asyncio.wait([watcher])
        if not watcher.cancelled() and watcher.exception() is not None:
            log.error("the drain failed", exc_info=watcher.exception())
        try:
            async with asyncio.timeout(stop_timeout_seconds):  # never hang on a stuck upstream
                await service.stop(hurried=len(signals) > 1)
        except TimeoutError:
            log.warning("shutdown timed out")
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
    if fatal:
        raise fatal[0]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed or not all(s.started for s in servers):
        log.error("server failed: %s", failed[0] if failed else "could not bind its ports")
        return 1
    return 0
