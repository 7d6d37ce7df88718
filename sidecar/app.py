"""The composition root: build the parts once, wire them, and serve them.

:class:`Sidecar` builds the long-lived parts (the transports to vLLM, the scraper, the health
monitor, the ledger and admission controller, the metrics registry, the proxy and ops apps, and,
with relay workers, the admission owner they ask) and wires them: each scrape goes to admission
and the exporter, the engine that discovery finds (``sidecar.http.engine_setup``) to admission
and the proxy, learned lengths to their file (``sidecar.admission.lengths_file``). :func:`serve`
runs the proxy port and the metrics port on one loop, or (``--workers`` above 1) the metrics port
here and the proxy port in relay worker processes, and the HAProxy agent (``--agent-port``,
``sidecar.http.agent``) in this process, where admission is; both end by the one sequence of
``sidecar.http.lifecycle``: on SIGTERM not ready at once, new generation requests refused with
503, in-flight and startable queued requests given ``--drain-timeout`` to finish, then exit 0; a
configuration error no retry can mend (a garbled ``--model-config``) ends it too, raised for the
CLI to print."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from prometheus_client import CollectorRegistry

from sidecar.admission.controller import AdmissionController
from sidecar.admission.lengths_file import LengthsSaver
from sidecar.config import Settings, parse_tenant_shares
from sidecar.counting import PromptCounter
from sidecar.engine.discovery import EngineConfig
from sidecar.engine.health import HealthMonitor
from sidecar.engine.scraper import Scraper
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.errors import ConfigError
from sidecar.http.admin import Admin, SettingsCollector
from sidecar.http.agent import AgentServer, Room
from sidecar.http.clients import make_transport, own_client
from sidecar.http.engine_setup import EngineDiscovery, close_counter
from sidecar.http.lifecycle import ReadyCheck, Serving, drain, serve_until_stopped
from sidecar.http.ops import build_ops_app
from sidecar.http.seams import Engine, Traffic
from sidecar.http.serving import Server as _Server
from sidecar.http.serving import build_proxy
from sidecar.http.serving import uvicorn_config as _uvicorn_config
from sidecar.http.workers.owner import AdmissionOwner, WorkersCollector
from sidecar.http.workers.supervisor import RelayWorkers, worker_count
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.observability import logs
from sidecar.observability.exporter import Metrics
from sidecar.observability.loop_lag import LoopLagMonitor
from sidecar.observability.refusals import RecentRefusals
from sidecar.observability.tracing import Tracing
from sidecar.observability.tracing import from_env as tracing_from_env

log = logging.getLogger("sidecar")


class Sidecar:
    """The process's long-lived parts, built and wired once; the engine swapped in when found.

    ``relays``: this process is the relay workers' owner (it decides; the workers serve the
    proxy port and count prompts)."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        tracing: Tracing | None = None,
        relays: RelayWorkers | None = None,
    ) -> None:
        self.settings = settings
        self.tracing = tracing  # None: no spans (the OTEL_* environment asked for none)
        self.relays = relays
        self.registry = registry if registry is not None else CollectorRegistry()
        # the proxy's pool: the relay sends on the transport directly (each client's own headers)
        self.transport = make_transport(settings)
        self.own_client = own_client(settings)
        self.scraper = Scraper(
            self.own_client, settings.upstream + "/metrics", interval=settings.scrape_interval
        )
        self.health = HealthMonitor(
            self.own_client, settings.upstream + "/health", interval=settings.scrape_interval
        )
        # Until discovery knows the block size, nothing is admitted (self.engine is None).
        self.admission = AdmissionController(
            Ledger(UniformBlocks(16)),
            policy=settings.policy,
            headroom=settings.headroom,
            max_queue_depth=settings.max_queue_depth,
            max_queue_wait=settings.max_queue_wait,
            spill_wait=settings.spill_wait,
            reservation=settings.reservation,
            expected_quantile=settings.expected_quantile,
            expected_prior=settings.expected_prior,
            risk_steps=settings.risk_steps,
            tpot_target=settings.tpot_target,
            ttft_target=settings.ttft_target,
            stale_after=settings.metrics_stale_after,
            stale_policy=settings.stale_policy,
            tenant_shares=parse_tenant_shares(settings.tenant_shares),
            tenant_max_share=settings.tenant_max_share,
            tenant_max_queue=settings.tenant_max_queue,
            priority_reserve=settings.priority_reserve,
            priority_pace=settings.priority_pace,
        )
        self.lengths = (
            LengthsSaver(settings.lengths_file, self.admission.learner)
            if settings.lengths_file is not None
            else None
        )
        self.engine: Engine | None = None  # swapped whole when found, never edited in place
        self.traffic = Traffic()
        config_labels = {  # kv_sidecar_config_info's; the admin API keeps policy and headroom
            "policy": settings.policy.value,
            "reservation": settings.reservation.value,
            "headroom": str(settings.headroom),
            "stale_policy": settings.stale_policy.value,
        }
        self.metrics = Metrics(
            self.registry,
            self.admission,
            engine=self._engine_config,
            vllm_up=lambda: self.scraper.up,
            ready=self.ready,
            scrape_errors=lambda: self.scraper.errors_total,
            config_labels=config_labels,
            process_children=relays.supervisor.pids if relays is not None else None,
        )
        # the runtime settings (--admin): their routes on the metrics port, metrics and /state
        self.admin = Admin(
            self.admission,
            enabled=settings.admin,
            token=settings.admin_token,
            config_labels=config_labels,
            refusals=RecentRefusals(self.metrics.requests),
        )
        self.registry.register(SettingsCollector(self.admin))
        self.loop_lag = LoopLagMonitor(self.metrics.event_loop_lag)
        self.owner: AdmissionOwner | None = None
        if relays is not None:
            self.owner = AdmissionOwner(
                self.admission,
                self.metrics,
                settings=settings,
                workers=relays.count,
                engine=self._engine_config,
                traffic=self.traffic,
                on_lost=relays.supervisor.kill,
            )
            self.registry.register(WorkersCollector(self.owner))
        self.discovery = EngineDiscovery(
            settings,
            self.own_client,
            self.scraper,
            observer=self.metrics,
            on_found=self._found,
            local_counting=relays is None,
        )
        self.ready_check = ReadyCheck(
            discovered=lambda: self.discovered,
            traffic=self.traffic,
            health=self.health,
            scraper=self.scraper,
            stale_after_seconds=settings.metrics_stale_after,
            discovery_error=lambda: self.discovery.last_error,
            relays_ready=self.owner.ready if self.owner is not None else None,
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
            readiness=self.ready_check.report,
            state=self.admission.state,
            event_loop_tasks=self.event_loop_tasks,
            runtime=self.admin.state,
            docs=settings.docs,
        )
        self.admin.add_routes(self.ops)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()

    @property
    def discovered(self) -> bool:
        """Discovery is complete: block size, capacity, context length and counter are known."""
        return self.engine is not None

    @property
    def counter(self) -> PromptCounter | None:
        counter = self.engine.counter if self.engine is not None else None
        return counter if isinstance(counter, PromptCounter) else None

    def ready(self) -> bool:
        return self.ready_check.ready()

    def agent_room(self) -> Room:
        """What the HAProxy agent answers from (``sidecar.http.agent``): admission's budget and
        commitments, and readiness."""
        ready = self.ready_check.ready()
        return Room(
            budget_blocks=self.admission.budget_blocks(),
            committed_blocks=self.admission.committed_blocks(),
            queued_blocks=self.admission.queued_peak_blocks,
            ready=ready,
            draining=self.traffic.draining,
            why_not="" if ready else self.ready_check.why_not(),
        )

    def servers(self, *, proxy: bool) -> list[Serving]:
        """This process's servers: the proxy port (``proxy``: not where relay workers serve it),
        the metrics port, and the HAProxy agent when ``--agent-port`` is set."""
        settings = self.settings
        out: list[Serving] = []
        if proxy:
            out.append(_Server(_uvicorn_config(self.proxy, settings, settings.port)))
        out.append(_Server(_uvicorn_config(self.ops, settings, settings.metrics_port)))
        if settings.agent_port is not None:
            out.append(AgentServer(settings.host, settings.agent_port, self.agent_room))
        return out

    def event_loop_tasks(self) -> int:
        """Tasks alive on the sidecar's loop (callable from any thread, e.g. a metrics scrape)."""
        return len(asyncio.all_tasks(self._loop)) if self._loop is not None else 0

    # --- lifecycle (sidecar.http.lifecycle.Service) ---------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.metrics.event_loop_tasks.set_function(self.event_loop_tasks)
        self.loop_lag.start()
        self.scraper.add_listener(self._on_snapshot)
        self.scraper.start()
        self.discovery.start()
        self.health.start()
        if self.lengths is not None:
            self.lengths.start()
        if self.relays is not None and self.owner is not None:
            await self.owner.start(self.relays.socket_path)
            self.relays.supervisor.start()
            log.info("serving the proxy port with %d relay workers", self.relays.count)

    async def failed(self) -> ConfigError:
        return await self.discovery.failed()

    async def drain(self) -> None:
        self.traffic.draining = True
        if self.owner is not None:
            self.owner.sync()  # every worker refuses new generation requests from now
        await drain(self.admission, self.traffic, self.settings.drain_timeout)
        if self.relays is not None:
            await self.relays.supervisor.stop()  # nothing left to relay

    def stop_now(self) -> None:
        if self.relays is not None:
            self.relays.supervisor.kill_all()

    async def stop(self, *, hurried: bool = False) -> None:
        try:
            if self.relays is not None:
                await self.relays.supervisor.stop(grace_seconds=0.0 if hurried else 5.0)
            if self.owner is not None:
                await self.owner.stop()
            await self.discovery.stop()
            await self.health.stop()
            await self.loop_lag.stop()
            await self.scraper.stop()
            if self.lengths is not None:
                await self.lengths.stop()  # the last write
            close_counter(self.engine)
            await self.transport.aclose()
            await self.own_client.aclose()
        finally:  # even when cut short by the shutdown's timeout
            if self.relays is not None:
                self.relays.close()
            if self.tracing is not None:
                self.tracing.shutdown()  # export the spans still queued (the servers have ended)

    # --- wiring ---------------------------------------------------------------------------------

    def _engine_config(self) -> EngineConfig | None:
        return self.engine.config if self.engine is not None else None

    def _on_snapshot(self, snap: EngineSnapshot) -> None:
        engine = self.engine
        if engine is not None and snap.block_size and snap.block_size != engine.config.block_size:
            log.warning("vLLM's block size changed to %d; rediscovering", snap.block_size)
            self.engine = None
            self.discovery.start(retire=engine)
            return
        if engine is not None:
            config = engine.config.with_snapshot(snap)
            if config is not engine.config:
                self.engine = dataclasses.replace(engine, config=config)
        self.admission.on_snapshot(snap)
        self.metrics.on_snapshot()
        self.admin.refusals.sample()

    def _found(self, engine: Engine, snap: EngineSnapshot) -> None:
        config = engine.config
        # vLLM's prefix caching (on unless its cache config says off) holds shared blocks once
        self.admission.configure(
            config.blocks,
            share_prefixes=config.prefix_caching is not False,
            roofline=config.roofline,
        )
        if self.lengths is not None:
            self.lengths.restore(config.model)
        self.engine = engine
        self.admission.on_snapshot(snap)


