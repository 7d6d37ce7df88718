"""The ledger and the admission decision: future peak, shared prefixes, budget, queue, FIFO,
timeouts, Retry-After, learned lengths."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.admission.decisions import Outcome
from sidecar.engine.snapshot import EngineSnapshot
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.prefix import block_hashes
from sidecar.kv.projection import Projection, project_counts
from tests.support.snapshots import Clock, snapshot

BLOCKS = UniformBlocks(128)


def proj(prompt: int = 271, max_tokens: int = 700, n: int = 1) -> Projection:
    return project_counts(
        (prompt,), requested_max_tokens=max_tokens, n=n, max_model_len=1024, blocks=BLOCKS
    )


def controller(clock: Clock, **kw: object) -> AdmissionController:
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0, **kw)  # type: ignore[arg-type]
    ac.on_snapshot(snapshot(clock))
    return ac


def test_ledger_tracks_predicted_and_reserved() -> None:
    clock = Clock()
    ledger = Ledger(BLOCKS, clock=clock)
    p = proj()  # 271 + 700 tokens -> 3 prompt blocks, 8 at peak
    r = ledger.reserve(p, streamed=True)
    # admitted, not yet in vLLM: promised but not held
    assert (ledger.reserved_blocks, ledger.predicted_blocks, ledger.peak_blocks) == (8, 0, 8)
    ledger.start(r)
    assert ledger.predicted_blocks == 3
    ledger.advance(r, 300)  # 571 tokens -> 5 blocks
    assert ledger.predicted_blocks == 5
    ledger.advance(r, 100)  # progress never goes back
    assert ledger.predicted_blocks == 5
    clock.now += 4
    assert ledger.release(r) == 8 and ledger.release(r) == 0
    assert (ledger.reserved_blocks, ledger.predicted_blocks, len(ledger)) == (0, 0, 0)
    assert ledger.freed_blocks_per_second() == pytest.approx(8.0)
    assert ledger.mean_hold_seconds == 4


def test_expected_reservation_grows_when_the_answer_runs_long() -> None:
    ledger = Ledger(BLOCKS)
    p = proj()
    r = ledger.reserve(p, ends=(100,), streamed=True)  # 371 tokens: 3 blocks reserved
    assert r.reserved_blocks == 3
    ledger.start(r)
    ledger.advance(r, 650)  # 921 tokens -> 8 blocks > 3 reserved
    assert r.reserved_blocks == 8 and ledger.reserved_blocks == 8
    # past its expected end it is expected to run to twice what it has, up to max_tokens
    assert r.end(0) == 700


def test_worst_case_admits_until_the_budget_then_rejects() -> None:
    clock = Clock()
    ac = controller(clock, policy="reject")
    admitted = [ac.try_admit(Ask(proj(), streamed=True)) for _ in range(8)]
    assert [d.outcome for d in admitted if d] == [Outcome.ADMIT] * 7 + [Outcome.REJECT]  # 63 // 8
    refused = admitted[-1]
    assert refused is not None and refused.reason == "kv_cache_full"
    assert refused.retry_after is not None and 1 <= refused.retry_after <= 60
    # none has started: each may start at any moment and is counted at its peak
    assert ac.ledger.reserved_blocks == 56 == ac.future_peak_blocks()


def test_future_peak_admits_what_the_sum_of_peaks_would_queue() -> None:
    """Long answers at different stages never all peak at once: the oldest ends first."""
    clock = Clock()
    ac = controller(clock, policy="reject")
    running = [ac.try_admit(Ask(proj(prompt=100, max_tokens=900), streamed=True)) for _ in range(7)]
    for k, d in enumerate(running):  # started 100 tokens apart: 600, 500, ... 0 generated
        assert d is not None and d.reservation is not None
        ac.started(d.reservation)
        # seen there a token a report: no stream behind vLLM (tests/test_lag.py)
        ac.ledger.advance(d.reservation, 600 - 100 * k)
    assert ac.ledger.reserved_blocks == 7 * 8  # the sum of peaks: full
    assert ac.future_peak_blocks() < 63
    d = ac.try_admit(Ask(proj(prompt=100, max_tokens=900), streamed=True))
    assert d is not None and d.admitted
    # and what was admitted keeps to the budget whatever happens next
    assert ac.future_peak_blocks() <= ac.budget_blocks()  # type: ignore[operator]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 600), st.integers(1, 700), st.integers(0, 40), st.integers(1, 2)),
        min_size=1,
        max_size=25,
    )
)
def test_worst_case_mode_never_exceeds_the_budget_in_a_simulation(
    arrivals: list[tuple[int, int, int, int]],
) -> None:
    """Requests arrive over time; vLLM runs every admitted one a token per step to max_tokens.
    Whatever worst-case admission lets in never holds more blocks than the budget."""
    clock = Clock()
    ac = controller(clock, policy="reject")
    budget = ac.budget_blocks()
    assert budget is not None
    running: list[tuple[object, int]] = []  # (reservation, max_tokens)
    pending = sorted(arrivals, key=lambda a: a[2])
    step = 0
    while pending or running:
        while pending and pending[0][2] <= step:
            prompt, max_tokens, _, n = pending.pop(0)
            d = ac.try_admit(Ask(proj(prompt=prompt, max_tokens=max_tokens, n=n), streamed=True))
            if d is not None and d.admitted and d.reservation is not None:
                ac.started(d.reservation)
                running.append((d.reservation, d.reservation.projection.max_tokens[0]))
        held = sum(r.projection.blocks_at(int(r.generated), BLOCKS) for r, _ in running)  # type: ignore[attr-defined]
        assert held <= budget
        for res, end in list(running):
            if res.generated >= end:  # type: ignore[attr-defined]
                ac.release(res)  # type: ignore[arg-type]
                running.remove((res, end))
            else:
                ac.progressed(res, res.generated + 1)  # type: ignore[arg-type, attr-defined]
        step += 1


def test_shared_prompt_blocks_are_counted_once() -> None:
    clock = Clock()
    ac = controller(clock, policy="reject")
    system = block_hashes(list(range(700)), block_size=128)  # the 700-token prompt: 5 blocks
    p = proj(prompt=700, max_tokens=300)  # 6 prompt blocks, 8 at peak
    alone = [ac.try_admit(Ask(p, streamed=True)) for _ in range(8)]
    assert sum(1 for d in alone if d and d.admitted) == 7  # 7 x 8 <= 63
    shared = controller(clock, policy="reject")
    together = [shared.try_admit(Ask(p, streamed=True, prefix=(system,))) for _ in range(25)]
    # the first holds 8 blocks, each other 8 - 5 = 3: 8 + 3 x 18 <= 63
    assert sum(1 for d in together if d and d.admitted) == 1 + (63 - 8) // 3
    first = together[0]
    assert first is not None and first.reservation is not None
    shared.started(first.reservation)
    shared.started(together[1].reservation)  # type: ignore[union-attr, arg-type]
    assert shared.ledger.shared_blocks_now() == 5


def test_n_sequences_share_their_prompt_blocks() -> None:
    clock = Clock()
    ac = controller(clock, policy="reject")
    # 512 tokens: 4 full blocks, of which vLLM shares 3 (it recomputes the last token)
    prompt = block_hashes(list(range(512)), block_size=128)
    assert len(prompt) == 3
    d = ac.try_admit(Ask(proj(prompt=512, max_tokens=100, n=4), streamed=True, prefix=(prompt,)))
    assert d is not None and d.admitted
    # 4 sequences of 5 blocks, 3 prompt blocks held once: 5 + 3 x 2
    assert ac.future_peak_blocks() == 11


def test_headroom_and_external_usage_shrink_the_budget() -> None:
    clock = Clock()
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.5, policy="reject"
    )
    ac.on_snapshot(snapshot(clock))
    assert ac.budget_blocks() == 31
    assert (
        sum(1 for _ in range(5) if (d := ac.try_admit(Ask(proj(), streamed=True))) and d.admitted)
        == 3
    )
    # traffic that bypasses the sidecar: vLLM holds 40 blocks, the ledger none
    ac2 = controller(clock, policy="reject")
    ac2.on_snapshot(snapshot(clock, used=40))
    assert ac2.committed_blocks() >= 40
    results = [ac2.try_admit(Ask(proj(), streamed=True)) for _ in range(4)]
    assert sum(1 for d in results if d and d.admitted) == 2  # (63 - 40) // 8


def test_a_request_that_can_never_fit_is_refused_at_once() -> None:
    """One sequence over vLLM's whole pool: vLLM could never schedule it either."""
    clock = Clock()
    ac = controller(clock)
    ac.on_snapshot(snapshot(clock, blocks=8))  # vLLM's pool: 7 usable blocks
    d = ac.try_admit(Ask(proj(), streamed=True))  # 271 + 700 tokens: 8 blocks at its peak
    assert d is not None and d.reason == "too_large" and d.retry_after is None
    assert "can reach 8 KV blocks" in d.message and "holds 7 blocks" in d.message


