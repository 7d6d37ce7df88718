"""Long prompts under load: counting slots, shedding, and the event loop kept free.

The tests assert structure, never milliseconds (the relay's inter-chunk gap next to 128k-token
counts is measured by ``python -m bench.counting``): that :class:`CountingSlots` grants, queues
and sheds as it says; that the Rust tokenizer lets the GIL go while it tokenizes a long text;
that long counts run off the event loop and beyond the cap are shed with an OpenAI-shaped 429
``counting_busy`` and a ``Retry-After``; and that a stream relayed next to a long count keeps
flowing while the count runs.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from harness.fake_vllm import FakeServer, FakeVllm
from harness.vllm_cpu import ensure_tokenizer_model
from sidecar.config import Settings
from sidecar.counting import CountMethod, ModelTokenizer, PromptCounter
from sidecar.counting.slots import CountingSlots, default_slots
from sidecar.errors import CountingBusy
from tests.support.fake_upstream import serve_fresh
from tests.support.openai_errors import openai_error, retry_after
from tests.support.stack import Stack, run_sidecar
from tests.support.wait import eventually

#: Words the generated tokenizer makes one token each, with or without a space before them: a
#: prompt of them, sent without special tokens, counts as the fake vLLM's /tokenize counts it
#: (one per word), so that the counter's self-check agrees with its local counts.
ONE_TOKEN_WORDS = ("a", "layer", "value", "one", "eight", "user", "data", "rollout")


def prompt_of(tokens: int, salt: int = 0) -> str:
    """A text prompt of ``tokens`` tokens that no other salt's prompt prefixes."""
    words = itertools.islice(itertools.cycle(ONE_TOKEN_WORDS), salt, salt + tokens)
    return " ".join(words)


# --- CountingSlots ----------------------------------------------------------------------------


async def test_a_free_slot_is_taken_at_once_and_the_next_count_waits_its_turn() -> None:
    slots = CountingSlots(1, max_wait_s=60)
    first = await slots.acquire(10_000)
    second = asyncio.ensure_future(slots.acquire(10_000))
    third = asyncio.ensure_future(slots.acquire(10_000))
    await asyncio.sleep(0)
    assert (slots.running, slots.waiting) == (1, 2)
    assert not second.done() and not third.done()

    slots.release(first, seconds=0.01)
    granted = await second  # first come, first served
    assert not third.done() and (slots.running, slots.waiting) == (1, 1)
    slots.release(granted, seconds=0.01)
    slots.release(granted, seconds=0.01)  # idempotent: the third still gets the only slot
    slots.release(await third, seconds=None)
    assert (slots.running, slots.waiting, slots.shed) == (0, 0, 0)


async def test_a_count_expected_to_wait_too_long_is_shed_at_once_with_a_retry_after() -> None:
    slots = CountingSlots(2, max_wait_s=1.0, seconds_per_char=1e-6)
    held = [await slots.acquire(1_000_000), await slots.acquire(1_000_000)]
    # the work ahead: half of the 2M characters being counted, over 2 slots, at 1 us each
    assert slots.expected_wait_s() == pytest.approx(0.5)
    waiting = asyncio.ensure_future(slots.acquire(1_000_000))  # 0.5 s ahead of it: it waits
    await asyncio.sleep(0)
    assert slots.waiting == 1
    assert slots.expected_wait_s() == pytest.approx(1.0)
    more = asyncio.ensure_future(slots.acquire(1_000_000))  # 1.0 s: still within the bound
    await asyncio.sleep(0)
    with pytest.raises(CountingBusy) as shed:  # 1.5 s ahead of it: shed, not queued
        await slots.acquire(1_000_000)
    assert shed.value.retry_after_s == pytest.approx(1.5)
    assert "counting" in shed.value.message
    assert (slots.waiting, slots.shed) == (2, 1)
    for slot in held:
        slots.release(slot, seconds=None)
    for task in (waiting, more):
        slots.release(await task, seconds=None)
    assert (slots.running, slots.waiting) == (0, 0)


