"""Relay workers (``--workers N``): several processes relay, one owner decides admission.

The fast tests run ``kv-sidecar serve --workers 2`` as a real process tree in front of the fake
vLLM (64 blocks of 128 tokens; a budget of 59 with the default 5 % headroom): requests spread
over the workers and are counted once, in one exposition; a burst over the budget never
over-admits; a killed worker's reservations are released at once and a new worker serves; SIGTERM
drains every worker and exits 0. The last test sends a burst that would overflow the real vLLM's
pool through two workers in worst-case mode and checks that vLLM never preempted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir
from harness.workload import Result, SidecarProcess, burst, make_prompts, metric_value
from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import Outcome, Reason
from sidecar.config import Settings
from sidecar.http.seams import Engine
from sidecar.http.workers import wire
from sidecar.http.workers.remote import OwnerLink
from sidecar.http.workers.supervisor import worker_count
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Reservation
from sidecar.kv.projection import project_counts
from sidecar.kv.trajectory import Trajectory, future_peak
from tests.conftest import VllmInfo
from tests.support.external import unless_external
from tests.support.owners import admission_owner
from tests.support.stepped import frozen_engine
from tests.support.vllm_idle import around_preemption, idle_preemptions, sampled
from tests.support.wait import eventually, until

#: a completions request the fake counts as 3 prompt tokens; with max_tokens 900 it may reach
#: 903 tokens: 8 blocks of 128, so that 7 fit the budget of 59 at once
LONG = {"model": "tiny", "prompt": "hello there friend", "max_tokens": 900, "stream": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def fake(model_dir: Path) -> Iterator[tuple[FakeVllm, FakeServer]]:
    app = FakeVllm(model_root=model_dir)
    with FakeServer(app) as server:
        yield app, server


@pytest.fixture
def sidecar(fake: tuple[FakeVllm, FakeServer]) -> Iterator[SidecarProcess]:
    _, server = fake
    sc = SidecarProcess(server.url, "--workers", "2", "--scrape-interval", "0.1").start(timeout=120)
    try:
        yield sc
    finally:
        sc.stop()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the owner's relay workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name is in parentheses and may hold spaces: the fields after it
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def worker_slots(log: str) -> dict[int, int]:
    """{pid: slot} from the owner's log."""
    return {
        int(pid): int(slot)
        for slot, pid in re.findall(r"relay worker (\d+) started \(pid (\d+)\)", log)
    }


def served_by(sc: SidecarProcess) -> dict[str, float]:
    text = sc.metrics()
    return {
        slot: metric_value(text, "kv_sidecar_relay_worker_requests_total", worker=slot) or 0.0
        for slot in ("0", "1")
    }