async def test_a_request_whose_sequences_together_outgrow_the_pool_runs_alone() -> None:
    """8 sequences of 8 blocks at their peak (n = 8) on a pool of 63: each fits, so vLLM serves
    the request (each sample is a request of its own in its scheduler). In worst-case mode it
    is not refused as too large: it waits for an empty pool, as one over the budget does, then
    runs alone; adaptive mode, which reserves it by its expected ends, admits it beside others."""
    clock = Clock()
    ac = controller(clock, policy="queue", reservation="worst-case", max_queue_wait=5)
    first = ac.try_admit(Ask(proj(prompt=100, max_tokens=100), streamed=True))
    assert first is not None and first.admitted and first.reservation is not None
    big = Ask(proj(n=8), streamed=True)
    assert big.projection.peak_blocks == 64 and big.projection.sequence_peak_blocks == 8
    assert ac.try_admit(big) is None  # queued, not refused
    waiting = asyncio.create_task(ac.wait(big))
    await asyncio.sleep(0)
    assert not waiting.done()
    ac.release(first.reservation)
    d = await waiting
    assert d.admitted and d.reservation is not None
    assert ac.state().in_flight == 1
    # and nothing else beside it
    assert ac.try_admit(Ask(proj(prompt=10, max_tokens=10), streamed=True)) is None

    adaptive = controller(Clock(), policy="reject", reservation="adaptive")
    d = adaptive.try_admit(Ask(proj(n=8), streamed=True))
    assert d is not None and d.admitted, d


