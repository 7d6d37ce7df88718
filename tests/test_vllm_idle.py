"""``tests.support.vllm_idle``: a preemption count is read only from an idle vLLM (the fake here).

Every test that asserts vLLM's preemption count on a shared vLLM reads it through
``idle_preemptions``: a previous test's requests still running there would hold blocks that the
sidecar under test cannot count, and make a preemption that is not its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir
from tests.support.vllm_idle import idle_preemptions


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeVllm, FakeServer]]:
    app = FakeVllm(model_root=write_model_dir(tmp_path / "tiny"))
    with FakeServer(app) as server:
        yield app, server


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("running", 2, "2 running"),
        ("waiting", 1, "1 waiting"),
        ("kv_cache_usage", 0.25, "KV usage 0.250"),
    ],
)
def test_a_busy_vllm_fails_the_test_saying_what_it_still_had(
    fake: tuple[FakeVllm, FakeServer], field: str, value: float, shown: str
) -> None:
    app, server = fake
    setattr(app, field, value)
    with pytest.raises(AssertionError, match=f"not idle within 1.0s.*{shown}"):
        idle_preemptions(server.url, within=1.0, step=0.05)


def test_the_count_is_read_once_vllm_is_idle(fake: tuple[FakeVllm, FakeServer]) -> None:
    """Busy, preempting, then idle: the reading waits for idle, so it is the final count."""
    app, server = fake
    app.running, app.kv_cache_usage, app.preemptions_total = 3, 0.5, 4

    def settle() -> None:
        time.sleep(0.15)
        app.preemptions_total = 5
        time.sleep(0.15)
        app.running, app.kv_cache_usage = 0, 0.0

    settling = threading.Thread(target=settle)
    settling.start()
    try:
        t0 = time.monotonic()
        assert idle_preemptions(server.url, within=10.0, step=0.05) == 5
        assert time.monotonic() - t0 >= 0.3
    finally:
        settling.join()