async def _many(url: str, bodies: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    """Each body on a connection of its own, all at once."""

    async def one(body: dict[str, Any]) -> tuple[int, bytes]:
        async with httpx.AsyncClient(timeout=60) as client:
            resp = await client.post(url + "/v1/completions", json=body)
            return resp.status_code, resp.content

    return list(await asyncio.gather(*(one(b) for b in bodies)))


# --- pure parts --------------------------------------------------------------------------------


def test_workers_is_a_flag_and_an_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(_cli_parse_args=["--workers", "1"]).workers == 1  # type: ignore[call-arg]
    assert Settings(_cli_parse_args=["--workers", "auto"]).workers == "auto"  # type: ignore[call-arg]
    monkeypatch.setenv("KV_SIDECAR_WORKERS", "3")
    assert Settings().workers == 3
    monkeypatch.setenv("KV_SIDECAR_WORKERS", "0")
    with pytest.raises(ValueError):
        Settings()


def test_worker_count_is_a_number_or_the_cpus_the_container_may_use() -> None:
    assert worker_count(1) == 1
    assert worker_count(4) == 4
    cpus = len(os.sched_getaffinity(0))
    assert 1 <= worker_count("auto") <= cpus
    # auto follows the cgroup quota, rounded up and capped by the CPUs; no quota: one process
    assert worker_count("auto", quota=lambda: 2.5, cpus=lambda: 8) == 3
    assert worker_count("auto", quota=lambda: 4.0, cpus=lambda: 2) == 2
    assert worker_count("auto", quota=lambda: None, cpus=lambda: 64) == 1
    assert Settings().workers == "auto"


@contextlib.asynccontextmanager
async def owner_and_links(count: int) -> AsyncIterator[tuple[AdmissionController, list[OwnerLink]]]:
    """An owner (budget 59 blocks of 128 tokens) and ``count`` workers' links to it, in this
    process, over the real Unix socket."""
    admission, owner = admission_owner(workers=count)
    private = tempfile.mkdtemp(prefix="kv-sidecar-test-")
    path = os.path.join(private, "owner.sock")
    await owner.start(path)
    links, readers = [], []
    try:
        for index in range(count):
            reader, writer = await asyncio.open_unix_connection(path)
            link = OwnerLink(wire.Channel(reader, writer), index=index)
            assert (await link.handshake())[1] == count
            readers.append(asyncio.ensure_future(link.run()))
            links.append(link)
        yield admission, links
    finally:
        for link in links:
            link.channel.close()
        for reading in readers:
            await reading
        await owner.stop()
        shutil.rmtree(private, ignore_errors=True)


#: 3 prompt tokens and max_tokens 900: 8 blocks of 128
EIGHT_BLOCKS = project_counts(
    (3,), requested_max_tokens=900, n=1, max_model_len=1024, blocks=UniformBlocks(128)
)


async def test_one_owner_admits_for_every_worker_and_frees_a_lost_workers_share() -> None:
    """Eight asks of 8 blocks from two workers against a budget of 59 admit seven and queue one,
    whichever link asked; when a link closes, its reservations and its queued ask are gone at
    once, and the other link's asks are admitted again."""
    assert EIGHT_BLOCKS.peak_blocks == 8
    async with owner_and_links(2) as (admission, links):
        asks = [
            asyncio.ensure_future(link.gate.wait(Ask(EIGHT_BLOCKS, streamed=True)))
            for _ in range(4)
            for link in links
        ]
        await asyncio.wait(asks, timeout=0.5)
        decided = [ask.result() for ask in asks if ask.done()]  # ask k came from links[k % 2]
        assert len(decided) == 7 and all(d.admitted for d in decided)
        assert admission.ledger.reserved_blocks == 56 and admission.queue_depth == 1
        queued = next(k for k, ask in enumerate(asks) if not ask.done())
        lost, kept = links[queued % 2], links[1 - queued % 2]
        # the link of the queued ask goes away: its three grants and its ask go with it
        lost.channel.close()
        for _ in range(100):
            if admission.in_flight == 4 and admission.queue_depth == 0:
                break
            await asyncio.sleep(0.01)
        assert admission.in_flight == 4 and admission.queue_depth == 0
        assert admission.ledger.reserved_blocks == 32
        # the kept link releases one of its own, and asks again: admitted at once
        mine = next(ask.result() for k, ask in enumerate(asks) if k % 2 != queued % 2)
        assert mine.reservation is not None
        kept.gate.release(mine.reservation)
        again = await asyncio.wait_for(kept.gate.wait(Ask(EIGHT_BLOCKS, streamed=True)), 5)
        assert again.admitted and admission.in_flight == 4


async def test_a_client_that_leaves_the_queue_cancels_its_ask_at_the_owner() -> None:
    async with owner_and_links(1) as (admission, (link,)):
        held = [await link.gate.wait(Ask(EIGHT_BLOCKS, streamed=True)) for _ in range(7)]
        assert all(d.admitted for d in held) and admission.ledger.reserved_blocks == 56
        gone = asyncio.Event()
        waiting = asyncio.ensure_future(link.gate.wait(Ask(EIGHT_BLOCKS, streamed=True), gone))
        for _ in range(100):
            if admission.queue_depth:
                break
            await asyncio.sleep(0.01)
        assert admission.queue_depth == 1
        gone.set()
        decision = await asyncio.wait_for(waiting, 5)
        assert decision.outcome is Outcome.CANCEL and decision.reservation is None
        assert admission.queue_depth == 0 and admission.in_flight == 7
        for d in held:
            assert d.reservation is not None
            link.gate.release(d.reservation)
        for _ in range(100):
            if not admission.in_flight:
                break
            await asyncio.sleep(0.01)
        assert admission.in_flight == 0 and admission.ledger.reserved_blocks == 0


#: 100 prompt tokens and max_tokens 700: 7 blocks of 128 at its end (the real-vLLM burst's requests)
SEVEN_BLOCKS = project_counts(
    (100,), requested_max_tokens=700, n=1, max_model_len=1024, blocks=UniformBlocks(128)
)
#: one sequence of 71 blocks: over the pool of 63, refused at once (a round trip to the owner)
TOO_LARGE = project_counts(
    (3,), requested_max_tokens=9_000, n=1, max_model_len=10_000, blocks=UniformBlocks(128)
)


async def test_lockstep_streams_on_two_workers_never_let_the_owner_over_admit() -> None:
    """Eight streams of 100 + 700 tokens, three relayed by one worker and five by the other,
    decode in lockstep (vLLM gives each running sequence one token per step) while two more
    asks wait. Each step reaches the owner from the first worker, then (a scrape re-evaluates
    the queue in between) from the second. Whenever the owner admits a waiting ask, the true
    future peak (all eight where the first worker's streams are, the admitted ones taken at
    their worst) must stay within the budget of 59 of vLLM's 63 usable blocks.

    The workers used to report progress only when a stream's block count changed: at every
    crossing the owner saw the second worker's streams a block (128 tokens) behind the first's
    and took them to end 128 steps later, their peaks to pass one by one. It admitted one at
    the crossing at 157 tokens (62 blocks at the true peak, over the budget) and the other at
    413 (64, one more than vLLM's pool: a preemption; a fresh-clone CI run saw vLLM preempt
    once behind two workers in worst-case mode)."""
    assert SEVEN_BLOCKS.peak_blocks == 7 and TOO_LARGE.peak_blocks > 59
    blocks = UniformBlocks(128)
    config = type("Config", (), {"blocks": blocks})()
    async with owner_and_links(2) as (admission, links):
        for link in links:  # a worker knows the engine's block size, as in the real worker
            link.engine = Engine(config=config, counter=None)  # type: ignore[arg-type]
        streams: dict[int, list[Reservation]] = {0: [], 1: []}
        for index, share in ((0, 3), (1, 5)):
            for _ in range(share):
                decision = await links[index].gate.wait(Ask(SEVEN_BLOCKS, streamed=True))
                assert decision.admitted and decision.reservation is not None
                streams[index].append(decision.reservation)
        waiting = [
            asyncio.ensure_future(links[0].gate.wait(Ask(SEVEN_BLOCKS, streamed=True)))
            for _ in range(2)
        ]
        await eventually(lambda: admission.queue_depth == 2, "two asks queued")
        budget = admission.budget_blocks()
        assert budget == 59 and admission.capacity_blocks == 63

        async def reported(index: int, generated: int) -> None:
            """Worker ``index``'s streams at ``generated`` tokens, as far as the owner has
            read them (a refused ask's answer comes after everything sent before it)."""
            link = links[index]
            for res in streams[index]:
                link.gate.started(res)
                link.gate.progressed(res, float(generated))
            refused = await link.gate.wait(Ask(TOO_LARGE, streamed=True))
            assert refused.reason is Reason.TOO_LARGE

        admitted_at: list[int] = []
        for k in range(1, 701):
            await reported(0, k)
            admission.pump()  # a scrape between the two workers' reports
            await reported(1, k)
            admission.pump()
            while len(admitted_at) < len(admission.ledger) - 8:
                admitted_at.append(k)
                true_peak = future_peak(
                    [Trajectory(100, k, 700, started=True, sequences=8)]
                    + [Trajectory(100, 0, 700, started=False)] * len(admitted_at),
                    blocks,
                )
                assert true_peak <= budget, (
                    f"admitted {len(admitted_at)} beside eight streams at {k} of 700 tokens: "
                    f"{true_peak} blocks at their peak, over the budget of {budget}"
                )
        # not over-cautious either: both fit once the eight are near their end
        assert len(admitted_at) == 2, admitted_at
        decided = [await asyncio.wait_for(ask, 5) for ask in waiting]
        for index, held in streams.items():
            for res in held:
                links[index].gate.release(res, 700)
        for decision in decided:
            assert decision.admitted and decision.reservation is not None
            links[0].gate.release(decision.reservation)
        await eventually(lambda: admission.in_flight == 0, "every reservation released")


# --- the process tree against the fake vLLM ---------------------------------------------------


def test_requests_spread_over_both_workers_and_are_counted_once(
    fake: tuple[FakeVllm, FakeServer], sidecar: SidecarProcess
) -> None:
    app, _ = fake
    app.token_delay = 0.01  # answers overlap: a busy worker leaves new connections to the other
    owner = sidecar.proc.pid if sidecar.proc is not None else 0
    assert len(children(owner)) == 2
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8}
    sent = 0
    deadline = time.monotonic() + 60
    while not all(served_by(sidecar).values()):
        assert time.monotonic() < deadline, served_by(sidecar)
        results = asyncio.run(_many(sidecar.url, [body] * 16))
        assert [status for status, _ in results] == [200] * 16
        sent += 16
        time.sleep(0.2)  # a report of the workers' metric events
    # bad input gets its OpenAI-shaped 400 in the workers, as in one process
    with httpx.Client(base_url=sidecar.url, timeout=10) as client:
        bad = client.post("/v1/completions", content=b"{bad")
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_json"
        assert client.get("/v1/models").status_code == 200  # pass-through too
        long = client.post("/v1/completions", json={"model": "tiny", "prompt": "w " * 1100})
        assert long.status_code == 400
        assert long.json()["error"]["code"] == "context_length_exceeded"
        many = {f"x-h{k}": "v" for k in range(120)}
        crowded = client.post("/v1/completions", json=body, headers=many)
        assert crowded.status_code == 431
        assert crowded.json()["error"]["code"] == "request_header_fields_too_large"

    def counted() -> bool:
        text = sidecar.metrics()
        return metric_value(text, "kv_sidecar_requests_total", decision="admit") == sent

    until(counted, what="every request counted")
    text = sidecar.metrics()
    # one exposition: each family once, the workers' events summed in it
    assert text.count("# TYPE kv_sidecar_requests_total counter") == 1
    assert text.count("# TYPE process_cpu_seconds_total counter") == 1
    assert metric_value(text, "kv_sidecar_requests_total", reason="bad_request") == 1
    assert metric_value(text, "kv_sidecar_requests_total", reason="prompt_too_long") == 1
    assert sum(served_by(sidecar).values()) == sent + 2
    assert metric_value(text, "kv_sidecar_relay_workers") == 2
    # no `_created` series in the owner's exposition, nor in the workers' prometheus_client
    assert "_created" not in text
    for pid in children(owner):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"PROMETHEUS_DISABLE_CREATED_SERIES=True" in environ
    assert (metric_value(text, "kv_sidecar_prompt_counts_total") or 0) >= sent
    assert (metric_value(text, "kv_sidecar_completion_tokens_total") or 0) == 8 * sent
    assert metric_value(text, "process_cpu_seconds_total")
    # every admitted request's decision timed once (the owner's round trip included)
    assert metric_value(text, "kv_sidecar_decision_seconds_count") == sent
    # the owner decides but never counts: it loads no tokenizer
    assert "prompt counting in the relay workers" in sidecar.log()