def test_a_request_over_the_budget_but_within_the_pool_runs_alone() -> None:
    """The headroom keeps a margin between requests; it must not refuse one that vLLM serves
    alone (a chat without max_tokens reaches the whole context, which a pool sized for one
    context holds but not 95% of it). It runs when nothing else does, and nothing joins it."""
    clock = Clock()
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.9)
    ac.on_snapshot(snapshot(clock))  # budget 6 of 63 blocks
    big = ac.try_admit(Ask(proj(), streamed=True))  # 8 blocks at its peak
    assert big is not None and big.admitted and big.reason == "fits"
    assert ac.try_admit(Ask(proj(), streamed=True)) is None  # queued, not refused
    small = proj(prompt=10, max_tokens=10)  # one block
    assert ac.try_admit(Ask(small, streamed=True)) is None  # behind the queued one
    # traffic beside the sidecar: vLLM holds blocks the ledger does not, the pool is not empty
    ac2 = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.9)
    ac2.on_snapshot(snapshot(clock, used=2))
    assert ac2.try_admit(Ask(proj(), streamed=True)) is None


async def test_queue_is_fifo_and_admits_on_release() -> None:
    clock = Clock()
    ac = controller(clock, policy="queue", max_queue_wait=5)
    running = [ac.try_admit(Ask(proj(), streamed=True)) for _ in range(7)]
    assert all(d and d.admitted for d in running)
    big = proj(prompt=500, max_tokens=520)  # 8 blocks
    small = proj(prompt=10, max_tokens=10)  # 1 block
    assert ac.try_admit(Ask(big, streamed=True)) is None
    order: list[str] = []

    async def wait(name: str, p: Projection) -> None:
        d = await ac.wait(Ask(p, streamed=True))
        order.append(f"{name}:{d.outcome.value}")

    t_big = asyncio.create_task(wait("big", big))
    await asyncio.sleep(0)
    # a small request arriving behind the big one must not overtake it, although 7 blocks are free
    assert ac.try_admit(Ask(small, streamed=True)) is None
    t_small = asyncio.create_task(wait("small", small))
    await asyncio.sleep(0)
    assert ac.queue_depth == 2 and order == []
    first = running[0]
    assert first is not None and first.reservation is not None
    ac.release(first.reservation)
    await asyncio.gather(t_big, t_small)
    assert order == ["big:admit", "small:admit"]
    assert ac.queue_depth == 0