async def test_no_wait_allowed_sheds_every_count_beyond_the_slots() -> None:
    slots = CountingSlots(1, max_wait_s=0)
    held = await slots.acquire(5000)
    with pytest.raises(CountingBusy) as shed:
        await slots.acquire(5000)
    assert shed.value.retry_after_s >= 0.5  # never an immediate retry
    slots.release(held, seconds=None)
    slots.release(await slots.acquire(5000), seconds=None)  # free again


async def test_a_count_that_waited_its_whole_bound_is_shed_and_leaves_the_line() -> None:
    slots = CountingSlots(1, max_wait_s=0.05, seconds_per_char=1e-9)
    held = await slots.acquire(5000)
    with pytest.raises(CountingBusy):
        await slots.acquire(5000)  # nothing releases the slot: the bound runs out
    assert (slots.waiting, slots.shed) == (0, 1)
    slots.release(held, seconds=None)
    assert slots.running == 0


async def test_a_cancelled_waiter_gives_up_its_place_and_never_holds_a_slot() -> None:
    slots = CountingSlots(1, max_wait_s=60)
    held = await slots.acquire(5000)
    gone = asyncio.ensure_future(slots.acquire(5000))
    stays = asyncio.ensure_future(slots.acquire(5000))
    await asyncio.sleep(0)
    gone.cancel()
    slots.release(held, seconds=None)  # the cancelled one is skipped, the next one served
    slot = await stays
    assert gone.cancelled() and (slots.running, slots.waiting) == (1, 0)
    slots.release(slot, seconds=None)
    assert slots.running == 0


async def test_the_cost_per_character_is_learned_from_the_counts() -> None:
    slots = CountingSlots(1, seconds_per_char=1e-6)
    for _ in range(30):
        slots.release(await slots.acquire(100_000), seconds=0.01)  # 0.1 us a character
    assert slots.seconds_per_char == pytest.approx(1e-7, rel=0.05)


@pytest.mark.parametrize(("cores", "slots"), [(1.0, 1), (1.5, 1), (2.0, 1), (3.0, 2), (64.0, 4)])
def test_default_slots_leave_a_core_to_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, cores: float, slots: int
) -> None:
    monkeypatch.setattr("sidecar.cgroup.cpu_limit_cores", lambda: cores)
    assert default_slots() == slots


def test_the_settings_take_the_counting_flags() -> None:
    flags = ["--max-concurrent-counts", "2", "--max-count-wait", "0"]
    settings = Settings(_cli_parse_args=flags)  # type: ignore[call-arg]
    assert (settings.max_concurrent_counts, settings.max_count_wait) == (2, 0.0)
    defaults = Settings(_cli_parse_args=[])  # type: ignore[call-arg]
    assert (defaults.max_concurrent_counts, defaults.max_count_wait) == (None, 10.0)


def test_slots_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        CountingSlots(0)
    with pytest.raises(ValueError):
        CountingSlots(1, max_wait_s=-1)


# --- the tokenizer and the counter -----------------------------------------------------------