def test_a_burst_over_the_budget_spread_over_the_workers_never_over_admits(
    fake: tuple[FakeVllm, FakeServer], sidecar: SidecarProcess
) -> None:
    """20 streamed requests that may reach 8 blocks each (160 blocks) against a budget of 59:
    /state, sampled all along, never shows the future peak over the budget, nor more than 8 in
    flight, and the queue forms.

    Not the sum of their peaks (64 with 8 in flight): the owner admits on the trajectories,
    which may let an 8th in beside three that have generated a few tokens and four not started
    (59 at the first of their ends). But each answer here is at most 40 tokens into its 900, so
    at the first of their ends, 860 steps or more from now, every one in flight holds at least
    7 blocks (863 tokens), started or not: a 9th at once would be over the budget whatever
    their stages. (Workers used to report progress at block boundaries only, so the owner saw
    none of these answers pass their first token and never admitted an 8th.)"""
    app, _ = fake
    app.token_delay = 0.01
    samples: list[dict[str, Any]] = []
    done = threading.Event()

    def sample() -> None:
        with httpx.Client(timeout=10) as client:
            while not done.is_set():
                samples.append(client.get(sidecar.metrics_url + "/state").json())
                time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        bodies = [LONG | {"fake_len": 40, "prompt": f"hello there friend{k}"} for k in range(20)]
        results = asyncio.run(_many(sidecar.url, bodies))
        # the kernel may hand a whole burst's connections to one worker: again until both had some
        for _ in range(3):
            if all(served_by(sidecar).values()):
                break
            results = asyncio.run(_many(sidecar.url, bodies))
    finally:
        done.set()
        sampler.join()
    assert [status for status, _ in results] == [200] * 20
    assert all(b"[DONE]" in content for _, content in results)
    budget = samples[0]["budget_blocks"]
    assert budget == 59
    assert max(s["future_peak_blocks"] for s in samples) <= budget
    assert max(s["in_flight"] for s in samples) <= budget // 7
    assert max(s["queue_depth"] for s in samples) > 0
    assert all(served_by(sidecar).values()), served_by(sidecar)
    state = until(lambda: (s := sidecar.state())["in_flight"] == 0 and s, what="ledger empty")
    assert state["reserved_blocks"] == 0


