"""Parsing vLLM's /metrics text: real vLLM 0.32 captures, and hand-crafted variants."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sidecar.engine.snapshot import EngineSnapshot, MetricsParseError, parse_vllm_metrics

FIXTURES = Path(__file__).parent / "fixtures"
CAPTURES = FIXTURES / "vllm-0.32.0-cpu"
CRAFTED = FIXTURES / "metrics"


def parse(text: str, taken_at: float = 100.0) -> EngineSnapshot:
    return parse_vllm_metrics(text, taken_at=taken_at)


def capture(name: str) -> str:
    return (CAPTURES / f"metrics-{name}.txt").read_text()


def without_lines(text: str, *names: str) -> str:
    return "\n".join(line for line in text.splitlines() if not any(name in line for name in names))


# --- the real captures ----------------------------------------------------------------------


def test_under_load() -> None:
    snap = parse(capture("under-load"), taken_at=42.5)
    assert snap.taken_at == 42.5
    assert snap.has_cache_config
    assert snap.block_size == 128
    assert snap.num_gpu_blocks == 64
    assert snap.engines == 1
    assert snap.kv_cache_usage == pytest.approx(0.9841269841269842, abs=0)
    # 62 of 63 usable blocks held (usage = 1 - free / (num_gpu_blocks - 1))
    assert snap.capacity_blocks == 63
    assert snap.used_blocks == 62
    assert snap.running == 20
    assert snap.preemptions_total == 10.0
    assert snap.generation_tokens_total == 21411.0
    # the 21 answers finished: their lengths' histogram and its sum
    assert snap.generation_lengths[-1] == (float("inf"), 21.0)
    assert snap.generation_lengths_sum == 14050.0
    assert snap.cache_dtype == "auto"
    assert snap.prefix_caching is True
    assert snap.kv_cache_memory_bytes == 1_073_741_824


def test_fresh() -> None:
    snap = parse(capture("fresh"))
    assert (snap.block_size, snap.num_gpu_blocks, snap.engines) == (128, 64, 1)
    assert snap.kv_cache_usage == 0.0
    assert (snap.capacity_blocks, snap.used_blocks) == (63, 0)
    assert snap.running == 0
    assert snap.preemptions_total == 0.0
    assert snap.generation_tokens_total == 0.0
    assert snap.has_cache_config


def test_idle_after_burst() -> None:
    snap = parse(capture("idle-after-burst"))
    assert (snap.block_size, snap.num_gpu_blocks) == (128, 64)
    assert snap.kv_cache_usage == 0.0
    assert snap.used_blocks == 0
    assert snap.running == 0
    assert snap.preemptions_total == 10.0
    assert snap.generation_tokens_total == 14050.0


def test_a_histogram_without_its_sum_reads_as_no_sum() -> None:
    snap = parse(without_lines(capture("under-load"), "request_generation_tokens_sum"))
    assert snap.generation_lengths[-1] == (float("inf"), 21.0)
    assert snap.generation_lengths_sum is None


def test_same_answer_as_prometheus_client_on_the_whole_text() -> None:
    """The line filter must not change what is read: compare with a plain full parse."""
    from prometheus_client.parser import text_string_to_metric_families

    for name in ("fresh", "under-load", "idle-after-burst"):
        text = capture(name)
        values = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        snap = parse(text)
        assert snap.running == values["vllm:num_requests_running"]
        assert snap.kv_cache_usage == values["vllm:kv_cache_usage_perc"]
        assert snap.preemptions_total == values["vllm:num_preemptions_total"]
        assert snap.generation_tokens_total == values["vllm:generation_tokens_total"]


def test_age() -> None:
    snap = parse(capture("fresh"), taken_at=10.0)
    assert snap.age(12.5) == 2.5


def test_snapshot_is_frozen() -> None:
    snap = parse(capture("fresh"))
    with pytest.raises(AttributeError):
        snap.running = 3  # type: ignore[misc]


# --- data parallel --------------------------------------------------------------------------


def test_two_engines_are_summed_and_kept_apart() -> None:
    snap = parse((CRAFTED / "two-engines.txt").read_text())
    assert snap.engines == 2
    # each engine's line says 130, the sum of the two pools (vLLM 0.32's client adds them up)
    assert snap.num_gpu_blocks == 130
    assert snap.block_size == 128
    # one null block per engine
    assert snap.capacity_blocks == 64 + 64
    assert snap.kv_cache_usage == pytest.approx((0.5 * 64 + 0.25 * 64) / 128)
    assert snap.used_blocks == 48
    assert snap.running == 8
    assert snap.preemptions_total == 10.0
    assert snap.generation_tokens_total == 2100.0
    assert snap.cache_dtype == "fp8"
    assert snap.kv_cache_memory_bytes == 1_073_741_824
    # and each engine's own pool
    assert [e.engine for e in snap.pools] == ["0", "1"]
    assert [(e.capacity_blocks, e.used_blocks) for e in snap.pools] == [(64, 32), (64, 16)]
    assert [e.running for e in snap.pools] == [3, 5]
    assert [e.preemptions_total for e in snap.pools] == [4.0, 6.0]
    assert [e.generation_tokens_total for e in snap.pools] == [700.0, 1400.0]


def test_a_real_two_engine_server_has_two_pools_of_its_override() -> None:
    """vLLM 0.32 CPU, --data-parallel-size 2 --num-gpu-blocks-override 20: each engine's
    cache_config_info reads num_gpu_blocks="40" (the sum) and kv_cache_size_tokens="2560"
    (20 blocks of 128, its own pool)."""
    snap = parse((CRAFTED / "dp2-fresh-vllm-0.32.0.txt").read_text())
    assert snap.engines == 2
    assert [(e.engine, e.num_gpu_blocks, e.capacity_blocks) for e in snap.pools] == [
        ("0", 20, 19),
        ("1", 20, 19),
    ]
    assert snap.capacity_blocks == 38  # not 78, the sum of the labels less the null blocks


def test_one_engine_is_its_own_pool() -> None:
    snap = parse((CAPTURES / "metrics-under-load.txt").read_text())
    assert snap.pools == (snap,)
    assert snap.per_engine == ()


def test_two_engines_without_cache_config_average_the_usage() -> None:
    text = without_lines((CRAFTED / "two-engines.txt").read_text(), "cache_config_info")
    snap = parse(text)
    assert snap.engines == 2
    assert not snap.has_cache_config
    assert snap.kv_cache_usage == pytest.approx(0.375)
    assert snap.used_blocks is None


# --- older and other versions ---------------------------------------------------------------


def test_v0_names_and_labels() -> None:
    snap = parse((CRAFTED / "old-names-v0.txt").read_text())
    assert snap.engines == 1  # no "engine" label at all
    assert snap.block_size == 16
    assert snap.num_gpu_blocks == 2049
    assert snap.kv_cache_usage == 0.25  # from vllm:gpu_cache_usage_perc
    assert (snap.capacity_blocks, snap.used_blocks) == (2048, 512)
    assert snap.running == 7
    assert snap.preemptions_total == 3.0
    assert snap.generation_tokens_total == 1234.0
    assert snap.prefix_caching is False
    assert snap.kv_cache_memory_bytes is None  # label absent in V0


def test_new_usage_name_wins_over_old() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
    )
    assert parse(text).kv_cache_usage == 0.1
    # and the order of the lines does not matter
    assert parse("\n".join(reversed(text.splitlines()))).kv_cache_usage == 0.1


def test_relabelled_underscore_prefix() -> None:
    text = (
        'vllm_num_requests_running{engine="0",model_name="m"} 4.0\n'
        'vllm_kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm_cache_config_info{block_size="16",engine="0",num_gpu_blocks="11"} 1.0\n'
    )
    snap = parse(text)
    assert (snap.running, snap.kv_cache_usage, snap.block_size, snap.used_blocks) == (
        4,
        0.5,
        16,
        5,
    )
    # when both spellings are present, the colon one alone counts (no double count)
    mixed = text + 'vllm:num_requests_running{engine="0",model_name="m"} 6.0\n'
    assert parse(mixed).running == 6


def test_counter_families_with_type_lines() -> None:
    """prometheus_client strips ``_total`` from a counter family's name: samples must match."""
    text = (
        "# HELP vllm:num_preemptions Cumulative number of preemption from the engine.\n"
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 5.0\n'
        'vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9\n'
    )
    assert parse(text).preemptions_total == 5.0