async def test_queue_timeout_full_and_disconnect() -> None:
    clock = Clock()
    ac = controller(clock, policy="queue", max_queue_wait=0.05, max_queue_depth=1)
    for _ in range(7):
        ac.try_admit(Ask(proj(), streamed=True))
    assert ac.try_admit(Ask(proj(), streamed=True)) is None
    waiting = asyncio.create_task(ac.wait(Ask(proj(), streamed=True)))
    await asyncio.sleep(0)
    full = ac.try_admit(Ask(proj(), streamed=True))
    assert full is not None and full.reason == "queue_full"
    timed_out = await waiting
    assert timed_out.reason == "queue_timeout" and timed_out.retry_after is not None
    assert ac.queue_depth == 0
    gone = asyncio.Event()
    ac.max_queue_wait = 5
    task = asyncio.create_task(ac.wait(Ask(proj(), streamed=True), gone))
    await asyncio.sleep(0.01)
    gone.set()
    d = await task
    assert d.outcome is Outcome.CANCEL and ac.queue_depth == 0


def test_retry_after_falls_back_to_the_release_rate() -> None:
    """Before vLLM has generated anything there is no step time: the recent release rate."""
    clock = Clock()
    ac = controller(clock, policy="reject")
    decisions = [ac.try_admit(Ask(proj(), streamed=True)) for _ in range(7)]
    for d in decisions[:4]:  # 32 blocks freed over 6 s
        clock.now += 2
        assert d is not None and d.reservation is not None
        ac.release(d.reservation)
    ac.on_snapshot(snapshot(clock))
    for _ in range(4):
        ac.try_admit(Ask(proj(), streamed=True))
    refused = ac.try_admit(Ask(proj(), streamed=True))
    assert refused is not None and refused.reason == "kv_cache_full"
    # 56 committed + 8 needed - 63 budget = 1 block short, at 32 blocks / 6 s: the 1 s floor
    assert refused.retry_after == pytest.approx(1.0)
    clock.now += 100  # nothing released lately: half the smoothed hold time (EWMA of 2, 4, 6, 8 s)
    again = ac.try_admit(Ask(proj(), streamed=True))
    assert again is not None and again.retry_after == pytest.approx(4.096 / 2)


def test_retry_after_is_when_the_trajectories_make_room_and_spreads_a_burst() -> None:
    clock = Clock()
    ac = controller(clock, policy="reject")
    ac.on_snapshot(snapshot(clock, generated=0, running=1))
    running = [ac.try_admit(Ask(proj(prompt=100, max_tokens=924), streamed=True)) for _ in range(7)]
    for d in running:  # 7 blocks each now, 8 at their end in 224 steps
        assert d is not None and d.reservation is not None
        ac.started(d.reservation)
        ac.progressed(d.reservation, 700)
    clock.now += 1.0
    ac.on_snapshot(snapshot(clock, generated=7 * 50, running=7))  # 50 steps a second
    assert ac.pools[0].view.seconds_per_step == pytest.approx(0.02)
    big = proj(prompt=900, max_tokens=124, n=4)  # 32 blocks from its prefill: two never fit
    first = ac.try_admit(Ask(big, streamed=True))
    assert first is not None and first.reason == "kv_cache_full"
    # when the seven have ended, a little later: 10% and a quarter of a second
    assert first.retry_after == pytest.approx(224 * 0.02 * 1.1 + 0.25)
    second = ac.try_admit(Ask(big, streamed=True))
    assert second is not None and second.retry_after is not None
    # the first refused one is booked from then on: the next comes back when it has ended
    # (the first was booked at its Retry-After, 259 steps from now, and runs 124 steps)
    slot = round(first.retry_after / 0.02)
    assert second.retry_after == pytest.approx((slot + 124) * 0.02 * 1.1 + 0.25)
    assert ac.pools[0].retry.bookings == 2


def test_retry_after_expects_requests_in_flight_to_end_where_their_class_ends() -> None:
    """Seven chats without max_tokens hold the pool (each reserved to the end of the context);
    their class's answers have run 60-130 tokens. A refused request is told to come back when
    they will likely have ended (the class's upper quartile), not when their reservations would
    (the whole context): told that, a client came back long after the pool had emptied."""
    clock = Clock()
    ac = controller(clock, policy="reject")
    ac.on_snapshot(snapshot(clock, generated=0, running=1))
    chat = proj(prompt=100, max_tokens=None)  # the rest of the context: 924 tokens
    assert chat.max_tokens == (924,)

    generated = [0.0]

    def refused_after() -> float:
        running = [ac.try_admit(Ask(chat, streamed=True, klass="chat:none")) for _ in range(7)]
        for d in running:
            assert d is not None and d.reservation is not None
            ac.started(d.reservation)
            ac.progressed(d.reservation, 20)
        clock.now += 1.0
        generated[0] += 350
        ac.on_snapshot(snapshot(clock, generated=generated[0], running=7))  # 50 steps a second
        # the same request both times: its second refusal replaces its first booking
        refused = ac.try_admit(Ask(proj(prompt=900, max_tokens=124, n=4), streamed=True, key=1))
        assert refused is not None and refused.reason == "kv_cache_full"
        assert refused.retry_after is not None
        for d in running:
            assert d is not None and d.reservation is not None
            ac.release(d.reservation)  # no completion_tokens: nothing learned
        return refused.retry_after

    cold = refused_after()  # nothing learned yet: their reservations' end, 904 steps away
    assert cold == pytest.approx(904 * 0.02 * 1.1 + 0.25)
    for n in range(10):
        ac.learner.observe("chat:none", 60 + 7 * n)  # 60..123: upper quartile 109
    warm = refused_after()
    assert warm == pytest.approx((109 - 20) * 0.02 * 1.1 + 0.25)  # 89 steps: they have ended


