"""A clock the test sets by hand, and the engine snapshots the admission tests feed the controller.

>>> clock = Clock()
>>> snap = snapshot(clock, used=21, blocks=64, running=3)
>>> snap.taken_at, round(snap.kv_cache_usage * 63), snap.running
(1000.0, 21, 3)
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.engine.snapshot import EngineSnapshot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snapshot(
    clock: Callable[[], float],
    *,
    used: int = 0,
    blocks: int = 64,
    preemptions: float = 0,
    generated: float = 0,
    running: int = 0,
) -> EngineSnapshot:
    capacity = blocks - 1
    return EngineSnapshot(
        taken_at=clock(),
        block_size=128,
        num_gpu_blocks=blocks,
        engines=1,
        kv_cache_usage=used / capacity,
        running=running,
        preemptions_total=preemptions,
        generation_tokens_total=generated,
        cache_dtype="auto",
        prefix_caching=True,
        kv_cache_memory_bytes=None,
        has_cache_config=True,
    )