def test_unknown_labels_and_none_values() -> None:
    text = (
        "vllm:cache_config_info{"
        'block_size="32",brand_new_label="whatever",cache_dtype="None",engine="0",'
        'enable_prefix_caching="maybe",kv_cache_memory_bytes="None",num_gpu_blocks="257",'
        'tenant="a"} 1.0\n'
        'vllm:num_requests_running{engine="0",model_name="m",pod="p-1",zone="z"} 2.0\n'
        'vllm:kv_cache_usage_perc{engine="0",extra="1",model_name="m"} 0.5\n'
    )
    snap = parse(text)
    assert snap.block_size == 32
    assert snap.num_gpu_blocks == 257
    assert snap.cache_dtype is None
    assert snap.prefix_caching is None
    assert snap.kv_cache_memory_bytes is None
    assert snap.running == 2
    assert snap.used_blocks == 128


def test_cache_config_with_float_and_missing_numbers() -> None:
    text = 'vllm:cache_config_info{block_size="16.0",engine="0",num_gpu_blocks="None"} 1.0\n'
    snap = parse(text)
    assert snap.has_cache_config
    assert snap.block_size == 16
    assert snap.num_gpu_blocks is None
    assert (snap.capacity_blocks, snap.used_blocks) == (None, None)


def test_missing_cache_config_info() -> None:
    snap = parse(without_lines(capture("under-load"), "cache_config_info"))
    assert not snap.has_cache_config
    assert snap.block_size is None
    assert snap.num_gpu_blocks is None
    assert snap.cache_dtype is None
    assert snap.prefix_caching is None
    assert snap.kv_cache_memory_bytes is None
    assert (snap.capacity_blocks, snap.used_blocks) == (None, None)
    # what does not depend on it is still read
    assert snap.kv_cache_usage == pytest.approx(62 / 63)
    assert snap.running == 20
    assert snap.engines == 1