def test_retry_after_from_every_class_while_a_class_is_cold_and_for_booked_requests() -> None:
    """A class with too few answers takes the likely length of every class's answers; and a
    refused request booked at its slot is taken to end at its own likely length, so the next
    refusal is slotted after that, not after the booked one's whole reservation."""
    clock = Clock()
    ac = controller(clock, policy="reject")
    ac.on_snapshot(snapshot(clock, generated=0, running=1))
    for n in range(8):  # another class's answers: 40..75, upper quartile 70
        ac.learner.observe("completions:1024", 40 + 5 * n)
    running = [
        ac.try_admit(Ask(proj(prompt=100, max_tokens=None), streamed=True, klass="chat:none"))
        for _ in range(7)
    ]
    for d in running:
        assert d is not None and d.reservation is not None
        ac.started(d.reservation)
        ac.progressed(d.reservation, 20)
    clock.now += 1.0
    ac.on_snapshot(snapshot(clock, generated=350, running=7))  # 50 steps a second
    big = proj(prompt=900, max_tokens=124, n=4)
    first = ac.try_admit(Ask(big, streamed=True, klass="completions:128", key=1))
    assert first is not None and first.retry_after is not None
    # the chats (no answers of their own) likely end at 70, 50 steps from now
    assert first.retry_after == pytest.approx(50 * 0.02 * 1.1 + 0.25)
    second = ac.try_admit(Ask(big, streamed=True, klass="completions:128", key=2))
    assert second is not None and second.retry_after is not None
    # the first, booked at its slot, likely ends 70 steps after it (not 124): the second after
    slot = round(first.retry_after / 0.02)
    assert second.retry_after == pytest.approx((slot + 70) * 0.02 * 1.1 + 0.25)


def test_a_retry_of_the_same_request_takes_its_own_slot_not_one_behind_it() -> None:
    """The same body refused again (a client honouring Retry-After, or nginx retrying) replaces
    its booking: it is told the same slot, not one behind itself; another request still queues
    behind it; and admitting it uses up its own booking, not another's."""
    clock = Clock()
    ac = controller(clock, policy="reject")
    ac.on_snapshot(snapshot(clock, generated=0, running=1))
    running = [ac.try_admit(Ask(proj(prompt=100, max_tokens=924), streamed=True)) for _ in range(7)]
    for d in running:
        assert d is not None and d.reservation is not None
        ac.started(d.reservation)
        ac.progressed(d.reservation, 700)
    clock.now += 1.0
    ac.on_snapshot(snapshot(clock, generated=7 * 50, running=7))
    big = proj(prompt=900, max_tokens=124, n=4)
    first = ac.try_admit(Ask(big, streamed=True, key=1))
    assert first is not None and first.retry_after is not None
    for _ in range(5):  # it comes back, and is refused again each time
        again = ac.try_admit(Ask(big, streamed=True, key=1))
        assert again is not None and again.retry_after == pytest.approx(first.retry_after)
    assert ac.pools[0].retry.bookings == 1
    other = ac.try_admit(Ask(big, streamed=True, key=2))
    assert other is not None and other.retry_after is not None
    assert other.retry_after > first.retry_after + 1.0  # behind the first, as before
    # without fingerprints the five retries had pushed each other back
    anonymous = [ac.try_admit(Ask(big, streamed=True)) for _ in range(2)]
    assert anonymous[1] is not None and anonymous[0] is not None
    assert anonymous[1].retry_after is not None and anonymous[0].retry_after is not None
    assert anonymous[1].retry_after > anonymous[0].retry_after
    assert ac.pools[0].retry.bookings == 4
    ac.pools[0].retry.admitted(1)
    assert ac.pools[0].retry.bookings == 3


