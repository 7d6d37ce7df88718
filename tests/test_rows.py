"""The ledger's kept columns (sidecar/kv/rows.py) give exactly the peak that laying out every
trajectory gives (sidecar/kv/trajectory.py over Ledger.trajectories), through every change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kv.blocks import BlockMath
from sidecar.kv.geometry import KVGeometry, ModelKV, UniformBlocks
from sidecar.kv.ledger import Ledger, Reservation
from sidecar.kv.projection import project_counts
from sidecar.kv.trajectory import Trajectory, future_peak


@dataclass(frozen=True)
class Groups:
    """Block math with several KV-cache groups (a cap: a sliding-window group)."""

    block_size: int
    group_caps: tuple[int | None, ...]
    crossing_blocks: int = 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        pages = -(-num_tokens // self.block_size)
        return sum(pages if cap is None else min(pages, cap) for cap in self.group_caps)

    def blocks_held(self, num_tokens: int, prompt: int, *, started: bool) -> int:
        return self.blocks_for_tokens(num_tokens)

    def window_caps(self, prompt: Any, started: Any) -> tuple[int | None, ...]:
        return self.group_caps


def sliding(size: int) -> KVGeometry:
    """A sliding-window layer (a 24-token window) beside a full one, in blocks of ``size``."""
    cfg = {
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "sliding_window": 24,
        "torch_dtype": "bfloat16",
    }
    return KVGeometry.build(
        ModelKV.from_config(cfg),
        block_size=size,
        max_model_len=4096,
        max_num_batched_tokens=64,
        max_concurrent_batches=2,
    )


#: chain hashes: a prompt's full blocks are a prefix of one of these chains (shared prefixes)
CHAINS = [tuple(range(1000 * c, 1000 * c + 40)) for c in range(3)]

request = st.fixed_dictionaries(
    {
        "prompts": st.lists(st.integers(1, 300), min_size=1, max_size=3),
        "max_tokens": st.integers(1, 200),
        "end": st.integers(1, 200),
        "n": st.integers(1, 3),
        "chain": st.sampled_from([None, 0, 1, 2]),
        "generated": st.floats(0, 260),
        "state": st.sampled_from(["queued", "started", "released"]),
    }
)


def _reserve(ledger: Ledger, spec: dict, size: int, *, candidate: bool = False) -> Reservation:
    blocks = ledger.blocks
    p = project_counts(
        tuple(spec["prompts"]),
        requested_max_tokens=spec["max_tokens"],
        n=spec["n"],
        max_model_len=4096,
        blocks=blocks,
    )
    prefix = None
    if spec["chain"] is not None:
        prefix = tuple(CHAINS[spec["chain"]][: t // size] for t in spec["prompts"])
    ends = [min(spec["end"], m) for m in p.max_tokens]
    if candidate:
        return ledger.candidate(p, streamed=True, ends=ends, prefix=prefix)
    return ledger.reserve(p, streamed=True, ends=ends, prefix=prefix)


def _laid_out(ledger: Ledger, *extra: Reservation, worst_case: bool = False) -> int:
    return future_peak(ledger.trajectories(extra, worst_case=worst_case), ledger.blocks)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(request, max_size=10),
    st.lists(request, max_size=3),
    st.sampled_from([1, 4, 16]),
    st.sampled_from([(None,), (None, None), (None, 3), "sliding"]),
    st.booleans(),
)
def test_the_kept_columns_give_the_laid_out_peak(
    specs: list[dict],
    candidates: list[dict],
    size: int,
    caps: tuple[int | None, ...] | str,
    share: bool,
) -> None:
    blocks: BlockMath
    if caps == "sliding":  # a real geometry: a sequence's cap depends on its prompt and start
        blocks = sliding(size)
    else:
        blocks = UniformBlocks(size) if caps == (None,) else Groups(size, caps)
    ledger = Ledger(blocks, share_prefixes=share)
    held = []
    for spec in specs:
        res = _reserve(ledger, spec, size)
        held.append(res)
        # compare after every change too: the kept profile must follow it
        assert ledger.peak_with() == _laid_out(ledger)
        if spec["state"] != "queued":
            ledger.start(res)
            ledger.advance(res, spec["generated"])
        if spec["state"] == "released":
            ledger.release(res)
    cands = [_reserve(ledger, c, size, candidate=True) for c in candidates]
    shared_now = ledger.trajectories(started_only=True).shared_total() if share else 0
    assert ledger.shared_blocks_now() == shared_now
    assert ledger.started_sequences == sum(r.projection.sequences for r in ledger if r.started)
    for worst_case in (False, True):
        assert ledger.peak_with(worst_case=worst_case) == _laid_out(ledger, worst_case=worst_case)
        assert ledger.peak_with(*cands, worst_case=worst_case) == _laid_out(
            ledger, *cands, worst_case=worst_case
        )
    # and once more after everything in flight advances (one profile per ledger version)
    for res in held:
        ledger.advance(res, res.generated + 17)
    assert ledger.peak_with(*cands) == _laid_out(ledger, *cands)
    for res in held:
        ledger.release(res)
    assert ledger.peak_with() == 0
    assert len(ledger._rows) == 0


def test_the_profile_is_kept_until_the_ledger_changes() -> None:
    blocks = UniformBlocks(16)
    ledger = Ledger(blocks)
    p = project_counts((64,), requested_max_tokens=64, n=1, max_model_len=1024, blocks=blocks)
    r = ledger.reserve(p, streamed=True)
    first = ledger.profile()
    assert ledger.profile() is first
    ledger.start(r)
    started = ledger.profile()
    assert started is not first
    ledger.advance(r, 0.5)  # not a whole token: no change to any trajectory
    assert ledger.profile() is started
    ledger.advance(r, 1.0)
    assert ledger.profile() is not started


@settings(max_examples=300, deadline=None)
@given(
    st.lists(request, max_size=10),
    st.lists(request, max_size=3),
    st.sampled_from([1, 16]),
    st.sampled_from([None, 40, 150]),
    st.integers(5, 200),
)
def test_retry_columns_give_the_laid_out_slot(
    specs: list[dict], ahead: list[dict], size: int, likely: int | None, budget: int
) -> None:
    """Retry-After's columns from the kept rows: the same slot as the laid-out trajectories
    (without shared prefixes, where the two count alike; with them the kept rows count the
    queued requests' shared blocks only among themselves, an upper bound), with the requests
    admitted but not started yet laid out as starting now: ``started``, a twin ledger where
    vLLM has started them (fails where the kept rows lay them out as waiting, to start only
    when the refused request would)."""
    from sidecar.kv.ledger import likely_end
    from sidecar.kv.trajectory import steps_until_fits

    blocks = UniformBlocks(size)
    ledger = Ledger(blocks, share_prefixes=False)
    started = Ledger(blocks, share_prefixes=False)
    for spec in specs:
        res = _reserve(ledger, spec, size)
        twin = _reserve(started, spec, size)
        started.start(twin)
        if spec["state"] != "queued":
            ledger.start(res)
            ledger.advance(res, spec["generated"])
            started.advance(twin, spec["generated"])
        if spec["state"] == "released":
            ledger.release(res)
            started.release(twin)
    queued = [_reserve(ledger, c, size, candidate=True) for c in ahead]
    cand = (
        _reserve(
            ledger, {**specs[0], "state": "queued"} if specs else ahead[0], size, candidate=True
        )
        if specs or ahead
        else None
    )
    if cand is None:
        return
    rule = (lambda klass: likely) if likely is not None else None
    ends = likely_end(rule) if rule is not None else None
    own = ledger.trajectories([cand], in_flight=False, likely_end=ends)
    laid_out = started.trajectories(queued, likely_end=ends)
    kept = ledger.retry_columns(queued, rule)

    def rows(columns) -> list[tuple[int, ...]]:
        held, left, weight, wshared, prompt, end, w_weight, w_wshared = columns.arrays()
        started = sorted(zip(held, left, columns.gone, weight, wshared, strict=True))
        waiting = sorted(zip(prompt, end, w_weight, w_wshared, strict=True))
        return [tuple(int(x) for x in r) for r in started + waiting]

    assert rows(kept) == rows(laid_out)
    assert steps_until_fits(kept, own, budget, blocks) == steps_until_fits(
        laid_out, own, budget, blocks
    )


trajectory = st.builds(
    Trajectory,
    prompt_tokens=st.integers(0, 300),
    generated=st.integers(0, 200),
    end=st.integers(0, 200),
    started=st.booleans(),
    sequences=st.integers(1, 3),
    shared_blocks=st.integers(0, 2),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(trajectory, max_size=12),
    st.lists(trajectory, min_size=1, max_size=2),
    st.sampled_from([1, 4, 16]),
    st.integers(0, 120),
)
def test_starts_passed_over_by_their_demand_at_the_start_could_not_fit(
    others: list[Trajectory], candidate: list[Trajectory], size: int, budget: int
) -> None:
    """steps_until_fits skips, for full attention, the starts where the demand at the start
    alone is over the budget: the slot is the one a search that lays out every start finds
    (the same geometry with a cap no request reaches takes that path)."""
    from sidecar.kv.trajectory import steps_until_fits

    unstarted = [Trajectory(c.prompt_tokens, 0, c.end, False, c.sequences) for c in candidate]
    pruned = steps_until_fits(others, unstarted, budget, UniformBlocks(size))
    plain = steps_until_fits(others, unstarted, budget, Groups(size, (10**9,)))
    assert pruned == plain


def test_retry_columns_take_the_likely_end() -> None:
    """A started answer of its class's likely length 40 that has 50 tokens is taken to end at
    twice that (100), within its reserved 180; one of another class with no likely length runs
    to its reserved end; one admitted but not started by vLLM yet is laid out as starting now,
    to end at its class's likely length (40), never as waiting for the refused request's start."""
    blocks = UniformBlocks(16)
    ledger = Ledger(blocks, share_prefixes=False)
    p = project_counts((100,), requested_max_tokens=200, n=1, max_model_len=4096, blocks=blocks)
    past = ledger.reserve(p, streamed=True, ends=[180], klass="chat")
    ledger.start(past)
    ledger.advance(past, 50)
    unknown = ledger.reserve(p, streamed=True, ends=[180], klass="new")
    ledger.start(unknown)
    ledger.advance(unknown, 10)
    ledger.reserve(p, streamed=True, ends=[180], klass="chat")  # admitted, not started yet
    kept = ledger.retry_columns([], {"chat": 40}.get)
    held, left, *_, prompt, end, _, _ = kept.arrays()
    assert sorted(zip(held.tolist(), left.tolist(), kept.gone.tolist(), strict=True)) == [
        (100, 180, 40),
        (110, 170, 170),
        (150, 130, 50),
    ]
    assert (prompt.tolist(), end.tolist()) == ([], [])


operation = st.one_of(
    st.tuples(st.just("add"), request),
    st.tuples(st.just("start"), st.integers(0, 20)),
    st.tuples(st.just("advance"), st.integers(0, 20), st.integers(1, 40)),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("build"), st.booleans()),
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(operation, max_size=30),
    st.lists(request, max_size=2),
    st.sampled_from([1, 4, 16]),
    st.sampled_from([(None,), (None, None)]),
    st.booleans(),
)
def test_the_kept_bounds_hold_the_peak_through_every_change(
    ops: list[tuple],
    candidates: list[dict],
    size: int,
    caps: tuple[int | None, ...],
    share: bool,
) -> None:
    """Between rebuilds (the profile is built only where an operation asks, as a decision or
    a scrape would), the bounds kept from the last build, coarse and fine, hold the exact
    peak, with and without candidates, in both modes: requests added, started, advanced (past
    their reserved end too) and released, prefixes shared, n > 1, several groups."""
    blocks = UniformBlocks(size) if caps == (None,) else Groups(size, caps)
    ledger = Ledger(blocks, share_prefixes=share)
    held: list[Reservation] = []
    cands = [_reserve(ledger, c, size, candidate=True) for c in candidates]
    for op in ops:
        if op[0] == "add":
            held.append(_reserve(ledger, op[1], size))
        elif op[0] == "build":
            ledger.peak_with(worst_case=op[1])
        elif held:
            res = held[op[1] % len(held)]
            if op[0] == "start":
                ledger.start(res)
            elif op[0] == "advance":
                ledger.advance(res, res.generated + op[2])
            else:
                ledger.release(res)
        for worst_case in (False, True):
            for extra in ((), tuple(cands)):
                exact = _laid_out(ledger, *extra, worst_case=worst_case)
                fine = ledger.peak_bounds(*extra, worst_case=worst_case)
                coarse = ledger.peak_bounds(*extra, worst_case=worst_case, coarse=True)
                assert fine[0] <= exact <= fine[1], (fine, exact)
                # the coarse bounds (no pass over the profile) hold it too, and the fine ones
                assert coarse[0] <= fine[0] and fine[1] <= coarse[1], (coarse, fine)


def test_a_decision_settled_by_the_bounds_rebuilds_nothing() -> None:
    """With the profile built, a request advancing a token leaves bounds one block apart at
    most, and a candidate far under (or far over) the budget is decided on them, the profile
    not rebuilt; one between them takes the exact peak."""
    blocks = UniformBlocks(16)
    ledger = Ledger(blocks)
    p = project_counts((160,), requested_max_tokens=160, n=1, max_model_len=4096, blocks=blocks)
    running = [ledger.reserve(p, streamed=True, ends=[100]) for _ in range(3)]
    for r in running:
        ledger.start(r)
    built = ledger.profile()
    exact = ledger.peak_with()
    ledger.advance(running[0], 16)
    least, most = ledger.peak_bounds()
    assert ledger._profiles[False][1] is built  # no rebuild
    assert most == exact + 1  # 16 tokens: a block more per sequence at most
    assert least == exact - 17  # it may end at once: its 17 blocks at its end (260 tokens)
    assert least <= ledger.peak_with() <= most
    ledger.advance(running[0], 101)  # past its reserved end (100): the end moves, no bound
    assert ledger.peak_bounds()[0] == ledger.peak_bounds()[1] == ledger.peak_with()


def _progress(res: Reservation) -> float:
    return int(res.generated) / max(max(res.projection.max_tokens), 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(request, max_size=12),
    st.integers(0, 40),
    st.booleans(),
)
def test_the_most_advanced_and_the_oldest_unstarted_are_read_off_the_columns(
    specs: list[dict], sequences: int, one_prompt: bool
) -> None:
    """What the reconcile takes as finished (vLLM runs fewer sequences than the ledger started)
    and as prefilling (it runs more): the started requests with the most of their max_tokens
    generated, the most first, and the unstarted ones in admission order, each list long
    enough to hold ``sequences`` sequences; the columns' answer (one prompt per request) and
    the fallback's (several) alike."""
    ledger = Ledger(UniformBlocks(16))
    for spec in specs:
        if one_prompt:
            spec = {**spec, "prompts": spec["prompts"][:1]}
        res = _reserve(ledger, spec, 16)
        if spec["state"] != "queued":
            ledger.start(res)
            ledger.advance(res, int(spec["generated"]))
        if spec["state"] == "released":
            ledger.release(res)
    started = [r for r in ledger if r.started]
    ranked = ledger.most_advanced(sequences)
    assert len({id(r) for r in ranked}) == len(ranked)
    assert all(r.started and not r.released for r in ranked)
    keys = [_progress(r) for r in ranked]
    assert keys == sorted(keys, reverse=True)
    # no started request left out is ahead of one taken
    left = [r for r in started if all(r is not t for t in ranked)]
    assert not left or not ranked or max(map(_progress, left)) <= keys[-1]
    held = sum(r.projection.sequences for r in ranked)
    assert held >= min(sequences, sum(r.projection.sequences for r in started))

    unstarted = [r for r in ledger if not r.started]
    oldest = ledger.oldest_unstarted(sequences)
    assert oldest == unstarted[: len(oldest)]
    held = sum(r.projection.sequences for r in oldest)
    assert held >= min(sequences, sum(r.projection.sequences for r in unstarted))