def test_a_killed_worker_releases_its_reservations_and_is_replaced(
    fake: tuple[FakeVllm, FakeServer], sidecar: SidecarProcess
) -> None:
    app, _ = fake
    app.token_delay = 0.05  # 400 tokens: 20 s, longer than the test
    assert sidecar.proc is not None
    owner = sidecar.proc.pid
    streams: list[int] = []  # per stream: 1 running, 0 ended, -1 failed
    stop = threading.Event()

    def stream(k: int) -> None:
        body = LONG | {"fake_len": 400, "prompt": f"hello there friend{k}"}
        try:
            with httpx.Client(timeout=60) as client:
                with client.stream("POST", sidecar.url + "/v1/completions", json=body) as resp:
                    for _ in resp.iter_lines():
                        if stop.is_set():
                            break
            streams[k] = 0
        except httpx.HTTPError:
            streams[k] = -1

    threads = []
    for k in range(6):
        streams.append(1)
        threads.append(threading.Thread(target=stream, args=(k,)))
        threads[-1].start()
    try:
        until(lambda: sidecar.state()["in_flight"] == 6, what="six streams admitted")
        until(lambda: sum(served_by(sidecar).values()) == 6, what="six reported")
        # the busier worker (the kernel may hand all six connections to one)
        counts = served_by(sidecar)
        slot = max(counts, key=lambda s: counts[s])
        slots = worker_slots(sidecar.log())
        victim = next(pid for pid in children(owner) if slots.get(pid) == int(slot))
        os.kill(victim, signal.SIGKILL)
        # the victim's streams fail, and their reservations go with its connection
        lost = int(counts[slot])
        until(lambda: streams.count(-1) == lost, what="the victim's clients cut off")
        until(
            lambda: sidecar.state()["in_flight"] == 6 - lost,
            what="the victim's reservations released",
        )
        assert streams.count(1) == 6 - lost  # the other worker's streams still run
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    state = until(lambda: (s := sidecar.state())["in_flight"] == 0 and s, what="ledger empty")
    assert state["reserved_blocks"] == 0 and state["queue_depth"] == 0
    assert f"(pid {victim}) disconnected: released {lost} reservations" in sidecar.log()
    assert f"(pid {victim}) exited" in sidecar.log()
    # a new worker took the slot, and serves
    until(lambda: len(children(owner)) == 2 and victim not in children(owner), what="respawn")
    until(
        lambda: metric_value(sidecar.metrics(), "kv_sidecar_relay_workers") == 2,
        "two relay workers reported",
    )
    sidecar.wait_ready()
    before = served_by(sidecar)[slot]
    app.token_delay = 0.01
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8}
    deadline = time.monotonic() + 60
    while served_by(sidecar)[slot] == before:
        assert time.monotonic() < deadline, "the new worker serves nothing"
        results = asyncio.run(_many(sidecar.url, [body] * 16))
        assert [status for status, _ in results] == [200] * 16
        time.sleep(0.2)


