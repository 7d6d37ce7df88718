"""The composition root: build the parts, wire them, serve two ports, handle signals and drain.

:class:`Sidecar` builds the long-lived parts once (the transports to vLLM, the scraper, the
health monitor, the ledger and admission controller, the metrics registry, the proxy and ops
apps) and swaps in the engine when discovery finds it (``sidecar.engine.discovery``; the loop
that retries it stays here, as it wires the prompt counter and the admission controller to what
was found). :func:`serve` runs the proxy port and the metrics port on one loop and handles
SIGTERM: not ready at once, new generation requests refused with 503, in-flight and startable
queued requests given ``--drain-timeout`` to finish, then exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from sidecar.admission import lengths_file
from sidecar.admission.controller import AdmissionController
from sidecar.config import Settings
from sidecar.counting import PromptCounter
from sidecar.engine.discovery import discover
from sidecar.engine.health import HealthMonitor
from sidecar.engine.scraper import Scraper
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.errors import ConfigError
from sidecar.http.clients import OWN_CONNECTIONS, make_client, make_transport
from sidecar.http.ops import Readiness, build_ops_app, finite
from sidecar.http.seams import Engine, Traffic
from sidecar.http.serving import Server as _Server
from sidecar.http.serving import build_proxy
from sidecar.http.serving import uvicorn_config as _uvicorn_config
from sidecar.http.workers.owner import AdmissionOwner, WorkersCollector
from sidecar.http.workers.supervisor import Supervisor, listen_socket, worker_count
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.observability import logs
from sidecar.observability.exporter import Metrics
from sidecar.observability.tracing import Tracing
from sidecar.observability.tracing import from_env as tracing_from_env

log = logging.getLogger("sidecar")

#: seconds between writes of --lengths-file (and one at shutdown)
LENGTHS_SAVE_INTERVAL = 30.0


class Sidecar:
    """The process's long-lived parts, built and wired once; the engine swapped in when found."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        tracing: Tracing | None = None,
        process_children: Callable[[], Iterable[int]] | None = None,
        counts_prompts: bool = True,
    ) -> None:
        self.settings = settings
        #: False for the relay workers' owner: the workers count, so it loads no tokenizer
        self.counts_prompts = counts_prompts
        self.tracing = tracing  # None: no spans (the OTEL_* environment asked for none)
        self.registry = registry if registry is not None else CollectorRegistry()
        # the proxy's pool: the relay sends on the transport directly (each client's own headers)
        self.transport = make_transport(settings)
        key = settings.upstream_api_key
        # the sidecar's own calls to vLLM carry vLLM's --api-key; clients' requests carry theirs
        self.own_client = make_client(
            settings,
            transport=make_transport(settings, OWN_CONNECTIONS),
            headers={"Authorization": f"Bearer {key.get_secret_value()}"} if key else None,
        )
        self.scraper = Scraper(
            self.own_client, settings.upstream + "/metrics", interval=settings.scrape_interval
        )
        # Until discovery knows the block size, nothing is admitted (self.engine is None).
        self.admission = AdmissionController(
            Ledger(UniformBlocks(16)),
            policy=settings.policy,
            headroom=settings.headroom,
            max_queue_depth=settings.max_queue_depth,
            max_queue_wait=settings.max_queue_wait,
            reservation=settings.reservation,
            expected_quantile=settings.expected_quantile,
            expected_prior=settings.expected_prior,
            stale_after=settings.metrics_stale_after,
            stale_policy=settings.stale_policy,
        )
        self.engine: Engine | None = None  # swapped whole by discovery, never edited in place
        self.traffic = Traffic()
        self.health = HealthMonitor(
            self.own_client, settings.upstream + "/health", interval=settings.scrape_interval
        )
        #: with relay workers: whether they can serve (the owner's AdmissionOwner.ready)
        self.relays_ready: Callable[[], bool] = lambda: True
        self.metrics = Metrics(
            self.registry,
            self.admission,
            engine=lambda: self.engine.config if self.engine is not None else None,
            vllm_up=lambda: self.scraper.up,
            ready=self.ready,
            scrape_errors=lambda: self.scraper.errors_total,
            config_labels={
                "policy": settings.policy.value,
                "reservation": settings.reservation.value,
                "headroom": str(settings.headroom),
                "stale_policy": settings.stale_policy.value,
            },
            process_children=process_children,
        )
        self.proxy = build_proxy(
            settings,
            transport=self.transport,
            gate=self.admission,
            engine=lambda: self.engine,
            metrics=self.metrics,
            traffic=self.traffic,
            tracing=tracing,
        )
        self.ops = build_ops_app(
            registry=self.registry,
            readiness=self.readiness,
            state=self.admission.state,
            event_loop_tasks=self.event_loop_tasks,
        )
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._discovery: asyncio.Task[None] | None = None
        self._lengths: asyncio.Task[None] | None = None
        self._lengths_loaded = False

    # --- readiness ----------------------------------------------------------------------------

    @property
    def discovered(self) -> bool:
        """Discovery is complete: block size, capacity, context length and counter are known."""
        return self.engine is not None

    @property
    def counter(self) -> PromptCounter | None:
        return self.engine.counter if self.engine is not None else None  # type: ignore[return-value]

    @property
    def draining(self) -> bool:
        return self.traffic.draining

    def ready(self) -> bool:
        return (
            self.discovered
            and not self.traffic.draining
            and self.health.healthy
            # the snapshot's age, not the last scrape's outcome: one failed scrape (a loop
            # lagging under a burst) must not take the pod out of service; stale data does
            and self.scraper.latest is not None
            and self.scraper.age() <= self.settings.metrics_stale_after
            and self.relays_ready()
        )

    def readiness(self) -> Readiness:
        return Readiness(
            ready=self.ready(),
            discovered=self.discovered,
            draining=self.traffic.draining,
            vllm_up=self.scraper.up,
            vllm_healthy=self.health.healthy,
            vllm_metrics_age_seconds=finite(self.scraper.age()),
            last_error=self.scraper.last_error,
        )

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.metrics.event_loop_tasks.set_function(self.event_loop_tasks)
        self.scraper.add_listener(self._on_snapshot)
        self.scraper.start()
        self._discovery = asyncio.ensure_future(self._discover_forever())
        self.health.start()
        if self.settings.lengths_file is not None:
            self._lengths = asyncio.ensure_future(self._save_lengths_forever())

    async def stop(self) -> None:
        for task in (self._discovery, self._lengths):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.health.stop()
        await self.scraper.stop()
        self._save_lengths()
        if self.engine is not None:
            self.engine.counter.close()  # type: ignore[attr-defined]
        await self.transport.aclose()
        await self.own_client.aclose()

    async def drain(self, deadline_seconds: float) -> None:
        """Stop admitting, let what runs (and queued requests that can still start) finish."""
        self.traffic.draining = True
        self.admission.draining = True
        log.info(
            "draining: %d in flight, %d queued, deadline %.0fs",
            self.admission.in_flight,
            self.admission.queue_depth,
            deadline_seconds,
        )
        deadline = time.monotonic() + deadline_seconds
        # polled: in-flight requests end in many places (answer, error, disconnect)
        while self._busy() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        self.admission.fail_queue()
        if self.admission.in_flight or self.traffic.passthrough_in_flight:
            log.warning(
                "drain deadline reached with %d generation and %d other requests in flight",
                self.admission.in_flight,
                self.traffic.passthrough_in_flight,
            )
        else:
            log.info("drained")

    def event_loop_tasks(self) -> int:
        """Tasks alive on the sidecar's loop (callable from any thread, e.g. a metrics scrape)."""
        return len(asyncio.all_tasks(self._loop)) if self._loop is not None else 0

    def _busy(self) -> bool:
        return bool(
            self.admission.in_flight
            or self.admission.queue_depth
            or self.traffic.passthrough_in_flight
        )

    def _on_snapshot(self, snap: EngineSnapshot) -> None:
        engine = self.engine
        if engine is not None and snap.block_size and snap.block_size != engine.config.block_size:
            log.warning("vLLM's block size changed to %d; rediscovering", snap.block_size)
            self.engine = None
            self._discovery = asyncio.ensure_future(self._discover_forever(retire=engine))
            return
        if engine is not None:
            config = engine.config.with_snapshot(snap)
            if config is not engine.config:
                self.engine = dataclasses.replace(engine, config=config)
        self.admission.on_snapshot(snap)
        self.metrics.on_snapshot()

    # --- learned lengths across restarts ------------------------------------------------------

    def _save_lengths(self) -> None:
        path, engine = self.settings.lengths_file, self.engine
        if path is None or engine is None:
            return
        try:
            lengths_file.save(path, self.admission.learner, model=engine.config.model)
        except OSError as exc:
            log.warning("could not write the lengths file %s: %s", path, exc)

    async def _save_lengths_forever(self) -> None:
        while True:
            await asyncio.sleep(LENGTHS_SAVE_INTERVAL)
            self._save_lengths()

    # --- discovery ----------------------------------------------------------------------------

    async def _discover_forever(self, retire: Engine | None = None) -> None:
        failures = 0
        while True:
            try:
                await self._discover()
                break
            except (httpx.HTTPError, LookupError, ConfigError) as exc:
                if failures == 0:
                    log.warning("waiting for vLLM at %s: %s", self.settings.upstream, exc)
                failures += 1
            await asyncio.sleep(min(2.0, 0.25 * (failures + 1)))
        if retire is not None:
            retire.counter.close()  # type: ignore[attr-defined]

    async def _discover(self) -> None:
        settings = self.settings
        snap = self.scraper.latest
        if snap is None:
            snap = await self.scraper.scrape_once()
        if snap is None:
            raise LookupError(f"no scrape of vLLM's /metrics yet ({self.scraper.last_error})")
        config = await discover(
            self.own_client,
            settings.upstream,
            snap,
            served_model_name=settings.served_model_name,
            max_model_len=settings.max_model_len,
            model_config_path=settings.model_config_path,
            tokenizer=settings.tokenizer,
            default_max_tokens=settings.default_max_tokens,
            max_tokens_cap=settings.max_tokens_cap,
        )
        counter = PromptCounter(
            client=self.own_client,
            upstream=settings.upstream,
            served_model=config.model,
            tokenizer_path=config.tokenizer_path if self.counts_prompts else None,
            max_model_len=config.max_model_len,
            observer=self.metrics,
            # full prompt blocks are hashed for the ledger to count shared prefixes once
            block_size=config.block_size if config.prefix_caching is not False else None,
            max_concurrent_counts=settings.max_concurrent_counts,
            max_count_wait_s=settings.max_count_wait,
        )
        # Not ready until the tokenizer has loaded (or failed to): the load holds the GIL in long
        # stretches, and requests admitted meanwhile would stall seconds behind it.
        local = await counter.wait_ready()
        # vLLM's prefix caching (on unless its cache config says off) holds shared blocks once
        self.admission.configure(config.blocks, share_prefixes=config.prefix_caching is not False)
        if self.settings.lengths_file is not None and not self._lengths_loaded:
            self._lengths_loaded = True
            restored = lengths_file.load(
                self.settings.lengths_file, self.admission.learner, model=config.model
            )
            if restored:
                log.info("restored %d answer lengths from %s", restored, self.settings.lengths_file)
        self.engine = Engine(config=config, counter=counter)
        self.admission.on_snapshot(snap)
        log.info(
            "vLLM discovered: model %s, max_model_len %d, %d blocks of %d tokens, %s bytes per "
            "block (%s), prompt counting %s",
            config.model,
            config.max_model_len,
            config.num_gpu_blocks,
            config.block_size,
            config.bytes_per_block if config.bytes_per_block is not None else "unknown",
            "model config" if config.model_dir is not None else "no model config",
            (
                "in the relay workers"
                if not self.counts_prompts
                else f"local tokenizer {config.tokenizer_path}"
                if local
                else "vLLM /tokenize"
            ),
        )


