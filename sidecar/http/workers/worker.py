"""One relay worker process: the proxy port's app on the owner's listening socket.

Run by the owner (:class:`~sidecar.http.workers.supervisor.Supervisor`) as
``python -m sidecar.http.workers.worker --socket PATH --listen-fd N --index I``. It connects to
the owner, receives the settings, builds the same :class:`~sidecar.http.proxy.Proxy` and
:class:`~sidecar.http.generation.GenerationPath` as the single-process sidecar, with its own
pool to vLLM and the owner's stand-ins for the gate, the metrics and the engine
(:mod:`~sidecar.http.workers.remote`), builds its prompt counter from each engine config the
owner sends (counting happens here, with :func:`~sidecar.http.engine_setup.build_counter`, as in
the single process), and serves with uvicorn (uvloop, httptools) until SIGTERM
or until it loses the owner. SIGINT is the owner's to handle (the worker runs in a session of its
own, and ignores it too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
from collections.abc import Sequence

import httpx

from sidecar.config import Settings
from sidecar.engine.discovery import EngineConfig
from sidecar.http.clients import make_transport, own_client
from sidecar.http.engine_setup import build_counter, close_counter, counter_key
from sidecar.http.seams import Engine
from sidecar.http.serving import Server, build_proxy, uvicorn_config
from sidecar.http.workers import wire
from sidecar.http.workers.remote import OwnerLink
from sidecar.observability import logs
from sidecar.observability.tracing import from_env as tracing_from_env

log = logging.getLogger("sidecar.worker")

#: the worker's own calls to vLLM (/tokenize): a few, apart from the relay's pool
_OWN_CONNECTIONS = 8
#: seconds a starting worker waits for its prompt counter before it serves anyway
FIRST_ENGINE_TIMEOUT = 120.0


class Engines:
    """Builds the worker's engine (config and prompt counter) from the owner's configs."""

    def __init__(
        self, link: OwnerLink, client: httpx.AsyncClient, settings: Settings, *, workers: int
    ) -> None:
        self.link = link
        self.client = client
        self.settings = settings
        self.workers = workers  # they share the pod's long-count slots
        self._latest: EngineConfig | None = None
        self._building: asyncio.Task[None] | None = None
        self._announced = False

    def on_config(self, config: EngineConfig | None) -> None:
        self._latest = config
        current = self.link.engine
        if config is None:
            self.link.engine = None  # the owner rediscovers; refuse as not ready meanwhile
            return
        if current is not None and counter_key(current.config) == counter_key(config):
            self.link.engine = Engine(config=config, counter=current.counter)
            return
        if self._building is None or self._building.done():
            self._building = asyncio.ensure_future(self._build(config))

    async def _build(self, config: EngineConfig) -> None:
        try:
            await self._build_counter(config)
        except Exception:  # the worker then answers 503 engine_not_ready, and says why here
            log.exception("relay worker %d: could not build the prompt counter", self.link.index)

    async def _build_counter(self, config: EngineConfig) -> None:
        counter = build_counter(
            config,
            self.settings,
            client=self.client,
            observer=self.link.metrics,
            processes=self.workers,
        )
        await counter.wait_ready()
        latest = self._latest
        if latest is None or counter_key(latest) != counter_key(config):
            counter.close()
            if latest is not None:  # it changed while we built: build for the newest
                self._building = asyncio.ensure_future(self._build(latest))
            return
        old = self.link.engine
        self.link.engine = Engine(config=latest, counter=counter)
        close_counter(old)
        if not self._announced:
            self._announced = True
            self.link.ready()

    async def first(self, timeout_seconds: float) -> None:
        """Wait (a while) for the engine being built from the owner's first config."""
        building = self._building
        if building is not None and self.link.engine is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_seconds):
                    await asyncio.shield(building)

    def close(self) -> None:
        if self._building is not None:
            self._building.cancel()
        close_counter(self.link.engine)


async def serve_worker(socket_path: str, listen_fd: int, index: int) -> int:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    link = OwnerLink(wire.Channel(reader, writer), index=index)
    settings, workers = await link.handshake()
    logs.configure(settings.log_level, settings.log_format)
    tracing = tracing_from_env(os.environ)
    # the pod's pool to vLLM, shared out among the workers
    transport = make_transport(
        settings, max(1, math.ceil(settings.upstream_max_connections / workers))
    )
    client = own_client(settings, _OWN_CONNECTIONS)
    engines = Engines(link, client, settings, workers=workers)
    link.follow_config(engines.on_config)
    # Accept only once prompts can be counted: until then the other workers take the
    # connections (the socket is shared), rather than this one answering 503.
    await engines.first(FIRST_ENGINE_TIMEOUT)
    proxy = build_proxy(
        settings,
        transport=transport,
        gate=link.gate,
        engine=lambda: link.engine,
        metrics=link.metrics,
        traffic=link.traffic,
        tracing=tracing,
    )
    server = Server(uvicorn_config(proxy, settings, settings.port))
    loop = asyncio.get_running_loop()
    code = 0

    def on_term() -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    loop.add_signal_handler(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reading = asyncio.ensure_future(link.run())

    async def exit_without_owner() -> None:
        nonlocal code
        await link.lost.wait()
        code = 1
        server.should_exit = server.force_exit = True

    orphaned = asyncio.ensure_future(exit_without_owner())
    try:
        await server.serve(sockets=[socket.socket(fileno=listen_fd)])
    finally:
        orphaned.cancel()
        link.report()
        await link.channel.drain()
        link.channel.close()
        reading.cancel()
        engines.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await transport.aclose()
                await client.aclose()
        if tracing is not None:
            tracing.shutdown()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar.http.workers.worker")
    parser.add_argument("--socket", required=True, help="the owner's Unix socket")
    parser.add_argument("--listen-fd", type=int, required=True, help="the proxy port's socket")
    parser.add_argument("--index", type=int, required=True, help="this worker's slot")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import uvloop

        return int(uvloop.run(serve_worker(args.socket, args.listen_fd, args.index)))
    except ImportError:  # pragma: no cover - uvicorn[standard] brings uvloop
        return asyncio.run(serve_worker(args.socket, args.listen_fd, args.index))
    except (ConnectionError, wire.ChannelClosed) as exc:
        print(f"relay worker {args.index}: no admission owner: {exc}", flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
