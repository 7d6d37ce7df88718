"""Future-peak demand against a step-by-step simulation of vLLM's allocation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kv.geometry import KVGeometry, ModelKV, UniformBlocks
from sidecar.kv.trajectory import Trajectory, demand_profile, future_peak, steps_until_fits

BLOCKS = UniformBlocks(16)


def simulate(trajectories: list[Trajectory], delays: list[int], blocks: UniformBlocks) -> int:
    """The most blocks held at once when every running sequence gains one token per step and an
    unstarted one starts after its delay; a sequence frees its blocks after its last step."""
    peak = 0
    horizon = max((t.remaining + d for t, d in zip(trajectories, delays, strict=True)), default=0)
    for step in range(horizon + 1):
        held = 0
        for traj, delay in zip(trajectories, delays, strict=True):
            if traj.started:
                if step <= traj.remaining:
                    tokens = traj.prompt_tokens + traj.generated + step
                    held += traj.sequences * (blocks.blocks_for_tokens(tokens) - traj.shared_blocks)
            elif delay <= step <= delay + traj.end:
                tokens = traj.prompt_tokens + step - delay
                held += traj.sequences * (blocks.blocks_for_tokens(tokens) - traj.shared_blocks)
        peak = max(peak, held)
    return peak


def sum_of_peaks(trajectories: list[Trajectory], blocks: UniformBlocks) -> int:
    return sum(
        t.sequences * (blocks.blocks_for_tokens(t.prompt_tokens + t.end) - t.shared_blocks)
        for t in trajectories
    )


trajectory = st.builds(
    lambda prompt, end, done, started, n: Trajectory(
        prompt_tokens=prompt,
        generated=min(done, end) if started else 0,
        end=end,
        started=started,
        sequences=n,
    ),
    st.integers(1, 200),
    st.integers(0, 120),
    st.integers(0, 120),
    st.booleans(),
    st.integers(1, 3),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(trajectory, max_size=8), st.data())
def test_no_schedule_exceeds_the_future_peak(trajectories: list[Trajectory], data) -> None:  # type: ignore[no-untyped-def]
    delays = [
        0 if t.started else data.draw(st.integers(0, 150), label="delay") for t in trajectories
    ]
    peak = future_peak(trajectories, BLOCKS)
    assert simulate(trajectories, delays, BLOCKS) <= peak <= sum_of_peaks(trajectories, BLOCKS)


@settings(max_examples=200, deadline=None)
@given(st.lists(trajectory, max_size=8))
def test_the_peak_is_reached_by_some_schedule(trajectories: list[Trajectory]) -> None:
    # the worst schedule: each unstarted sequence starts late enough to be at its peak when
    # the demand is highest, so the bound is exact, not merely safe
    steps, demand = demand_profile(trajectories, BLOCKS)
    at = int(steps[int(demand.argmax())])
    horizon = max((t.remaining for t in trajectories if t.started), default=0)
    at = horizon + max((t.end for t in trajectories), default=0) if at < 0 else at
    delays = [0 if t.started else max(0, at - t.end) for t in trajectories]
    assert simulate(trajectories, delays, BLOCKS) == future_peak(trajectories, BLOCKS)


def test_staggered_requests_need_less_than_their_peaks() -> None:
    # four long answers started 100 tokens apart: the sum of peaks counts each at 1,000 tokens
    running = [
        Trajectory(prompt_tokens=100, generated=g, end=900, started=True) for g in (300, 200, 100)
    ]
    candidate = Trajectory(prompt_tokens=100, generated=0, end=900, started=False)
    assert sum_of_peaks([*running, candidate], BLOCKS) == 4 * 63
    # the oldest ends (63 blocks) while the others hold 57, 50 and 44 blocks
    assert future_peak([*running, candidate], BLOCKS) == 63 + 57 + 50 + 44


def test_shared_prefix_blocks_count_once() -> None:
    owner = Trajectory(prompt_tokens=64, generated=0, end=16, started=False)
    sharer = Trajectory(prompt_tokens=64, generated=0, end=8, started=False, shared_blocks=4)
    assert future_peak([owner, sharer], BLOCKS) == 5 + 1


def test_sliding_window_groups_cap_the_blocks() -> None:
    geo = KVGeometry.build(
        ModelKV.from_config(
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 256,
                "torch_dtype": "bfloat16",
                "sliding_window": 64,
                "layer_types": ["sliding_attention", "full_attention"],
            }
        ),
        block_size=16,
        max_model_len=4096,
        max_num_batched_tokens=64,
        max_concurrent_batches=1,
    )
    lone = [Trajectory(prompt_tokens=2000, generated=0, end=1000, started=False)]
    assert future_peak(lone, geo) == geo.blocks_for_tokens(3000)


def test_steps_until_fits() -> None:
    running = [Trajectory(prompt_tokens=100, generated=0, end=412, started=True)]  # 32 blocks
    candidate = [Trajectory(prompt_tokens=100, generated=0, end=412, started=False)]
    assert steps_until_fits(running, candidate, 64, BLOCKS) == 0
    assert steps_until_fits(running, candidate, 40, BLOCKS) == 412  # when the first one ends
    assert steps_until_fits(running, candidate, 31, BLOCKS) is None  # never, not even alone


@settings(max_examples=300, deadline=None)
@given(st.lists(trajectory, max_size=12), st.sampled_from([1, 4, 16, 128]))
def test_the_fast_profile_equals_the_plain_one(trajectories: list[Trajectory], size: int) -> None:
    """Full attention takes the suffix-sum path; it must give the matrix path's figures."""
    from sidecar.kv.trajectory import Columns, _profile_matrix, _profile_uncapped

    shared = [
        Trajectory(t.prompt_tokens, t.generated, t.end, t.started, t.sequences, i % 2)
        for i, t in enumerate(trajectories)
    ]
    blocks = UniformBlocks(size)
    arrays = Columns(shared).arrays()
    fast_steps, fast = _profile_uncapped(arrays, size, 1)
    plain_steps, plain = _profile_matrix(arrays, blocks)
    assert fast_steps.tolist() == plain_steps.tolist()
    assert fast.tolist() == plain.tolist()