# --- serving ------------------------------------------------------------------------------------


def _handle_signals(
    loop: asyncio.AbstractEventLoop, stop_now: Callable[[], None]
) -> tuple[asyncio.Event, list[int]]:
    """SIGTERM and SIGINT set the returned event (a drain begins); a second one calls
    ``stop_now`` (exit without waiting). The signals seen are listed, in order."""
    stopping = asyncio.Event()
    seen: list[int] = []

    def on_signal(sig: int) -> None:
        seen.append(sig)
        if len(seen) > 1:  # a second signal: stop now
            log.warning("second signal: exiting without waiting")
            stop_now()
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return stopping, seen


async def serve(settings: Settings, *, ready_file: Path | None = None) -> int:
    workers = worker_count(settings.workers)
    if workers > 1:
        return await serve_with_workers(settings, workers)
    sidecar = Sidecar(settings, tracing=tracing_from_env(os.environ))
    await sidecar.start()
    proxy = _Server(_uvicorn_config(sidecar.proxy, settings, settings.port))
    ops = _Server(_uvicorn_config(sidecar.ops, settings, settings.metrics_port))
    loop = asyncio.get_running_loop()

    def stop_now() -> None:
        proxy.force_exit = ops.force_exit = True
        proxy.should_exit = ops.should_exit = True

    stopping, signals_seen = _handle_signals(loop, stop_now)

    async def lifecycle() -> None:
        await stopping.wait()
        log.info(
            "signal %s: not ready, refusing new requests, draining",
            signal.Signals(signals_seen[0]).name,
        )
        await sidecar.drain(settings.drain_timeout)
        proxy.should_exit = True
        ops.should_exit = True

    watcher = asyncio.ensure_future(lifecycle())
    try:
        results = await asyncio.gather(proxy.serve(), ops.serve(), return_exceptions=True)
    finally:
        watcher.cancel()
        try:
            async with asyncio.timeout(10):  # exiting must not hang on a stuck upstream
                await sidecar.stop()
        except TimeoutError:
            log.warning("shutdown of the upstream client timed out")
        if sidecar.tracing is not None:
            sidecar.tracing.shutdown()  # export the spans still queued (the servers have ended)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed or not (proxy.started and ops.started):
        log.error("server failed: %s", failed[0] if failed else "could not bind its ports")
        return 1
    return 0