def test_stale_metrics_open_and_closed() -> None:
    clock = Clock()
    ac = controller(clock, policy="reject", stale_after=5)
    ac.on_snapshot(snapshot(clock, used=60))  # vLLM says it is full, then goes quiet
    clock.now += 10
    d = ac.try_admit(Ask(proj(), streamed=True))
    assert d is not None and d.admitted and d.reason == "stale_open"
    # stale means "trust the ledger alone", not "admit everything"
    results = [ac.try_admit(Ask(proj(), streamed=True)) for _ in range(7)]
    assert sum(1 for r in results if r and r.admitted) == 6  # 7 x 8 blocks <= 63
    assert ac.ledger.reserved_blocks == 56
    closed = controller(clock, policy="reject", stale_after=5, stale_policy="closed")
    clock.now += 10
    d = closed.try_admit(Ask(proj(), streamed=True))
    assert d is not None and d.reason == "stale_closed" and not d.admitted


def test_non_streamed_progress_is_estimated_from_vllm_counters() -> None:
    clock = Clock()
    ac = controller(clock)
    ac.on_snapshot(snapshot(clock, generated=1000, running=2))
    d = ac.try_admit(Ask(proj(), streamed=False))
    assert d is not None and d.reservation is not None
    ac.started(d.reservation)  # the proxy starts non-streamed requests as it forwards them
    clock.now += 1
    ac.on_snapshot(snapshot(clock, generated=1600, running=2))  # 300 tokens per sequence
    assert d.reservation.generated == 300
    assert ac.ledger.predicted_blocks == 5  # ceil(571 / 128)
    # one that started half-way through the next interval gets half of its share
    late = ac.try_admit(Ask(proj(), streamed=False))
    assert late is not None and late.reservation is not None
    clock.now += 0.5
    ac.started(late.reservation)
    clock.now += 0.5
    ac.on_snapshot(snapshot(clock, generated=2000, running=2))  # 200 tokens per sequence
    assert d.reservation.generated == 500
    assert late.reservation.generated == 100
    # a streamed answer is advanced by its own events only (an estimate could run ahead)
    streamed = ac.try_admit(Ask(proj(), streamed=True))
    assert streamed is not None and streamed.reservation is not None
    ac.started(streamed.reservation)
    clock.now += 1
    ac.on_snapshot(snapshot(clock, generated=2600, running=3))
    assert streamed.reservation.generated == 0
    ac.progressed(streamed.reservation, 150)
    assert streamed.reservation.generated == 150


def test_a_release_with_the_answers_length_teaches_its_class() -> None:
    """What an answer ran to comes with its release (per sequence: n = 2 answers of 70 each
    are 140 completion tokens); a release without it (an answer cut short) teaches nothing."""
    clock = Clock()
    ac = controller(clock, reservation="expected")
    for _ in range(ac.learner.min_samples):
        d = ac.try_admit(Ask(proj(prompt=100, max_tokens=700, n=2), streamed=True, klass="c"))
        assert d is not None and d.reservation is not None
        ac.release(d.reservation, 140)
        ac.release(d.reservation, 9999)  # idempotent: learned once
        cut = ac.try_admit(Ask(proj(prompt=100), streamed=True, klass="c"))
        assert cut is not None and cut.reservation is not None
        ac.release(cut.reservation)
    assert ac.ends(proj(), "c") == (70,)
    assert ac.state().expected_output_tokens == {"c": 70}


def test_expected_mode_reserves_the_learned_length_per_class() -> None:
    clock = Clock()
    ac = controller(clock, reservation="expected")
    assert ac.ends(proj(), "chat:1024") == (700,)  # no answers yet: the prior, all of max_tokens
    for _ in range(ac.learner.min_samples):
        ac.learner.observe("chat:1024", 70)
    assert ac.ends(proj(), "chat:1024") == (70,)
    assert ac.ends(proj(), "completions:1024") == (700,)  # another class learns on its own
    ac.on_snapshot(snapshot(clock, preemptions=1))
    ac.on_snapshot(snapshot(clock, preemptions=3))
    assert ac.preemptions_seen == 3
    assert ac.ends(proj(), "chat:1024")[0] > 70  # tightened after vLLM preempted