# --- serving ------------------------------------------------------------------------------------


async def serve(settings: Settings) -> int:
    """Serve until SIGTERM (drained) or SIGINT; the exit code. Raises :class:`ConfigError` for
    a configuration that cannot work, once everything has stopped."""
    workers = worker_count(settings.workers)
    tracing = tracing_from_env(os.environ)
    if workers > 1:
        return await serve_with_workers(settings, workers, tracing=tracing)
    sidecar = Sidecar(settings, tracing=tracing)
    await sidecar.start()
    servers = sidecar.servers(proxy=True)
    return await serve_until_stopped(sidecar, servers, stop_timeout_seconds=10)


async def serve_with_workers(
    settings: Settings, workers: int, *, tracing: Tracing | None = None
) -> int:
    """The admission owner: the scraper, admission and the metrics port here, the proxy port
    served by ``workers`` relay worker processes (docs/relay-workers.md)."""
    try:
        relays = RelayWorkers(workers, host=settings.host, port=settings.port)
    except OSError as exc:
        log.error("server failed: could not bind the proxy port %d: %s", settings.port, exc)
        return 1
    sidecar = Sidecar(settings, tracing=tracing, relays=relays)
    await sidecar.start()
    # the agent answers from admission, which lives here
    servers = sidecar.servers(proxy=False)
    # a stuck worker gets 5 s after the drain, then is killed
    return await serve_until_stopped(sidecar, servers, stop_timeout_seconds=15)


def run(settings: Settings) -> int:
    logs.configure(settings.log_level, settings.log_format)
    # transformers warns at import that PyTorch is absent: the sidecar only needs tokenizers
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import uvloop

        return int(uvloop.run(serve(settings)))
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        return asyncio.run(serve(settings))