def test_missing_usage() -> None:
    snap = parse(without_lines(capture("under-load"), "kv_cache_usage_perc"))
    assert snap.kv_cache_usage is None
    assert snap.capacity_blocks == 63
    assert snap.used_blocks is None


def test_nan_usage_reads_as_missing() -> None:
    snap = parse('vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN\n')
    assert snap.kv_cache_usage is None


def test_crlf_line_endings() -> None:
    text = capture("under-load").replace("\n", "\r\n")
    snap = parse(text)
    assert (snap.num_gpu_blocks, snap.used_blocks, snap.running) == (64, 62, 20)


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("\n\n  \n", id="blank"),
        pytest.param("<html><body>502 Bad Gateway</body></html>\n", id="html"),
        pytest.param('{"object": "list", "data": []}', id="json"),
        pytest.param("\x00\xff\ufffd garbage \n vllm", id="binary"),
        pytest.param(
            "# HELP python_info Python platform information\n"
            "# TYPE python_info gauge\n"
            'python_info{implementation="CPython"} 1.0\n',
            id="prometheus-without-vllm",
        ),
        pytest.param('vllm:some_future_metric{engine="0"} 1.0\n', id="only-unknown-vllm"),
        pytest.param('vllm:num_requests_running{engine="0" 3.0\n', id="broken-labels"),
        pytest.param('vllm:num_requests_running{engine="0"} three\n', id="bad-value"),
        pytest.param('vllm:kv_cache_usage_perc{engine="0",engine="1"} 0.5\n', id="duplicate-label"),
    ],
)
def test_garbage_raises_metrics_parse_error(text: str) -> None:
    with pytest.raises(MetricsParseError) as info:
        parse(text)
    message = str(info.value)
    assert message
    assert "\n" not in message


def test_non_str_input_raises_metrics_parse_error() -> None:
    with pytest.raises(MetricsParseError):
        parse(b"vllm:num_requests_running 1.0\n")  # type: ignore[arg-type]


def test_metrics_parse_error_is_a_value_error() -> None:
    assert issubclass(MetricsParseError, ValueError)


def test_long_garbage_line_gives_a_short_message() -> None:
    text = 'vllm:num_requests_running{engine="' + "x" * 10_000 + "} 1\n"
    with pytest.raises(MetricsParseError) as info:
        parse(text)
    assert len(str(info.value)) <= 300


def test_properties_never_go_out_of_range() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="11"} 1.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.5\n'
    )
    snap = parse(text)
    assert snap.kv_cache_usage == 1.0
    assert snap.used_blocks == 10
    assert not math.isnan(snap.age(0.0))


def test_inter_token_latency_is_read() -> None:
    snap = parse(capture("under-load"))
    assert snap.inter_token_latency_count == 21370.0
    assert snap.inter_token_latency_sum == pytest.approx(102.944, abs=1e-3)
    old = 'vllm:time_per_output_token_seconds_sum{engine="0"} 2.0\n'
    old += 'vllm:time_per_output_token_seconds_count{engine="0"} 100.0\n'
    assert parse(old).inter_token_latency_sum == 2.0  # the name before vLLM renamed it


def test_engine_steps_are_read_where_vllm_exports_them() -> None:
    """vllm:iteration_tokens_total observes each engine step once: its count is the steps."""
    assert parse(capture("under-load")).steps_total == 1453.0
    assert parse(capture("fresh")).steps_total == 0.0
    dp2 = parse((CRAFTED / "dp2-fresh-vllm-0.32.0.txt").read_text())
    assert [e.steps_total for e in dp2.pools] == [0.0, 0.0]
    assert parse((CRAFTED / "old-names-v0.txt").read_text()).steps_total is None


def test_the_newest_lora_sample_is_kept() -> None:
    """vLLM sets vllm:lora_requests_info to the time of each update, under the adapters' names;
    older label sets stay with older times."""
    text = (CAPTURES / "metrics-under-load.txt").read_text() + (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",'
        'waiting_lora_adapters=""} 1764500000.0\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"} 1764500009.0\n'
    )
    snap = parse(text)
    assert snap.lora_info == (
        (("max_lora", "2"), ("running_lora_adapters", "a,b"), ("waiting_lora_adapters", "c")),
        1764500009.0,
    )
    assert parse((CAPTURES / "metrics-under-load.txt").read_text()).lora_info is None
