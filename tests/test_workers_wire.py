"""The relay workers' wire, in one process: the channel's frames, progress packed into one
``ProgressBatch`` per frame, the worker's gate sending every token, and the owner applying a
batch to its ledger. (The process tree is ``tests/test_workers.py``.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest

from sidecar.admission.ask import Ask
from sidecar.http.seams import Engine
from sidecar.http.workers import wire
from sidecar.http.workers.owner import WorkerLink
from sidecar.http.workers.remote import PROGRESS_WITHIN_S, OwnerLink
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Reservation
from sidecar.kv.projection import project_counts
from tests.support.owners import admission_owner


class _Recorder:
    """A channel that keeps what it is asked to send: messages, and progress as
    ``(reservation, tokens per sequence)``."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.within: list[float] = []
        self.closed = False

    def send(self, message: wire.Message, *, within: float = 0.0) -> None:
        self.sent.append(message)
        self.within.append(within)

    def progress(self, res: int, generated: float, *, within: float = 0.0) -> None:
        self.sent.append((res, generated))
        self.within.append(within)


class _Writer:
    """A stream writer that keeps the frames written, each as its messages with every
    ``ProgressBatch`` read back as its list of ``(reservation, tokens)``."""

    def __init__(self) -> None:
        self.frames: list[list[object]] = []

    def write(self, data: bytes) -> None:
        messages = pickle.loads(data[4:])
        self.frames.append(
            [list(m.items()) if isinstance(m, wire.ProgressBatch) else m for m in messages]
        )

    def is_closing(self) -> bool:
        return False


def test_a_progress_batch_carries_every_pair_in_order_and_refuses_a_broken_one() -> None:
    progress = {7: 1.0, 3: 2.5, 2**40: 300.0}
    batch = pickle.loads(pickle.dumps(wire.ProgressBatch.of(progress)))
    assert list(batch.items()) == list(progress.items())
    assert list(wire.ProgressBatch.of({}).items()) == []
    # 16 bytes a stream, however many: not a pickled object each
    assert len(batch.res) + len(batch.generated) == 16 * len(progress)
    for broken in (
        wire.ProgressBatch(batch.res, batch.generated[:8]),  # one count short
        wire.ProgressBatch(batch.res[:-1], batch.generated[:-1]),  # not whole numbers
    ):
        with pytest.raises(wire.ChannelClosed):
            list(broken.items())


async def test_progress_waits_for_its_frame_and_leaves_in_order() -> None:
    """Progress queued ``within`` a time leaves in a frame at most that late, or at once with
    the next message that may not wait, ahead of it; a reservation's later count replaces its
    earlier one in the same batch; progress after a message is a batch after it."""
    writer = _Writer()
    channel = wire.Channel(None, writer)  # type: ignore[arg-type]
    channel.progress(1, 1.0, within=0.05)
    channel.progress(2, 1.0, within=0.05)
    channel.progress(1, 2.0, within=0.05)  # the latest count, in the place of the first
    await asyncio.sleep(0)
    assert writer.frames == []  # waiting for more
    await asyncio.sleep(0.1)
    assert writer.frames == [[[(1, 2.0), (2, 1.0)]]]
    channel.progress(1, 3.0, within=0.05)
    channel.send(wire.Started(3), within=0.05)  # may wait too: the batch still goes before it
    channel.progress(3, 1.0, within=0.05)
    channel.send(wire.Release(1, 3))  # may not wait: everything queued goes now, in order
    channel.progress(2, 2.0, within=0.05)
    await asyncio.sleep(0)
    assert writer.frames[1:] == [
        [[(1, 3.0)], wire.Started(3), [(3, 1.0)], wire.Release(1, 3), [(2, 2.0)]]
    ]
    await asyncio.sleep(0.1)
    assert len(writer.frames) == 2  # the timer went with the frame


def test_progress_is_sent_for_every_token_and_the_start_and_release_once() -> None:
    """A streamed answer of 300 tokens after a 100-token prompt, event by event (each one seen
    twice, as a chunk that brings no new event): progress for every token, not only at the
    block boundaries (the owner times each request's end from it), the start once, and the
    release with the answer's length, each allowed to wait PROGRESS_WITHIN_S for its frame."""
    recorder = _Recorder()
    link = OwnerLink(recorder, index=0)  # type: ignore[arg-type]
    blocks = UniformBlocks(128)
    config = type("Config", (), {"blocks": blocks})()
    link.engine = Engine(config=config, counter=None)  # type: ignore[arg-type]
    projection = project_counts(
        (100,), requested_max_tokens=300, n=1, max_model_len=1024, blocks=blocks
    )
    res = Reservation(
        id=7,
        projection=projection,
        ends=(300,),
        reserved_blocks=4,
        predicted_blocks=0,
        streamed=True,
        admitted_at=0.0,
    )
    link.gate.granted(res)
    for k in range(1, 301):
        for _ in range(2):
            link.gate.started(res)
            link.gate.progressed(res, float(k))
    link.gate.release(res, 300)
    link.gate.release(res, 300)  # idempotent
    kinds = [type(m) for m in recorder.sent]
    assert kinds.count(wire.Started) == 1 and recorder.sent[0] == wire.Started(7)
    progressed = [m for m in recorder.sent if isinstance(m, tuple)]
    assert progressed == [(7, float(k)) for k in range(1, 301)]
    assert recorder.sent[-1] == wire.Release(7, 300)
    assert kinds.count(wire.Release) == 1
    assert set(recorder.within) == {PROGRESS_WITHIN_S}
    # the reservation itself is the owner's figures, never written by the gate
    assert (res.started, res.generated, res.released) == (False, 0.0, False)
    # n sequences: a whole token per sequence (events / n) makes a message
    res2 = dataclasses.replace(res, id=8)
    link.gate.granted(res2)
    for events in range(1, 7):
        link.gate.progressed(res2, events / 2)
    assert recorder.sent[-3:] == [(8, 1.0), (8, 2.0), (8, 3.0)]


def test_the_owner_applies_a_batch_to_each_reservation_named_as_one_message_each_would() -> None:
    """One ``ProgressBatch`` advances every reservation it names in the ledger, as many
    separate advances would (the ledger's totals and trajectories alike); numbers the worker
    no longer holds (released meanwhile) are skipped."""
    blocks = UniformBlocks(128)
    projection = project_counts(
        (100,), requested_max_tokens=700, n=1, max_model_len=1024, blocks=blocks
    )
    results = []
    for batched in (True, False):
        admission, owner = admission_owner(workers=1)
        link = WorkerLink(channel=_Recorder())  # type: ignore[arg-type]
        owner.links.add(link)
        for number in (1, 2, 3):
            decision = admission.try_admit(Ask(projection, streamed=True))
            assert decision is not None and decision.reservation is not None
            link.reservations[number] = decision.reservation
            admission.started(decision.reservation)
        counts = {1: 129.0, 3: 5.0, 99: 400.0}  # 99: released before the batch arrived
        if batched:
            owner._dispatch(link, wire.ProgressBatch.of(counts))
        else:
            for number, generated in counts.items():
                if (res := link.reservations.get(number)) is not None:
                    admission.progressed(res, generated)
        ledger = admission.ledger
        results.append(
            (
                [link.reservations[n].generated for n in (1, 2, 3)],
                ledger.predicted_blocks,
                ledger.reserved_blocks,
                ledger.peak_with(),
                ledger.version,
            )
        )
    assert results[0] == results[1]
    assert results[0][0] == [129.0, 0.0, 5.0]
    assert results[0][1] == 2 + 1 + 1  # 100 + 129 tokens hold 2 blocks; the others 1 each