async def serve_with_workers(settings: Settings, workers: int) -> int:
    """The admission owner: the scraper, admission and the metrics port here, the proxy port
    served by ``workers`` relay worker processes (docs/relay-workers.md)."""
    try:
        listener = listen_socket(settings.host, settings.port)
    except OSError as exc:
        log.error("server failed: could not bind the proxy port %d: %s", settings.port, exc)
        return 1
    private = tempfile.mkdtemp(prefix="kv-sidecar-")  # mode 0700: this user only
    path = os.path.join(private, "owner.sock")
    supervisor = Supervisor(workers, socket_path=path, listen_fd=listener.fileno())
    sidecar = Sidecar(
        settings,
        tracing=tracing_from_env(os.environ),
        process_children=supervisor.pids,
        counts_prompts=False,
    )
    owner = AdmissionOwner(
        sidecar.admission,
        sidecar.metrics,
        settings=settings,
        workers=workers,
        engine=lambda: sidecar.engine.config if sidecar.engine is not None else None,
        traffic=sidecar.traffic,
        on_lost=supervisor.kill,
    )
    sidecar.relays_ready = owner.ready
    sidecar.registry.register(WorkersCollector(owner))
    await sidecar.start()
    await owner.start(path)
    supervisor.start()
    log.info("serving the proxy port with %d relay workers", workers)
    ops = _Server(_uvicorn_config(sidecar.ops, settings, settings.metrics_port))
    loop = asyncio.get_running_loop()

    def stop_now() -> None:
        supervisor.kill_all()
        ops.force_exit = ops.should_exit = True

    stopping, signals_seen = _handle_signals(loop, stop_now)

    async def lifecycle() -> None:
        await stopping.wait()
        log.info(
            "signal %s: not ready, refusing new requests, draining",
            signal.Signals(signals_seen[0]).name,
        )
        sidecar.traffic.draining = True
        owner.sync()  # every worker refuses new generation requests from now
        await sidecar.drain(settings.drain_timeout)
        await supervisor.stop()
        ops.should_exit = True

    watcher = asyncio.ensure_future(lifecycle())
    try:
        result = await asyncio.gather(ops.serve(), return_exceptions=True)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        try:
            async with asyncio.timeout(15):  # exiting must not hang on a stuck worker or upstream
                await supervisor.stop(grace_seconds=5.0 if len(signals_seen) < 2 else 0.0)
                await owner.stop()
                await sidecar.stop()
        except TimeoutError:
            log.warning("shutdown timed out")
        listener.close()
        shutil.rmtree(private, ignore_errors=True)
        if sidecar.tracing is not None:
            sidecar.tracing.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    failed = [r for r in result if isinstance(r, BaseException)]
    if failed or not ops.started:
        log.error("server failed: %s", failed[0] if failed else "could not bind its ports")
        return 1
    return 0


def run(settings: Settings) -> int:
    logs.configure(settings.log_level, settings.log_format)
    # transformers warns at import that PyTorch is absent: the sidecar only needs tokenizers
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import uvloop

        return int(uvloop.run(serve(settings)))
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        return asyncio.run(serve(settings))
