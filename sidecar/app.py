"""Wiring and lifecycle: one process, one event loop, one ledger, two ports.

:class:`Sidecar` owns the long-lived parts (the shared ``httpx.AsyncClient``, the scraper, the
ledger and admission controller, the prompt counter, the metrics registry) and discovers the engine
(``/v1/models``, vLLM's cache config, the model's ``config.json`` and tokenizer when readable).
:func:`serve` runs the proxy port and the metrics port on one loop and handles SIGTERM: not ready at
once, new generation requests refused with 503, in-flight and startable queued requests given
``--drain-timeout`` to finish, then exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.cookiejar
import json
import logging
import math
import os
import signal
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from sidecar.admission import AdmissionController
from sidecar.exporter import EngineInfo, Metrics
from sidecar.geometry import GeometryError, KVGeometry, ModelKV, UniformBlocks, load_config
from sidecar.ledger import Ledger
from sidecar.projection import BlockMath
from sidecar.proxy import Proxy, Receive, Scope, Send
from sidecar.scraper import Scraper
from sidecar.settings import Settings
from sidecar.tokens import PromptCounter
from sidecar.upstream import UpstreamTransport
from sidecar.vllm_metrics import EngineSnapshot

log = logging.getLogger("sidecar")

OWN_CONNECTIONS = 64  # the sidecar's own calls: scrapes, /health, discovery, /tokenize
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def make_transport(settings: Settings, max_connections: int | None = None) -> UpstreamTransport:
    # keepalive_expiry shorter than uvicorn's 5 s keep-alive (vLLM's server): a pooled
    # connection the server is closing would fail the next request with "disconnected"
    return UpstreamTransport(
        max_connections=max_connections or settings.upstream_max_connections,
        keepalive_expiry=2.0,
    )


def upstream_timeout(settings: Settings) -> httpx.Timeout:
    return httpx.Timeout(
        connect=settings.upstream_connect_timeout,
        read=settings.upstream_read_timeout,
        write=settings.upstream_read_timeout,
        pool=settings.upstream_connect_timeout,
    )


def make_client(
    settings: Settings,
    *,
    transport: UpstreamTransport | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.AsyncClient:
    """A pooled client to vLLM with no default headers but ``headers``.

    The proxy sends on its transport directly (each client's own headers, nothing added); the
    sidecar's own calls (scrapes, /health, discovery, /tokenize) use a small client of their own,
    carrying vLLM's --api-key when set, so that they never wait behind a burst of clients in the
    proxy's pool.
    """
    client = httpx.AsyncClient(
        timeout=upstream_timeout(settings),
        transport=transport or make_transport(settings),
        follow_redirects=False,
        trust_env=False,
    )
    for name in list(client.headers.keys()):
        del client.headers[name]
    client.headers.update(headers or {})
    # The client is shared by every caller: a Set-Cookie in one caller's answer must never be
    # sent with another's request. Cookies pass through untouched, as headers.
    client.cookies = _NoCookieJar()
    return client


class _NoCookieJar(http.cookiejar.CookieJar):
    """A jar that keeps nothing and skips parsing: the proxy relays cookies, never stores them."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        return None


class Sidecar:
    """The process's state and its engine discovery."""

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        # the proxy's pool: Proxy sends on the transport directly, the client owns and closes it
        self.transport = make_transport(settings)
        self.client = make_client(settings, transport=self.transport)
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
        # Until discovery knows the block size, nothing is admitted (engine_ready() is False).
        self.blocks: BlockMath = UniformBlocks(16)
        self.ledger = Ledger(self.blocks)
        self.admission = AdmissionController(
            self.ledger,
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
        self.engine = EngineInfo()
        self.counter = PromptCounter(
            client=self.own_client,
            upstream=settings.upstream,
            served_model=None,
            tokenizer_path=None,
        )
        self.max_model_len = settings.max_model_len or 0
        self.geometry: KVGeometry | None = None
        self.metrics = Metrics(
            self.registry,
            self.admission,
            engine=lambda: self.engine,
            vllm_up=lambda: self.scraper.up,
            ready=self.ready,
            scrape_errors=lambda: self.scraper.errors_total,
            config_labels={
                "policy": settings.policy,
                "reservation": settings.reservation,
                "headroom": str(settings.headroom),
                "stale_policy": settings.stale_policy,
            },
        )
        self.discovered = False
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self.draining = False
        self.passthrough_in_flight = 0  # non-generating requests being relayed
        self.vllm_healthy = False
        self._discovery: asyncio.Task[None] | None = None
        self._health: asyncio.Task[None] | None = None

    # --- readiness ----------------------------------------------------------------------------

    def engine_ready(self) -> bool:
        """Discovery is complete: block size, capacity, context length and counter are known."""
        return self.discovered

    def ready(self) -> bool:
        return (
            self.discovered
            and not self.draining
            and self.vllm_healthy
            # the snapshot's age, not the last scrape's outcome: one failed scrape (a loop
            # lagging under a burst) must not take the pod out of service; stale data does
            and self.scraper.latest is not None
            and self.scraper.age() <= self.settings.metrics_stale_after
        )

    def readiness(self) -> dict[str, Any]:
        return {
            "ready": self.ready(),
            "discovered": self.discovered,
            "draining": self.draining,
            "vllm_up": self.scraper.up,
            "vllm_healthy": self.vllm_healthy,
            "vllm_metrics_age_seconds": _finite(self.scraper.age()),
            "last_error": self.scraper.last_error,
        }

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.metrics.event_loop_tasks.set_function(self.event_loop_tasks)
        self.scraper.add_listener(self._on_snapshot)
        self.scraper.start()
        self._discovery = asyncio.ensure_future(self._discover_forever())
        self._health = asyncio.ensure_future(self._check_health_forever())

    async def stop(self) -> None:
        for task in (self._discovery, self._health):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.scraper.stop()
        self.counter.close()
        await self.client.aclose()
        await self.own_client.aclose()

    async def drain(self, deadline_seconds: float) -> None:
        """Stop admitting, let what runs (and queued requests that can still start) finish."""
        self.draining = True
        self.admission.draining = True
        log.info(
            "draining: %d in flight, %d queued, deadline %.0fs",
            len(self.ledger),
            self.admission.queue_depth,
            deadline_seconds,
        )
        deadline = time.monotonic() + deadline_seconds
        # polled: in-flight requests end in many places (answer, error, disconnect)
        while self._busy() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        self.admission.fail_queue()
        if len(self.ledger) or self.passthrough_in_flight:
            log.warning(
                "drain deadline reached with %d generation and %d other requests in flight",
                len(self.ledger),
                self.passthrough_in_flight,
            )
        else:
            log.info("drained")

    def event_loop_tasks(self) -> int:
        """Tasks alive on the sidecar's loop (callable from any thread, e.g. a metrics scrape)."""
        return len(asyncio.all_tasks(self._loop)) if self._loop is not None else 0

    def _busy(self) -> bool:
        return bool(len(self.ledger) or self.admission.queue_depth or self.passthrough_in_flight)

    def _on_snapshot(self, snap: EngineSnapshot) -> None:
        if self.discovered and snap.block_size and snap.block_size != self.blocks.block_size:
            log.warning("vLLM's block size changed to %d; rediscovering", snap.block_size)
            self.discovered = False
            self._discovery = asyncio.ensure_future(self._discover_forever())
            return
        self.admission.on_snapshot(snap)
        self.metrics.on_snapshot()
        if snap.num_gpu_blocks:
            self.engine.num_gpu_blocks = snap.num_gpu_blocks

    async def _check_health_forever(self) -> None:
        """vLLM's /health: its API can serve /metrics while its engine is dead (then 503)."""
        url = self.settings.upstream + "/health"
        timeouts = 0
        while True:
            try:
                async with asyncio.timeout(max(2.0, self.settings.scrape_interval)):
                    resp = await self.own_client.get(url)
                healthy = resp.status_code == 200
                timeouts = 0
            except (TimeoutError, httpx.TimeoutException):
                # one late answer is more often this loop lagging under a burst than vLLM
                # failing: only a second one in a row takes the pod out of service
                timeouts += 1
                healthy = self.vllm_healthy and timeouts < 2
            except httpx.HTTPError:
                healthy = False  # refused or reset: vLLM is not there
                timeouts = 0
            if healthy != self.vllm_healthy:
                log.log(
                    logging.INFO if healthy else logging.WARNING,
                    "vLLM /health: %s",
                    "healthy" if healthy else "not healthy",
                )
            self.vllm_healthy = healthy
            await asyncio.sleep(self.settings.scrape_interval)

    # --- discovery ----------------------------------------------------------------------------

    async def _discover_forever(self) -> None:
        failures = 0
        while True:
            try:
                await self._discover()
                return
            except (httpx.HTTPError, LookupError, ValueError) as exc:
                if failures == 0:
                    log.warning("waiting for vLLM at %s: %s", self.settings.upstream, exc)
                failures += 1
            await asyncio.sleep(min(2.0, 0.25 * (failures + 1)))

    async def _discover(self) -> None:
        settings = self.settings
        resp = await self.own_client.get(settings.upstream + "/v1/models")
        resp.raise_for_status()
        models = resp.json().get("data") or []
        if not models:
            raise LookupError("vLLM lists no models")
        entry = models[0]
        if settings.served_model_name:
            entry = next((m for m in models if m.get("id") == settings.served_model_name), entry)
        served = str(entry.get("id"))
        max_model_len = settings.max_model_len or int(entry.get("max_model_len") or 0)
        if max_model_len <= 0:
            raise LookupError("vLLM did not report max_model_len; set --max-model-len")

        snap = self.scraper.latest
        if snap is None:
            snap = await self.scraper.scrape_once()
        if snap is None or not snap.block_size or not snap.num_gpu_blocks:
            raise LookupError(
                f"no cache config in vLLM's /metrics yet ({self.scraper.last_error or 'waiting'})"
            )

        model_dir = _model_dir(settings.model_config_path, entry.get("root"))
        geometry: KVGeometry | None = None
        if model_dir is not None:
            try:
                kv = ModelKV.from_config(
                    load_config(model_dir), kv_cache_dtype=snap.cache_dtype or "auto"
                )
                geometry = KVGeometry.build(
                    kv, block_size=snap.block_size, max_model_len=max_model_len
                )
            except GeometryError as exc:
                if settings.model_config_path is not None:
                    raise ValueError(f"--model-config: {exc}") from None
                log.warning(
                    "cannot size the model from %s (%s); assuming full attention", model_dir, exc
                )
        if geometry is not None:
            blocks: BlockMath = geometry
            bytes_per_block: int | None = geometry.bytes_per_block
        else:
            # Without a config, block math is exact for full-attention models; bytes come from
            # vLLM's KV memory figure, which is only right when the pool was not overridden.
            bytes_per_block = (
                snap.kv_cache_memory_bytes // snap.num_gpu_blocks
                if snap.kv_cache_memory_bytes
                else None
            )
            blocks = UniformBlocks(snap.block_size, bytes_per_block)

        tokenizer = settings.tokenizer
        if tokenizer is None and model_dir is not None:
            directory = model_dir if model_dir.is_dir() else model_dir.parent
            if any((directory / name).exists() for name in _TOKENIZER_FILES):
                tokenizer = directory
        counter = PromptCounter(
            client=self.own_client,
            upstream=settings.upstream,
            served_model=served,
            tokenizer_path=tokenizer,
        )
        # Not ready until the tokenizer has loaded (or failed to): the load holds the GIL in long
        # stretches, and requests admitted meanwhile would stall seconds behind it.
        local = await counter.wait_ready()

        self.blocks = blocks
        self.ledger.blocks = blocks
        self.geometry = geometry
        self.max_model_len = max_model_len
        self.counter.close()
        self.counter = counter
        self.engine = EngineInfo(
            model=served,
            block_size=snap.block_size,
            num_gpu_blocks=snap.num_gpu_blocks,
            cache_dtype=snap.cache_dtype or "",
            prefix_caching=str(snap.prefix_caching).lower()
            if snap.prefix_caching is not None
            else "",
            bytes_per_block=bytes_per_block,
        )
        self.admission.on_snapshot(snap)
        self.discovered = True
        log.info(
            "vLLM discovered: model %s, max_model_len %d, %d blocks of %d tokens, %s bytes per "
            "block (%s), prompt counting %s",
            served,
            max_model_len,
            snap.num_gpu_blocks,
            snap.block_size,
            bytes_per_block if bytes_per_block is not None else "unknown",
            "model config" if geometry is not None else "no model config",
            f"local tokenizer {tokenizer}" if local else "vLLM /tokenize",
        )


def _model_dir(explicit: Path | None, root: Any) -> Path | None:
    if explicit is not None:
        return explicit
    if isinstance(root, str) and root:
        path = Path(root)
        with contextlib.suppress(OSError):
            if (path / "config.json").is_file():
                return path
    return None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# --- the metrics port ---------------------------------------------------------------------------


class OpsApp:
    """The metrics port: /metrics, /healthz, /readyz (and /state, the ledger in JSON)."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sc = sidecar

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            status, ctype, body = (
                200,
                CONTENT_TYPE_LATEST.encode(),
                generate_latest(self.sc.registry),
            )
        elif path == "/healthz":
            status, ctype, body = 200, b"text/plain", b"ok\n"
        elif path == "/readyz":
            info = self.sc.readiness()
            status, ctype, body = (
                (200 if info["ready"] else 503),
                b"application/json",
                json.dumps(info).encode(),
            )
        elif path == "/state":
            data = _dataclass_dict(self.sc.admission.state())
            data["event_loop_tasks"] = self.sc.event_loop_tasks()
            status, ctype, body = 200, b"application/json", json.dumps(data).encode()
        else:
            status, ctype, body = 404, b"text/plain", b"not found\n"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _dataclass_dict(obj: Any) -> dict[str, Any]:
    from dataclasses import fields

    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        out[f.name] = _finite(value) if isinstance(value, float) else value
    return out


# --- serving ------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to us (two servers share one loop and one drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _uvicorn_config(app: Any, settings: Settings, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=port,
        lifespan="off",
        access_log=False,
        server_header=False,  # the upstream's own Server and Date headers pass through
        date_header=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
        backlog=4096,
    )


async def serve(settings: Settings, *, ready_file: Path | None = None) -> int:
    sidecar = Sidecar(settings)
    await sidecar.start()
    proxy = _Server(_uvicorn_config(Proxy(sidecar), settings, settings.port))
    ops = _Server(_uvicorn_config(OpsApp(sidecar), settings, settings.metrics_port))
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    signals_seen: list[int] = []

    def on_signal(sig: int) -> None:
        signals_seen.append(sig)
        if len(signals_seen) > 1:  # a second signal: stop now
            log.warning("second signal: exiting without waiting")
            proxy.force_exit = ops.force_exit = True
            proxy.should_exit = ops.should_exit = True
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

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
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed or not (proxy.started and ops.started):
        log.error("server failed: %s", failed[0] if failed else "could not bind its ports")
        return 1
    return 0


def run(settings: Settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # one line per upstream request would drown the sidecar's own log
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # transformers warns at import that PyTorch is absent: the sidecar only needs tokenizers
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import uvloop

        return int(uvloop.run(serve(settings)))
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        return asyncio.run(serve(settings))
