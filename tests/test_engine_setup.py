"""The shared engine setup (``sidecar.http.engine_setup``): the prompt counter as every process
builds it, and discovery's retry loop against a fake vLLM over real HTTP: found, retried while
vLLM cannot say (the reason kept for ``/readyz``), and given up at once on a configuration error
that no retry can mend."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir
from sidecar.config import Settings
from sidecar.counting.slots import default_slots
from sidecar.engine.discovery import EngineConfig
from sidecar.engine.scraper import Scraper
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.errors import ConfigError
from sidecar.http.engine_setup import EngineDiscovery, build_counter, close_counter, counter_key
from sidecar.http.seams import Engine
from sidecar.kv.geometry import UniformBlocks
from tests.support.faultkit import ToughFake


class Checks:
    def self_checked(self, shape: object, matched: bool) -> None:
        pass


def config(**changes: Any) -> EngineConfig:
    base = EngineConfig(
        model="tiny",
        max_model_len=1024,
        block_size=16,
        num_gpu_blocks=100,
        cache_dtype="auto",
        prefix_caching=True,
        blocks=UniformBlocks(16),
        bytes_per_block=None,
        tokenizer_path=Path("/models/tiny"),
    )
    return dataclasses.replace(base, **changes)


def test_the_counter_key_ignores_the_pool_size_only() -> None:
    assert counter_key(config()) == counter_key(config(num_gpu_blocks=5000))
    assert counter_key(config()) != counter_key(config(block_size=32))
    assert counter_key(config()) != counter_key(config(tokenizer_path=None))


@pytest.mark.parametrize(
    ("setting", "processes", "slots"),
    [(3, 1, 3), (None, 1, default_slots()), (6, 4, 1), (8, 2, 4), (1, 3, 1)],
)
async def test_the_long_count_slots_are_shared_among_the_processes(
    setting: int | None, processes: int, slots: int
) -> None:
    settings = Settings(max_concurrent_counts=setting, max_count_wait=3.0)
    async with httpx.AsyncClient() as client:
        counter = build_counter(
            config(), settings, client=client, observer=Checks(), processes=processes, local=False
        )
        try:
            assert counter.slots.slots == slots and counter.slots.max_wait_s == 3.0
        finally:
            counter.close()


async def test_the_counter_follows_the_config() -> None:
    """Prefix hashing only with vLLM's prefix caching on; no tokenizer where it does not count."""
    settings = Settings()
    async with httpx.AsyncClient() as client:
        hashed = build_counter(config(), settings, client=client, observer=Checks(), local=False)
        off = build_counter(
            config(prefix_caching=False), settings, client=client, observer=Checks(), local=False
        )
        try:
            assert hashed.block_size == 16 and off.block_size is None
            assert hashed.max_model_len == 1024
            assert not await hashed.wait_ready()  # the owner's: no tokenizer loaded, none waited
        finally:
            hashed.close()
            off.close()


# --- discovery against a fake vLLM -----------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny")


@pytest.fixture
def fake(model_dir: Path) -> Iterator[FakeServer]:
    with FakeServer(ToughFake(model_root=model_dir)) as server:
        yield server


@dataclasses.dataclass
class Found:
    engines: list[tuple[Engine, EngineSnapshot]] = dataclasses.field(default_factory=list)

    def __call__(self, engine: Engine, snap: EngineSnapshot) -> None:
        self.engines.append((engine, snap))


async def until(check: Any, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        await asyncio.sleep(0.02)


@dataclasses.dataclass
class Setup:
    discovery: EngineDiscovery
    found: Found


@asynccontextmanager
async def discovery_for(url: str, **overrides: Any) -> AsyncIterator[Setup]:
    settings = Settings(upstream=url, scrape_interval=0.05, **overrides)
    async with httpx.AsyncClient(timeout=5) as client:
        scraper = Scraper(client, url + "/metrics", interval=0.05)
        found = Found()
        discovery = EngineDiscovery(settings, client, scraper, observer=Checks(), on_found=found)
        scraper.start()
        discovery.start()
        try:
            yield Setup(discovery, found)
        finally:
            await discovery.stop()
            await scraper.stop()
            for engine, _ in found.engines:
                close_counter(engine)


async def test_discovery_finds_the_engine_and_builds_its_counter(fake: FakeServer) -> None:
    async with discovery_for(fake.url) as s:
        await until(lambda: s.found.engines, "the engine found")
        engine, snap = s.found.engines[0]
        assert engine.config.model == "tiny" and engine.config.block_size == snap.block_size
        assert engine.config.model_dir is not None  # the fake's root: the exact geometry
        assert s.discovery.last_error is None and s.discovery.error is None


async def test_a_transient_failure_is_retried_and_kept_as_the_last_error(
    model_dir: Path,
) -> None:
    """vLLM guards /v1/models with --api-key and the sidecar has none: its /metrics answers, so
    only discovery can say why the pod is not ready; once the key is dropped, it is found."""
    app = ToughFake(model_root=model_dir, api_key="secret")
    with FakeServer(app) as fake:
        async with discovery_for(fake.url) as s:
            await until(lambda: s.discovery.last_error is not None, "a failed attempt")
            assert "401" in (s.discovery.last_error or "")
            await asyncio.sleep(0.6)  # a few more attempts
            assert not s.found.engines and s.discovery.error is None
            app.api_key = None
            await until(lambda: s.found.engines, "the engine found once vLLM lets it ask")
            assert s.discovery.last_error is None


@pytest.mark.parametrize("problem", ["garbled", "missing", "tokenizer"])
async def test_a_configuration_error_ends_discovery_at_once(
    fake: FakeServer, tmp_path: Path, problem: str
) -> None:
    garbled = tmp_path / "config.json"
    garbled.write_text('{"num_hidden_layers": 2,')
    overrides: dict[str, Any] = {
        "garbled": {"model_config": garbled},
        "missing": {"model_config": tmp_path / "absent" / "config.json"},
        "tokenizer": {"tokenizer": tmp_path / "no-tokenizer"},
    }[problem]
    async with discovery_for(fake.url, **overrides) as s:
        async with asyncio.timeout(10):
            error = await s.discovery.failed()
        assert isinstance(error, ConfigError)
        said = {
            "garbled": "not valid JSON",
            "missing": "model config not found",
            "tokenizer": "--tokenizer: no such file or directory",
        }[problem]
        assert said in str(error)
        assert s.discovery.last_error is not None and said in s.discovery.last_error
        assert not s.found.engines
        # one attempt, no retry: /v1/models was asked once
        await asyncio.sleep(0.6)
        app = fake.app
        assert isinstance(app, FakeVllm)
        assert len(app.requests_to("/v1/models")) == 1