def test_sigterm_drains_every_worker_and_exits_zero(
    fake: tuple[FakeVllm, FakeServer], model_dir: Path
) -> None:
    app, server = fake
    app.token_delay = 0.02  # 60 tokens: 1.2 s
    sc = SidecarProcess(server.url, "--workers", "2", "--scrape-interval", "0.1").start(timeout=120)
    try:
        assert sc.proc is not None
        workers = children(sc.proc.pid)
        assert len(workers) == 2

        async def run() -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
            bodies = [LONG | {"fake_len": 60, "prompt": f"hello there friend{k}"} for k in range(4)]
            running = asyncio.ensure_future(_many(sc.url, bodies))
            async with httpx.AsyncClient(timeout=5) as client:
                deadline = time.monotonic() + 30
                while True:  # all four admitted
                    state = (await client.get(sc.metrics_url + "/state")).json()
                    if state["in_flight"] == 4:
                        break
                    assert not running.done(), f"the four ended before all were in flight: {state}"
                    assert time.monotonic() < deadline, f"never four in flight: {state}"
                    await asyncio.sleep(0.02)
                assert sc.proc is not None
                sc.proc.send_signal(signal.SIGTERM)
                # the owner decides every admission, so once it drains every worker refuses
                deadline = time.monotonic() + 10
                while (await client.get(sc.metrics_url + "/readyz")).status_code != 503:
                    assert time.monotonic() < deadline, "/readyz still 200 10 s after SIGTERM"
                    await asyncio.sleep(0.02)
            late = await _many(sc.url, [LONG | {"prompt": f"late {k}"} for k in range(8)])
            return await running, late

        first, late = asyncio.run(run())
        assert [status for status, _ in first] == [200] * 4
        assert all(b"[DONE]" in content for _, content in first)
        # new generation requests are refused in every worker while it drains
        assert [status for status, _ in late] == [503] * 8, late
        assert all(b'"draining"' in content for _, content in late)
        assert sc.proc.wait(timeout=60) == 0
        assert all(_exited(pid) for pid in workers)
        assert "drained" in sc.log()
    finally:
        sc.stop()


