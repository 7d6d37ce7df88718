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

import time
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