def test_a_long_text_is_tokenized_with_the_gil_released(tiny_tokenizer: ModelTokenizer) -> None:
    """While a worker thread tokenizes a long text, another Python thread keeps running.

    The other thread wakes every millisecond until the tokenizer returns. With the GIL held for
    the whole tokenization (``encode``), it cannot run from the call to the return but for a
    wake-up or two at the edges; with the GIL released it wakes many times in a tokenization
    that takes a few tenths of a second, however loaded the machine.
    """
    text = prompt_of(150_000)  # a few tenths of a second to tokenize
    started, done = threading.Event(), threading.Event()
    wakeups: list[int] = []

    def other() -> None:
        started.wait()
        n = 0
        while not done.is_set():
            n += 1
            time.sleep(0.001)
        wakeups.append(n)

    def worker() -> None:
        started.set()
        tiny_tokenizer.encode_text(text, add_special_tokens=True)
        done.set()

    threads = [threading.Thread(target=other), threading.Thread(target=worker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert wakeups and wakeups[0] >= 10, wakeups
    # and the ids are those of the GIL-holding call
    text = prompt_of(5000, salt=3) + " the cache block"
    assert tiny_tokenizer.encode_text(text, add_special_tokens=True) == (
        tiny_tokenizer._backend.encode(text, add_special_tokens=True).ids
    )


def test_threads_share_one_tokenizer_and_get_the_ids_of_one_at_a_time(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    """Every thread encodes with the one Rust tokenizer at once, long texts (the GIL released)
    and short ones (held) mixed: no error, and each text's ids are those counted alone."""
    texts = [prompt_of(n, salt=i) for i, n in enumerate((30_000, 40_000, 60, 25_000, 90))]
    alone = [tiny_tokenizer.encode_text(t, add_special_tokens=True) for t in texts]
    failures: list[object] = []
    barrier = threading.Barrier(4)

    def worker(k: int) -> None:
        barrier.wait()
        for r in range(5):
            for i in range(len(texts)):
                j = (i + k + r) % len(texts)
                try:
                    if tiny_tokenizer.encode_text(texts[j], add_special_tokens=True) != alone[j]:
                        failures.append(("ids", j))
                except Exception as exc:
                    failures.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failures == []
    assert not hasattr(tiny_tokenizer, "_pool")  # one tokenizer, no copies


async def test_long_counts_beyond_the_cap_are_shed_short_ones_never_wait(
    tiny_tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    threads: list[int] = []
    encode = ModelTokenizer.encode_text

    def gated(self: ModelTokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
        if len(text) > 2000:
            threads.append(threading.get_ident())
            gate.wait(30)
        return encode(self, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(ModelTokenizer, "encode_text", gated)
    counter = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=tiny_tokenizer,
        max_concurrent_counts=1,
        max_count_wait_s=0,
    )
    try:
        long_body = {"prompt": prompt_of(5000)}
        first = asyncio.ensure_future(counter.count("completions", long_body))
        await eventually(lambda: counter.slots.running == 1, "the first long count runs", 10)
        with pytest.raises(CountingBusy) as shed:
            await counter.count("completions", {"prompt": prompt_of(5000, salt=1)})
        assert shed.value.retry_after_s > 0
        # a short prompt is counted at once, on the loop, slot or no slot
        short = await counter.count("completions", {"prompt": "a layer value"})
        assert short.prompts == (3,) and counter.slots.running == 1
        gate.set()
        count = await first
        assert count.prompts == (5000,) and count.method is CountMethod.LOCAL
        assert threads and threading.get_ident() not in threads  # counted off the loop
        await eventually(lambda: counter.slots.running == 0, "the slot is given back", 10)
    finally:
        gate.set()
        counter.close()


async def test_a_long_count_whose_request_left_keeps_its_slot_until_the_thread_ends(
    tiny_tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    encode = ModelTokenizer.encode_text

    def gated(self: ModelTokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
        gate.wait(30)
        return encode(self, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(ModelTokenizer, "encode_text", gated)
    counter = PromptCounter(
        client=None,
        upstream=None,
        served_model=None,
        tokenizer_path=None,
        tokenizer=tiny_tokenizer,
        max_concurrent_counts=1,
    )
    try:
        task = asyncio.ensure_future(counter.count("completions", {"prompt": prompt_of(5000)}))
        await eventually(lambda: counter.slots.running == 1, "the long count runs", 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert counter.slots.running == 1  # the thread is still tokenizing: its slot is taken
        gate.set()
        await eventually(lambda: counter.slots.running == 0, "released at the thread's end", 10)
    finally:
        gate.set()
        counter.close()


# --- through the sidecar ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The generated model's tokenizer and config: the sidecar counts locally, as in production."""
    return ensure_tokenizer_model()


@pytest.fixture
def upstream(server: FakeServer, model_dir: Path) -> FakeServer:
    """The shared module server (tests/support/fake_upstream.py, on this module's model
    directory) with a fresh fake whose context and pool fit every long prompt."""
    fake = FakeVllm(model_root=model_dir, max_model_len=200_000)
    fake.num_gpu_blocks = 100_000  # room for every long prompt: only counting limits them
    return serve_fresh(server, fake)


@pytest.fixture
async def stack(upstream: FakeServer) -> AsyncIterator[Stack]:
    async with run_sidecar(upstream) as s:
        assert s.sidecar.counter is not None and s.sidecar.counter.local_available
        yield s


def long_request(tokens: int, salt: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt_of(tokens, salt),
        "add_special_tokens": False,  # counted alike by the tokenizer and the fake's /tokenize
        "max_tokens": 4,
        **extra,
    }


async def test_a_flood_beyond_the_counting_cap_gets_429_counting_busy_and_the_rest_completes(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = stack.sidecar.counter
    assert counter is not None
    counter.slots = CountingSlots(1, max_wait_s=0)  # what --max-concurrent-counts 1 sets
    gate = threading.Event()
    encode = ModelTokenizer.encode_text

    def gated(self: ModelTokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
        if len(text) > 2000:
            gate.wait(30)  # the first long count holds its slot until the flood has arrived
        return encode(self, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(ModelTokenizer, "encode_text", gated)
    try:
        first = asyncio.ensure_future(
            stack.client.post("/v1/completions", json=long_request(20_000, 0))
        )
        await eventually(lambda: counter.slots.running == 1, "the first long count runs", 10)
        flood = await asyncio.gather(
            *(
                stack.client.post("/v1/completions", json=long_request(20_000, k))
                for k in range(1, 9)
            )
        )
    finally:
        gate.set()
    for resp in flood:
        error = openai_error(resp, 429, "counting_busy")
        assert error["type"] == "rate_limit_error" and "retry" in error["message"]
        assert retry_after(resp) > 0
    answer = await first
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 20_000
    assert stack.decisions("reject", "counting_busy") == 8
    assert stack.decisions("admit", "fits") == 1
    assert len(stack.fake.generations()) == 1  # nothing shed reached vLLM
    # a shed client that honours Retry-After is served
    retry = await stack.client.post("/v1/completions", json=long_request(20_000, 1))
    assert retry.status_code == 200, retry.text
    await eventually(stack.ledger_empty, "every reservation released", 5)
    assert counter.slots.running == 0 and counter.slots.waiting == 0


async def test_long_prompts_within_the_bounded_wait_all_complete_in_turn(stack: Stack) -> None:
    counter = stack.sidecar.counter
    assert counter is not None
    counter.slots = CountingSlots(1, max_wait_s=60)
    answers = await asyncio.gather(
        *(stack.client.post("/v1/completions", json=long_request(10_000, k)) for k in range(6))
    )
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert all(a.json()["usage"]["prompt_tokens"] == 10_000 for a in answers)
    assert stack.decisions("reject", "counting_busy") == 0
    assert counter.slots.shed == 0 and counter.slots.running == 0


async def test_a_stream_keeps_flowing_while_a_long_prompt_is_counted(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's events arrive while the long count is in progress on its worker thread.

    Structure, not speed: the count's window is taken in its thread around the tokenizer call,
    and the stream's events are stamped as they arrive; some must fall inside the window. With
    the GIL held through the tokenization none could (every thread, the relay's loop, the fake
    vLLM's and this client's included, would be stopped for the whole of it).
    """
    windows: list[tuple[float, float, int]] = []
    encode = ModelTokenizer.encode_text

    def timed(self: ModelTokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
        t0 = time.perf_counter()
        ids = encode(self, text, add_special_tokens=add_special_tokens)
        if len(text) > 2000:
            windows.append((t0, time.perf_counter(), threading.get_ident()))
        return ids

    monkeypatch.setattr(ModelTokenizer, "encode_text", timed)
    stack.fake.token_delay = 0.005
    arrivals: list[float] = []

    async def stream() -> None:
        body = {**long_request(2, 9), "max_tokens": 400, "stream": True}
        async with stack.client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())

    streaming = asyncio.ensure_future(stream())
    await eventually(lambda: len(arrivals) >= 5, "the stream flows", 10)
    long = await stack.client.post("/v1/completions", json=long_request(150_000, 0, max_tokens=1))
    await streaming
    assert long.status_code == 200, long.text
    [(start, end, thread)] = windows
    assert thread != threading.get_ident()  # off the event loop
    inside = [t for t in arrivals if start < t < end]
    assert len(inside) >= 10, (end - start, len(inside), len(arrivals))