def test_a_class_with_a_full_window_keeps_its_learned_length() -> None:
    """A long-served class (hundreds of answers) stays learned: the binomial bound's first term,
    0.05 ** n, is below the smallest float from 237 answers on, and the bound computed with it
    fell back to the prior (all of max_tokens) once a class had that many."""
    clock = Clock()
    ac = controller(clock, reservation="expected")
    for n in range(1, 513):
        ac.learner.observe("chat:1024", n % 100 + 1)  # 1..100, evenly
        learned = ac.learner.learned("chat:1024")
        assert (learned is None) == (n < ac.learner.min_samples), (n, learned)
    (end,) = ac.ends(proj(), "chat:1024")
    assert 95 <= end <= 100  # a bound on the 0.95 quantile: at or above it, not max_tokens


def test_expected_mode_starts_from_its_prior() -> None:
    clock = Clock()
    assert controller(clock, reservation="expected", expected_prior=0.1).ends(proj()) == (70,)
    assert controller(clock, reservation="expected").ends(proj()) == (700,)  # default: all
    assert controller(clock).ends(proj()) == (700,)  # worst case: always max_tokens


async def test_a_queued_request_is_sized_by_the_learned_length_when_it_starts() -> None:
    """The learned length can drop while a request waits: it is reserved at what it says then."""
    clock = Clock()
    ac = controller(clock, policy="queue", reservation="expected", max_queue_wait=5)
    running = [ac.try_admit(Ask(proj(prompt=500, max_tokens=500), streamed=True)) for _ in range(7)]
    assert all(d and d.admitted for d in running)  # 7 x 8 = 56 of 63 blocks, on the prior
    waiter = asyncio.create_task(ac.wait(Ask(proj(), streamed=True)))  # 8 blocks on the prior
    await asyncio.sleep(0)
    assert ac.queue_depth == 1
    for _ in range(ac.learner.min_samples):
        ac.learner.observe("", 50)  # answers use a tenth of max_tokens
    ac.pump()
    decision = await asyncio.wait_for(waiter, 1)
    assert decision.admitted and decision.reservation is not None
    assert decision.reservation.reserved_blocks == 3  # 271 + 50 tokens, not 8 blocks


def test_an_estimate_never_makes_a_request_unrunnable() -> None:
    clock = Clock()
    ac = AdmissionController(
        Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.9, policy="reject"
    )
    ac.on_snapshot(snapshot(clock))  # budget 6 blocks
    estimated = project_counts(
        (900,), requested_max_tokens=100, n=1, max_model_len=1024, blocks=BLOCKS, exact=False
    )
    d = ac.try_admit(Ask(estimated, streamed=True))
    assert d is not None and d.admitted  # 8 blocks by the estimate: it runs alone
    d2 = ac.try_admit(Ask(estimated, streamed=True))
    assert d2 is not None and not d2.admitted


def test_the_step_time_is_vllms_inter_token_latency() -> None:
    clock = Clock()
    ac = controller(clock)
    first = dataclasses.replace(
        snapshot(clock), inter_token_latency_sum=10.0, inter_token_latency_count=1000
    )
    ac.on_snapshot(first)
    assert ac.pools[0].view.seconds_per_step == pytest.approx(0.01)  # the mean since vLLM started
    clock.now += 1
    later = dataclasses.replace(
        snapshot(clock), inter_token_latency_sum=12.0, inter_token_latency_count=1100
    )
    ac.on_snapshot(later)  # 100 tokens in 2 s of latency: 0.02 s a step lately
    assert ac.pools[0].view.seconds_per_step == pytest.approx(0.7 * 0.01 + 0.3 * 0.02)


# --- data-parallel engines: one pool each -------------------------------------------------------


def dp_snapshot(clock: Clock, *, used: tuple[int, ...], blocks: int = 20) -> EngineSnapshot:
    """vLLM with one engine per entry of ``used``, each a pool of ``blocks``."""
    parts = tuple(
        dataclasses.replace(snapshot(clock, used=u, blocks=blocks), engine=str(k))
        for k, u in enumerate(used)
    )
    total = sum(used)
    return dataclasses.replace(
        snapshot(clock, blocks=blocks * len(used)),
        engines=len(used),
        kv_cache_usage=total / (len(used) * (blocks - 1)),
        per_engine=parts,
    )


def dp_controller(clock: Clock, engines: int = 2, **kw: object) -> AdmissionController:
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock, headroom=0.0, **kw)  # type: ignore[arg-type]
    ac.on_snapshot(dp_snapshot(clock, used=(0,) * engines))
    return ac