@settings(max_examples=400, deadline=None)
@given(
    st.lists(trajectory, max_size=14),
    st.sampled_from([16, 32]),
    st.sampled_from([16, 64, 100, 256]),
    st.sampled_from([None, ["sliding_attention", "full_attention"]]),
    st.sampled_from([16, 64, 2048]),
)
def test_the_capped_profile_equals_the_plain_one(
    trajectories: list[Trajectory],
    size: int,
    window: int,
    layer_types: list[str] | None,
    batched: int,
) -> None:
    """Sliding-window groups take the per-group split path; it must give the matrix path's
    figures, every sequence capped as ``KVGeometry.blocks_held`` caps it."""
    from sidecar.kv.trajectory import Columns, _profile_capped, _profile_matrix

    cfg: dict[str, object] = {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "torch_dtype": "bfloat16",
        "sliding_window": window,
    }
    if layer_types is not None:
        cfg["layer_types"] = layer_types
    geo = KVGeometry.build(
        ModelKV.from_config(cfg),
        block_size=size,
        max_model_len=8192,
        max_num_batched_tokens=batched,
        max_concurrent_batches=2,
    )
    shared = [
        Trajectory(t.prompt_tokens, t.generated, t.end, t.started, t.sequences, i % 2)
        for i, t in enumerate(trajectories)
    ]
    arrays = Columns(shared).arrays()
    fast_steps, fast = _profile_capped(arrays, geo)
    plain_steps, plain = _profile_matrix(arrays, geo)
    assert fast_steps.tolist() == plain_steps.tolist()
    assert fast.tolist() == plain.tolist()
