"""The engine behind the sidecar, found and fitted with its prompt counter: one place for the single
process, the relay workers' owner and the relay workers.

It lives in ``sidecar.http`` because it joins two parts of the layer below that may not import
each other (``sidecar.engine``'s discovery and ``sidecar.counting``'s counter) into the value the
proxy reads, :class:`~sidecar.http.seams.Engine`; its users, ``sidecar.app`` and
``sidecar.http.workers.worker``, sit in this layer or above it. It needs no admission: what the
controller makes of a new engine is the caller's (``on_found``).

:class:`EngineDiscovery` asks vLLM (:func:`sidecar.engine.discovery.discover`) until it can say what
it serves. A transient failure (vLLM not up yet, a refused connection, no cache config in its
metrics yet) is retried, with a growing pause, and kept as :attr:`EngineDiscovery.last_error` for
``/readyz``. A :class:`~sidecar.errors.ConfigError` (a garbled ``--model-config``, a
``--tokenizer`` that does not exist) cannot get better by waiting: the loop ends and
:meth:`EngineDiscovery.failed` returns the error, so that the process stops with it.
:func:`build_counter` is the prompt counter for a discovered config, built alike in every process;
:func:`counter_key` says when a new config needs a new counter.

    discovery = EngineDiscovery(settings, client, scraper, observer=metrics, on_found=use)
    discovery.start()
    error = await discovery.failed()  # returns only if the configuration cannot work
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx

from sidecar.config import Settings
from sidecar.counting import PromptCounter
from sidecar.counting.self_check import CountingObserver
from sidecar.counting.slots import default_slots
from sidecar.engine.discovery import EngineConfig, discover
from sidecar.engine.scraper import Scraper
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.errors import ConfigError, one_line
from sidecar.http.seams import Engine

log = logging.getLogger("sidecar")

#: what a failed attempt may raise while vLLM is starting (or restarting): worth another try
TRANSIENT = (httpx.HTTPError, LookupError)


def counter_key(config: EngineConfig) -> tuple[object, ...]:
    """What the prompt counter is built from: a config that differs only in pool size keeps it."""
    return (
        config.model,
        config.tokenizer_path,
        config.max_model_len,
        config.block_size,
        config.prefix_caching,
    )


def build_counter(
    config: EngineConfig,
    settings: Settings,
    *,
    client: httpx.AsyncClient,
    observer: CountingObserver,
    local: bool = True,
    processes: int = 1,
) -> PromptCounter:
    """The prompt counter for ``config``: the model's tokenizer loading in the background, vLLM
    (``/tokenize``, or its render endpoints where they serve better) until it has, or when
    ``local`` is False (the relay workers' owner decides but does not count). ``processes``
    share the pod's long-count slots (the relay workers), one each at least."""
    slots = settings.max_concurrent_counts
    if processes > 1:
        slots = max(1, (slots or default_slots()) // processes)
    return PromptCounter(
        client=client,
        upstream=settings.upstream,
        served_model=config.model,
        tokenizer_path=config.tokenizer_path if local else None,
        max_model_len=config.max_model_len,
        observer=observer,
        # full prompt blocks are hashed for the ledger to count shared prefixes once
        block_size=config.block_size if config.prefix_caching is not False else None,
        max_concurrent_counts=slots,
        max_count_wait_s=settings.max_count_wait,
        render="better",
    )


def close_counter(engine: Engine | None) -> None:
    """Stop the counter's threads and self-checks (an engine being replaced or shut down)."""
    if engine is not None and isinstance(engine.counter, PromptCounter):
        engine.counter.close()


class EngineDiscovery:
    """Finds the engine, retrying while vLLM cannot say; ``on_found`` gets it with the snapshot it
    was found from. A permanent configuration error ends the search (:meth:`failed`)."""

    def __init__(
        self,
        settings: Settings,
        client: httpx.AsyncClient,
        scraper: Scraper,
        *,
        observer: CountingObserver,
        on_found: Callable[[Engine, EngineSnapshot], None],
        local_counting: bool = True,
    ) -> None:
        self.settings = settings
        self.client = client
        self.scraper = scraper
        self.observer = observer
        self.on_found = on_found
        #: False for the relay workers' owner: the workers count, so it loads no tokenizer
        self.local_counting = local_counting
        #: why the latest attempt failed, while the engine is not found (None once it is)
        self.last_error: str | None = None
        self.error: ConfigError | None = None
        self._failed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, *, retire: Engine | None = None) -> None:
        """Search (again); ``retire``: the engine being replaced, closed once the new one is in."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = asyncio.ensure_future(self._search(retire))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def failed(self) -> ConfigError:
        """Wait for a permanent configuration error (forever, if there is none)."""
        await self._failed.wait()
        assert self.error is not None
        return self.error

    async def _search(self, retire: Engine | None) -> None:
        failures = 0
        while True:
            try:
                engine, snap = await self.find()
                break
            except ConfigError as exc:
                self.last_error = one_line(str(exc))
                self.error = exc
                self._failed.set()
                return
            except TRANSIENT as exc:
                self.last_error = one_line(str(exc) or type(exc).__name__)
                if failures == 0:
                    log.warning("waiting for vLLM at %s: %s", self.settings.upstream, exc)
                failures += 1
            await asyncio.sleep(min(2.0, 0.25 * (failures + 1)))
        self.last_error = None
        self.on_found(engine, snap)
        close_counter(retire)

    async def find(self) -> tuple[Engine, EngineSnapshot]:
        """One attempt: raises a :data:`TRANSIENT` error or a :class:`ConfigError`."""
        settings, scraper = self.settings, self.scraper
        snap = scraper.latest
        if snap is None:
            snap = await scraper.scrape_once()
        if snap is None:
            raise LookupError(f"no scrape of vLLM's /metrics yet ({scraper.last_error})")
        config = await discover(
            self.client,
            settings.upstream,
            snap,
            served_model_name=settings.served_model_name,
            max_model_len=settings.max_model_len,
            model_config_path=settings.model_config_path,
            tokenizer=settings.tokenizer,
            default_max_tokens=settings.default_max_tokens,
            max_tokens_cap=settings.max_tokens_cap,
        )
        counter = build_counter(
            config,
            settings,
            client=self.client,
            observer=self.observer,
            local=self.local_counting,
        )
        # Not found until the tokenizer has loaded (or failed to): the load holds the GIL in long
        # stretches, and requests admitted meanwhile would stall seconds behind it.
        local = await counter.wait_ready()
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
                if not self.local_counting
                else f"local tokenizer {config.tokenizer_path}"
                if local
                else "vLLM /tokenize"
            ),
        )
        return Engine(config=config, counter=counter), snap