def test_each_engine_is_its_own_pool_and_a_request_goes_where_it_fits() -> None:
    """Two engines of 19 usable blocks: requests of 8 blocks at their peak go two to a pool,
    alternating (the most room first); then one of 4 blocks fits the summed room (6) but no
    single pool (3 each), and is refused, where one pool of 38 would have taken it."""
    clock = Clock()
    ac = dp_controller(clock, policy="reject")
    assert [p.engine for p in ac.pools] == ["0", "1"]
    assert ac.capacity_blocks == 38 and ac.budget_blocks() == 38
    engines = []
    for _ in range(4):
        d = ac.try_admit(Ask(proj(), streamed=True))
        assert d is not None and d.admitted and d.reservation is not None
        engines.append(d.reservation.engine)
    assert sorted(engines) == ["0", "0", "1", "1"]
    assert engines[0] != engines[1]  # spread: the emptier pool first
    # 16 of 19 in each pool: a 4-block request fits the 6 left in all but in neither pool
    small = proj(prompt=271, max_tokens=200)  # 471 tokens: 4 blocks
    assert small.peak_blocks == 4
    d = ac.try_admit(Ask(small, streamed=True))
    assert d is not None and not d.admitted
    # a 3-block one fits in either
    d = ac.try_admit(Ask(proj(prompt=271, max_tokens=100), streamed=True))
    assert d is not None and d.admitted
    state = ac.state()
    assert (state.reserved_blocks, state.in_flight) == (35, 5)


def test_a_request_larger_than_one_engines_pool_is_too_large() -> None:
    clock = Clock()
    ac = dp_controller(clock)
    ac.on_snapshot(dp_snapshot(clock, used=(0, 0), blocks=8))  # 7 usable blocks each
    d = ac.try_admit(Ask(proj(), streamed=True))  # one sequence of 8 blocks > 7, < 14
    assert d is not None and d.reason.value == "too_large"
    assert "per engine" in d.message


def test_a_clients_pin_is_kept_and_an_unpinnable_request_is_held_in_every_pool() -> None:
    clock = Clock()
    ac = dp_controller(clock, policy="reject")
    pinned = ac.try_admit(Ask(proj(), streamed=True, pin="1"))
    assert pinned is not None and pinned.reservation is not None
    assert pinned.reservation.engine == "1"
    # /v1/responses cannot be pinned: vLLM's coordinator may send it to either engine
    d = ac.try_admit(Ask(proj(), streamed=True, pinnable=False))
    assert d is not None and d.reservation is not None
    res = d.reservation
    assert len(res.shadows) == 1
    assert sorted(r.engine for r in (res, *res.shadows)) == ["0", "1"]
    assert [len(p.ledger) for p in ac.pools] == [1, 2]
    again = ac.try_admit(Ask(proj(), streamed=True, pin="1"))  # 24 > 19 in engine 1
    assert again is not None and not again.admitted
    free = ac.try_admit(Ask(proj(), streamed=True))  # goes where there is room
    assert free is not None and free.reservation is not None and free.reservation.engine == "0"
    # 16 of 19 in each: an unpinnable one of 3 blocks is held in both, one of 4 in neither
    d2 = ac.try_admit(Ask(proj(prompt=271, max_tokens=200), streamed=True, pinnable=False))
    assert d2 is not None and not d2.admitted
    d3 = ac.try_admit(Ask(proj(prompt=271, max_tokens=100), streamed=True, pinnable=False))
    assert d3 is not None and d3.reservation is not None and len(d3.reservation.shadows) == 1
    ac.release(d3.reservation)
    ac.started(res)
    ac.progressed(res, 100)
    assert res.shadows[0].generated == 100 and res.shadows[0].started
    ac.release(res)
    assert [len(p.ledger) for p in ac.pools] == [1, 1]
    assert ac.state().reserved_blocks == 16


def test_each_engines_usage_counts_against_its_own_pool() -> None:
    """What vLLM holds beyond the ledger on one engine does not block the other."""
    clock = Clock()
    ac = dp_controller(clock, policy="reject")
    ac.on_snapshot(dp_snapshot(clock, used=(15, 0)))  # engine 0 busy with bypassing traffic
    for _ in range(2):
        d = ac.try_admit(Ask(proj(), streamed=True))
        assert d is not None and d.reservation is not None and d.reservation.engine == "1"
    d = ac.try_admit(Ask(proj(), streamed=True))
    assert d is not None and not d.admitted
    assert d.retry_after is not None and d.retry_after >= 1.0
