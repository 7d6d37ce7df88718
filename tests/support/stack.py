"""The real sidecar in front of a fake vLLM, in the test's own event loop.

:func:`run_sidecar` wires ``Sidecar`` as ``serve()`` wires it (its proxy and ops apps on uvicorn,
on free loopback ports) and yields a :class:`Stack`: the sidecar, the fake, and clients for the
proxy port, the metrics port and the fake itself.

    async with run_sidecar(upstream, policy="queue") as stack:
        resp = await stack.client.post("/v1/completions", json=body)
        assert stack.ledger_empty()
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from harness.fake_vllm import FakeServer, FakeVllm, bound_socket
from sidecar.app import Sidecar, _Server, _uvicorn_config
from sidecar.config import Settings
from tests.support.exporter import sample_value
from tests.support.wait import eventually

# Plain HTTP only: an empty TLS context spares each client loading the CA store (~50 ms).
NO_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


@dataclass
class Stack:
    """A running sidecar in front of the fake, with clients for its two ports and the fake."""

    sidecar: Sidecar
    fake: FakeVllm
    upstream: FakeServer
    url: str
    ops_url: str
    port: int
    client: httpx.AsyncClient  # to the proxy port
    ops: httpx.AsyncClient  # to the metrics port
    direct: httpx.AsyncClient  # to the fake, bypassing the sidecar

    async def state(self) -> dict[str, Any]:
        return dict((await self.ops.get("/state")).json())

    async def ready_status(self) -> int:
        return (await self.ops.get("/readyz")).status_code

    def sample(self, name: str, **labels: str) -> float:
        value = sample_value(self.sidecar.registry, name, labels)
        return 0.0 if value is None else value

    def decisions(self, decision: str, reason: str) -> float:
        return self.sample("kv_sidecar_requests_total", decision=decision, reason=reason)

    def decisions_total(self) -> float:
        """Every request counted at the gate, whatever its decision and reason."""
        return sum(
            sample.value
            for family in self.sidecar.registry.collect()
            if family.name == "kv_sidecar_requests"
            for sample in family.samples
            if sample.name == "kv_sidecar_requests_total"
        )

    def ledger_empty(self) -> bool:
        state = self.sidecar.admission.state()
        return state.in_flight == 0 and state.reserved_blocks == 0 and state.queue_depth == 0


@asynccontextmanager
async def run_sidecar(
    upstream: FakeServer, *, discovered: bool = True, **overrides: Any
) -> AsyncIterator[Stack]:
    """The sidecar wired as ``serve()`` wires it, on free loopback ports of this event loop."""
    proxy_sock, ops_sock = bound_socket(), bound_socket()
    settings = Settings(
        upstream=upstream.url,
        host="127.0.0.1",
        port=proxy_sock.getsockname()[1],
        metrics_port=ops_sock.getsockname()[1],
        scrape_interval=0.05,
        log_level="warning",
        **overrides,
    )
    sidecar = Sidecar(settings)
    await sidecar.start()
    servers = [
        _Server(_uvicorn_config(sidecar.proxy, settings, settings.port)),
        _Server(_uvicorn_config(sidecar.ops, settings, settings.metrics_port)),
    ]
    tasks = [
        asyncio.ensure_future(server.serve(sockets=[sock]))
        for server, sock in zip(servers, (proxy_sock, ops_sock), strict=True)
    ]
    try:
        await eventually(lambda: all(s.started for s in servers), "servers started", 5)
        if discovered:
            await eventually(lambda: sidecar.discovered, "vLLM discovered", 5)
        url = f"http://127.0.0.1:{settings.port}"
        ops_url = f"http://127.0.0.1:{settings.metrics_port}"
        async with (
            httpx.AsyncClient(base_url=url, timeout=10, verify=NO_TLS) as client,
            httpx.AsyncClient(base_url=ops_url, timeout=10, verify=NO_TLS) as ops,
            httpx.AsyncClient(base_url=upstream.url, timeout=10, verify=NO_TLS) as direct,
        ):
            yield Stack(
                sidecar=sidecar,
                fake=upstream.app,
                upstream=upstream,
                url=url,
                ops_url=ops_url,
                port=settings.port,
                client=client,
                ops=ops,
                direct=direct,
            )
    finally:
        upstream.app.metrics_mode = "ok"  # let a hanging scrape end
        for server in servers:
            server.should_exit = True
        await asyncio.wait(tasks, timeout=5)
        await sidecar.stop()
