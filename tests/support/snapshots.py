"""A clock the test sets by hand, and the engine snapshots the admission tests feed the controller.

>>> clock = Clock()
>>> snap = snapshot(clock, used=21, blocks=64, running=3)
>>> snap.taken_at, round(snap.kv_cache_usage * 63), snap.running
(1000.0, 21, 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from sidecar.engine.snapshot import EngineSnapshot


class Fed(Protocol):
    """What takes engine snapshots (the admission controller)."""

    def on_snapshot(self, snap: EngineSnapshot) -> None: ...


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
    block_size: int = 128,
) -> EngineSnapshot:
    capacity = blocks - 1
    return EngineSnapshot(
        taken_at=clock(),
        block_size=block_size,
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


def teach_costs(
    ac: Fed, clock: Clock, base: EngineSnapshot, *, per_token: float, running: int = 8
) -> None:
    """Teach ``ac`` an engine whose decode step takes 10 ms + ``per_token`` per sequence and
    whose prefill adds ``per_token`` per prompt token, with ``running`` sequences decoding
    (``base``: the engine's other figures): half the batch for a while (the line's base is told
    from its slope only where the batch varied), 256-token prompts finishing their prefill among
    the decode steps, then the full batch long enough for the smoothed decode step (weight 0.2 a
    scrape) to be its own."""
    prev = dataclasses.replace(base, taken_at=clock(), running=running)
    ac.on_snapshot(prev)
    for k in range(32):
        clock.now += 0.5
        batch = running // 2 + 1 if k < 16 and k % 2 else running
        step = 0.010 + per_token * batch
        tokens = 0.5 / step * batch
        prompts = 2 if k < 16 else 0
        prev = dataclasses.replace(
            prev,
            taken_at=clock(),
            running=batch,
            generation_tokens_total=prev.generation_tokens_total + tokens,
            inter_token_latency_sum=prev.inter_token_latency_sum + tokens * step,
            inter_token_latency_count=prev.inter_token_latency_count + tokens,
            prefill_seconds_sum=prev.prefill_seconds_sum + prompts * (step + per_token * 256),
            prefill_count=prev.prefill_count + prompts,
            prompt_tokens_sum=prev.prompt_tokens_sum + prompts * 256,
            prompt_tokens_total=prev.prompt_tokens_total + prompts * 256,
        )
        ac.on_snapshot(prev)
    ac.on_snapshot(dataclasses.replace(prev, running=0, taken_at=clock()))