def test_workers_exit_when_they_lose_the_owner(fake: tuple[FakeVllm, FakeServer]) -> None:
    _, server = fake
    sc = SidecarProcess(server.url, "--workers", "2", "--scrape-interval", "0.1").start(timeout=120)
    try:
        assert sc.proc is not None
        workers = children(sc.proc.pid)
        assert len(workers) == 2
        sc.proc.kill()  # no drain, no goodbye: the workers see their connection close
        sc.proc.wait()

        def gone() -> bool:
            return all(_exited(pid) for pid in workers)

        until(gone, what="the workers to exit", within=30)
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sc.stop()


def _exited(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True


# --- the real vLLM ----------------------------------------------------------------------------


@pytest.mark.vllm
def test_a_burst_through_two_workers_never_makes_vllm_preempt(vllm: VllmInfo) -> None:
    """Streamed completions of 100 prompt tokens and 700 output tokens, four more than vLLM's
    pool holds at their ends (13 on the harness's 64 blocks of 128 tokens), sent at once
    through ``--workers 2`` in worst-case mode: straight to vLLM they would run out of KV
    blocks (the premise); through the sidecar vLLM does not preempt once.

    The burst is sent with vLLM's engine stopped (``frozen_engine``), so that the owner decides
    every request of it before any token is made, on any host: exactly as many as the budget
    holds at their peaks run, the rest queue (8 and 5 on the session vLLM), asserted at that
    instant; then the engine runs them all. The workers' counts reach the owner in their
    periodic reports, so they are awaited, then asserted exactly.

    The client asks for vLLM's continuous usage stats, so that the sidecar reads each stream's
    exact token count off its events (``UsageTracker.progress``). Counted one event a token,
    a stream whose tokens vLLM merged into fewer events (its reader behind, on a busy machine:
    672 events for 700 tokens) looks behind, the eight streams' peaks look staggered, and the
    owner admitted four of the queued beside them: vLLM preempted once in 1 of 14 runs here
    (and in a fresh-clone CI run). That is open: RELIABILITY.md, observation *Merged stream
    events*. Counted exactly, the streams are still seen behind vLLM by different amounts (a
    stall of a second, then one stream 591 tokens in where the others were 179): worst-case
    mode adds the lag their jumps show (``sidecar.kv.lag``); a CI run before it preempted twice
    with the usage stats on."""
    if vllm.model_dir is None:
        unless_external("needs the model's tokenizer to make prompts of an exact length")
    prompt_tokens, max_tokens = 100, 700
    exact = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if prompt_tokens + max_tokens > vllm.max_model_len:
        unless_external("the requests do not fit this vLLM's context")
    per_request = vllm.blocks_for(prompt_tokens + max_tokens)
    count = vllm.num_gpu_blocks // per_request + 4
    if count > 64:
        unless_external(f"vLLM's pool ({vllm.num_gpu_blocks} blocks) needs a larger burst")
    assert count * per_request > vllm.num_gpu_blocks, "the burst must overflow vLLM's pool"
    prompts = make_prompts(vllm.model_dir, count, prompt_tokens, seed=23)
    before = idle_preemptions(vllm.url)
    with SidecarProcess(
        vllm.url, "--workers", "2", "--reservation", "worst-case", "--max-queue-wait", "600"
    ) as sc:
        running = sc.state()["budget_blocks"] // per_request
        assert 1 <= running < count, sc.state()

        async def send() -> tuple[list[Result], dict[str, Any]]:
            with frozen_engine(vllm):
                sent = asyncio.ensure_future(
                    burst(sc.url, prompts, max_tokens=max_tokens, extra=exact)
                )
                # every request decided, none can end: what fits runs, the rest wait
                state = await asyncio.to_thread(
                    until,
                    lambda: (s := sc.state())["in_flight"] + s["queue_depth"] == count and s,
                    f"the burst of {count} decided with the engine stopped",
                    120.0,
                )
                assert not sent.done(), sent.result()
            return await sent, state

        with sampled(vllm.url) as readings:
            results, decided = asyncio.run(send())
        assert (decided["in_flight"], decided["queue_depth"]) == (running, count - running), decided
        assert [r.status for r in results] == [200] * count, [r.error for r in results]
        assert [r.completion_tokens for r in results] == [max_tokens] * count
        # every request decided once, as the workers report it (a report reaches the owner
        # after the answer): the queue the frozen burst formed, exactly
        until(
            lambda: sum(served_by(sc).values()) == count,
            f"the workers' reports of {count} requests",
            60.0,
        )
        text = sc.metrics()
        assert metric_value(text, "kv_sidecar_requests_total", reason="fits") == running, text
        queued = metric_value(text, "kv_sidecar_requests_total", reason="queued")
        assert queued == count - running, text
        assert sum(served_by(sc).values()) == count, served_by(sc)
    # a failure shows vLLM's counts around the first preemption, sampled every 0.1 s
    assert idle_preemptions(vllm.url) == before, around_preemption(readings)
