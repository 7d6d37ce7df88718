"""vLLM's preemption counter, read only once vLLM is idle: for every test that asserts a count.

The session's vLLM (``tests/conftest.py``) serves every test in turn. A test that asserts how
often vLLM preempted must read the counter while nothing else runs there: a previous test's
requests still decoding, or not yet aborted after their client went away, hold KV blocks that
the sidecar under test cannot count as its own, and a preemption they cause would count against
it. So :func:`idle_preemptions` waits until vLLM runs and queues nothing, its KV usage is back to
its floor (vLLM counts a cached block that no request holds as free: 0) and the counter has
stopped moving (vLLM publishes some counters a step late), and fails the test, saying what vLLM
still had, if that does not come within its deadline. (``harness.workload.vllm_preemptions``
waits too, but reads the counter anyway once its 30 s are up.)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from harness.exposition import metric_value


@dataclass(frozen=True)
class Reading:
    preemptions: float
    running: float
    waiting: float
    kv_usage: float

    def idle(self, kv_floor: float) -> bool:
        return self.running == 0 and self.waiting == 0 and self.kv_usage <= kv_floor


def read(url: str) -> Reading:
    """vLLM's counts from one scrape of its ``/metrics`` (summed over data-parallel engines)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return Reading(
        preemptions=metric_value(text, "vllm:num_preemptions_total") or 0.0,
        running=metric_value(text, "vllm:num_requests_running") or 0.0,
        waiting=metric_value(text, "vllm:num_requests_waiting") or 0.0,
        kv_usage=metric_value(text, "vllm:kv_cache_usage_perc") or 0.0,
    )


def idle_preemptions(
    url: str, *, within: float = 120.0, kv_floor: float = 0.0, step: float = 0.5
) -> float:
    """vLLM's preemption counter once two readings ``step`` s apart find it idle and the counter
    unchanged; fails the test after ``within`` s with the last reading."""
    deadline = time.monotonic() + within
    last = read(url)
    while True:
        time.sleep(step)
        now = read(url)
        if last.idle(kv_floor) and now.idle(kv_floor) and now.preemptions == last.preemptions:
            return now.preemptions
        assert time.monotonic() < deadline, (
            f"vLLM at {url} not idle within {within}s (a previous test's requests still there?): "
            f"{now.running:g} running, {now.waiting:g} waiting, KV usage {now.kv_usage:.3f} "
            f"(floor {kv_floor:g}), preemptions {last.preemptions:g} then {now.preemptions:g}"
        )
        last = now


@contextlib.contextmanager
def sampled(url: str, every: float = 0.1) -> Iterator[list[tuple[float, Reading]]]:
    """vLLM's counts read every ``every`` s on a thread while the block runs, as (seconds since
    the start, reading): what a failed preemption assertion shows (:func:`around_preemption`).
    A scrape that fails (the engine stopped, the machine busy) is skipped."""
    readings: list[tuple[float, Reading]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def run() -> None:
        while not stop.wait(every):
            with contextlib.suppress(httpx.HTTPError):
                readings.append((time.monotonic() - t0, read(url)))

    thread = threading.Thread(target=run, name="vllm-sampler", daemon=True)
    thread.start()
    try:
        yield readings
    finally:
        stop.set()
        thread.join(timeout=10)


def around_preemption(readings: list[tuple[float, Reading]], keep: int = 5) -> str:
    """The readings either side of the first one whose preemption counter moved, one a line
    (seconds, running, waiting, KV usage, preemptions); all of the most requests seen."""
    if not readings:
        return "no reading of vLLM's counts"
    first = readings[0][1].preemptions
    moved = next((i for i, (_, r) in enumerate(readings) if r.preemptions != first), None)
    most = max(r.running + r.waiting for _, r in readings)
    lines = [f"{len(readings)} readings; most requests in vLLM at once {most:g}"]
    if moved is None:
        lines.append("the preemption counter did not move while sampled")
        return "\n".join(lines)
    for at, r in readings[max(0, moved - keep) : moved + keep]:
        lines.append(
            f"{at:8.2f}s running {r.running:g} waiting {r.waiting:g} "
            f"KV {r.kv_usage:.3f} preemptions {r.preemptions:g}"
        )
    return "\n".join(lines)
