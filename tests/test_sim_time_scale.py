"""The simulated engine's time dilation (harness.sim_cost.StepClock, ``--sim-time-scale``,
``KV_SIDECAR_SIM_TIME_SCALE``): each step sleeps the time scale times its simulated cost, the
engine's CPU time between steps is hidden behind the previous step's wall time, and the lag is
counted in wall seconds. Pure: a fake clock, no vLLM."""

from __future__ import annotations

import argparse

import pytest

from harness import sim_vllm
from harness.sim_cost import ENV_TIME_SCALE, StepClock, parse_time_scale


class FakeTime:
    """A monotonic clock that moves only when slept on (or when the test moves it)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def clock(scale: float) -> tuple[StepClock, FakeTime]:
    t = FakeTime()
    return StepClock(scale, monotonic=t.monotonic, sleep=t.sleep), t


@pytest.mark.parametrize("scale", [1.0, 2.5, 10.0])
def test_each_step_sleeps_the_scale_times_its_cost(scale: float) -> None:
    c, t = clock(scale)
    for i, cost in enumerate((0.010, 0.020, 0.005)):
        arrived = t.now  # no CPU time between steps
        wall = c.pace(arrived, cost, busy=i > 0)  # the engine was idle before the first
        assert wall == pytest.approx(cost * scale)
        assert t.now == pytest.approx(arrived + cost * scale)
    assert sum(t.slept) == pytest.approx(0.035 * scale)
    assert c.cpu_lag_seconds == 0


def test_cpu_time_between_steps_hides_behind_the_previous_steps_wall_time() -> None:
    # at scale 10 a 10 ms step lasts 100 ms of wall time: 60 ms of the engine's own work after
    # it is hidden (the next step ends as if it had started when the previous one ended)
    c, t = clock(10.0)
    c.pace(t.now, 0.010, busy=False)
    end = t.now
    t.now += 0.060
    c.pace(t.now, 0.010, busy=True)
    assert t.now == pytest.approx(end + 0.100)
    assert c.cpu_lag_seconds == 0
    # the same 60 ms at scale 1 (a 10 ms wall step) is 50 ms of lag
    c1, t1 = clock(1.0)
    c1.pace(t1.now, 0.010, busy=False)
    end = t1.now
    t1.now += 0.060
    c1.pace(t1.now, 0.010, busy=True)
    assert t1.now == pytest.approx(end + 0.060)  # the step itself hid behind the wait
    assert c1.cpu_lag_seconds == pytest.approx(0.050)


def test_lag_is_counted_only_while_the_engine_was_busy() -> None:
    c, t = clock(2.0)
    c.pace(t.now, 0.010, busy=False)
    t.now += 5.0  # idle: waiting for the next request is nobody's lag
    c.pace(t.now, 0.010, busy=False)
    assert c.cpu_lag_seconds == 0
    t.now += 0.5  # busy, and the step took 0.5 s of CPU against a 20 ms wall step
    c.pace(t.now, 0.010, busy=True)
    assert c.cpu_lag_seconds == pytest.approx(0.5 - 0.020)


def test_the_scale_can_change_at_run_time() -> None:
    c, t = clock(1.0)
    c.set_time_scale("4")
    assert c.pace(t.now, 0.010, busy=True) == pytest.approx(0.040)
    with pytest.raises(ValueError):
        c.set_time_scale(0)
    assert c.time_scale == 4.0


@pytest.mark.parametrize(
    ("value", "scale"), [(None, 1.0), ("", 1.0), (" ", 1.0), ("10", 10.0), (0.5, 0.5)]
)
def test_parse_time_scale(value: str | float | None, scale: float) -> None:
    assert parse_time_scale(value) == scale


@pytest.mark.parametrize("value", ["0", "-1", "x", "inf", "nan"])
def test_parse_time_scale_refuses_what_cannot_pace_a_step(value: str) -> None:
    with pytest.raises(ValueError):
        parse_time_scale(value)


def parse(argv: list[str]) -> argparse.Namespace:
    args, _ = sim_vllm.parser().parse_known_args(["--model-config", "x.json", *argv])
    return args


def test_the_flag_sets_the_executors_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TIME_SCALE, raising=False)
    assert sim_vllm.sim_env(parse([]))[ENV_TIME_SCALE] == "1.0"
    assert sim_vllm.sim_env(parse(["--sim-time-scale", "12.5"]))[ENV_TIME_SCALE] == "12.5"
    # vLLM's own flags around it pass through untouched
    args, rest = sim_vllm.parser().parse_known_args(
        ["--model-config", "x.json", "-tp", "8", "--sim-time-scale=3", "--max-num-seqs", "256"]
    )
    assert args.sim_time_scale == 3.0
    assert rest == ["-tp", "8", "--max-num-seqs", "256"]


def test_the_environment_is_the_default_and_the_flag_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_TIME_SCALE, "7")
    assert sim_vllm.sim_env(parse([]))[ENV_TIME_SCALE] == "7.0"
    assert sim_vllm.sim_env(parse(["--sim-time-scale", "2"]))[ENV_TIME_SCALE] == "2.0"


def test_a_bad_scale_is_refused_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        parse(["--sim-time-scale", "0"])
    monkeypatch.setenv(ENV_TIME_SCALE, "fast")
    with pytest.raises(SystemExit):
        sim_vllm.main(["--model-config", "x.json"])
