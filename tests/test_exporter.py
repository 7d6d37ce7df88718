"""The sidecar's metrics on a fresh registry: every documented name is exported, with the right
values, and nothing undocumented or unbounded appears."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.admission.ask import Ask
from sidecar.admission.controller import AdmissionController
from sidecar.cgroup import cgroup_quota_cores, cpu_limit_cores, parse_cpu_max
from sidecar.config import ReservationMode
from sidecar.http.admin import Admin, SettingsCollector
from sidecar.http.workers.owner import WorkersCollector
from sidecar.kv.geometry import UniformBlocks
from sidecar.kv.ledger import Ledger
from sidecar.kv.projection import project_counts
from sidecar.observability.exporter import Metrics
from sidecar.observability.refusals import RecentRefusals
from tests.support.exporter import build_metrics
from tests.support.snapshots import Clock, snapshot

DOCS = Path(__file__).parent.parent / "docs" / "metrics.md"
BLOCKS = UniformBlocks(128, 131_072)


def documented_names() -> set[str]:
    # vLLM's names that the sidecar serves too (for the endpoint picker): the rows of their table
    names: set[str] = set(re.findall(r"^\| `(vllm:[a-z_]+)`", DOCS.read_text(), re.MULTILINE))
    # the process collector's standard names: the rows of "The sidecar process"
    names |= set(re.findall(r"^\| `(process_[a-z_]+)`", DOCS.read_text(), re.MULTILINE))
    for cell in re.findall(r"`(kv_sidecar_[a-z_]+)`(?: / `(_[a-z]+)`)?", DOCS.read_text()):
        base, alt = cell
        names.add(base)
        if alt:  # "`kv_sidecar_kv_capacity_bytes` / `_blocks`"
            names.add(re.sub(r"_[a-z]+$", alt, base))
    return names


def build() -> tuple[CollectorRegistry, Metrics, AdmissionController, Clock]:
    return build_metrics(
        scrape_errors=3,
        config_labels={"policy": "queue", "reservation": "worst-case", "headroom": "0.0"},
    )


def test_state_gauges_follow_the_ledger_and_the_engine() -> None:
    registry, metrics, ac, clock = build()
    ac.on_snapshot(snapshot(clock, used=0, running=0))
    p = project_counts((271,), requested_max_tokens=700, n=1, max_model_len=1024, blocks=BLOCKS)
    reservations = []
    for _ in range(3):
        d = ac.try_admit(Ask(p, streamed=True))
        assert d is not None and d.reservation is not None
        metrics.decided(d)
        ac.ledger.start(d.reservation)
        reservations.append(d.reservation)
    ac.ledger.advance(reservations[0], 300)  # 571 tokens: 5 blocks
    clock.now += 1
    ac.on_snapshot(snapshot(clock, used=10, running=3))  # predicted 5 + 3 + 3 = 11
    metrics.on_snapshot()

    def value(name: str, **labels: str) -> float | None:  # every one a per-model series
        return registry.get_sample_value(name, {**labels, "model_name": "tiny"})

    assert value("kv_sidecar_kv_capacity_blocks") == 63
    assert value("kv_sidecar_kv_capacity_bytes") == 63 * 131_072
    assert value("kv_sidecar_kv_reserved_blocks") == 24
    assert value("kv_sidecar_kv_predicted_used_blocks") == 11
    assert value("kv_sidecar_kv_actual_used_blocks") == 10
    assert value("kv_sidecar_kv_prediction_error_bytes") == 1 * 131_072
    # the future peak: the first (300 generated) ends at 971 tokens, 8 blocks, while the two
    # others hold 671 tokens, 6 blocks each: 20, less than the 24 of the sum of peaks
    assert value("kv_sidecar_kv_future_peak_blocks") == 20
    assert value("kv_sidecar_kv_prefix_shared_blocks") == 0
    assert value("kv_sidecar_kv_headroom_blocks") == 63 - 20
    assert value("kv_sidecar_oom_risk_ratio") == 20 / 63
    assert value("kv_sidecar_kv_projected_usage_ratio") == 20 / 63
    assert value("kv_sidecar_requests_in_flight") == 3
    assert value("kv_sidecar_requests_total", decision="admit", reason="fits") == 3
    assert value("kv_sidecar_vllm_scrape_errors_total") == 3
    assert (
        value(
            "kv_sidecar_vllm_info",
            model="tiny",
            block_size="128",
            num_gpu_blocks="64",
            cache_dtype="auto",
            prefix_caching="true",
            version="",
        )
        == 1
    )
    assert value("kv_sidecar_kv_prediction_relative_error_count") == 1
    # vLLM's usage grows by 10 blocks a second: 43 free blocks last 4.3 s
    clock.now += 1
    ac.on_snapshot(snapshot(clock, used=20, running=3))
    metrics.on_snapshot()
    assert value("kv_sidecar_kv_exhaustion_seconds") == (63 - 20) / 10
    for r in reservations:
        ac.release(r)
    assert value("kv_sidecar_kv_reserved_blocks") == 0
    assert value("kv_sidecar_requests_in_flight") == 0


def test_every_documented_metric_is_exported_and_nothing_else() -> None:
    registry, metrics, ac, clock = build()
    # what the main process adds with relay workers (--workers 2)
    owner = SimpleNamespace(links=[1, 2], workers=2, requests_by_worker=[3, 4], lost_total=0)
    registry.register(WorkersCollector(owner))  # type: ignore[arg-type]
    admin = Admin(
        ac, enabled=True, token=None, config_labels={}, refusals=RecentRefusals(metrics.requests)
    )
    registry.register(SettingsCollector(admin))  # the runtime settings (sidecar.http.admin)
    lora = ((("max_lora", "2"), ("running_lora_adapters", "a"), ("waiting_lora_adapters", "")), 5.0)
    ac.on_snapshot(dataclasses.replace(snapshot(clock, used=5, running=1), lora_info=lora))
    metrics.on_snapshot()
    # busy intervals at varied loads (batch and prompt tokens per step): the engine's step
    # model and decode step are measured
    totals = dict.fromkeys(
        (
            "generation_tokens_total",
            "inter_token_latency_sum",
            "inter_token_latency_count",
            "prefill_seconds_sum",
            "prefill_count",
            "prompt_tokens_sum",
        ),
        0.0,
    )
    for batch, prompts in ((1, 0), (4, 2), (2, 0), (1, 1)):
        seconds_per_step = 0.010 + 0.001 * batch
        clock.now += 1
        tokens = batch / seconds_per_step
        totals["generation_tokens_total"] += tokens
        totals["inter_token_latency_sum"] += tokens * seconds_per_step
        totals["inter_token_latency_count"] += tokens
        totals["prefill_seconds_sum"] += prompts * (seconds_per_step + 256 * 2e-5)
        totals["prefill_count"] += prompts
        totals["prompt_tokens_sum"] += prompts * 256
        busy = snapshot(clock, used=5, running=batch)
        ac.on_snapshot(
            dataclasses.replace(
                busy,
                lora_info=lora,
                admission_rejections=(("max_num_queued_reqs", 2.0),),
                **totals,
            )
        )
    ac.reservation_mode = ReservationMode.expected  # the learned lengths are listed then
    for _ in range(ac.learner.min_samples):
        ac.learner.observe("chat:none", 100)
    text = generate_latest(registry).decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = re.sub(r"_(bucket|count|sum|created|total|info)$", "", sample.name)
            exported.add(name)
            # an info series is one per family: its labels describe, they do not multiply
            assert len(sample.labels) <= (7 if sample.name.endswith("_info") else 5), sample
    documented = {re.sub(r"_(total|info)$", "", n) for n in documented_names()}
    assert documented - exported == set(), "documented but not exported"
    # prometheus_client's `_created` series are off (sidecar.observability.exporter)
    assert not [line for line in text.splitlines() if "_created" in line.split("{")[0]]
    assert exported - documented == set(), "exported but not documented"


def test_age_is_infinite_before_the_first_scrape() -> None:
    registry, _, _, _ = build()
    tiny = {"model_name": "tiny"}
    assert registry.get_sample_value("kv_sidecar_vllm_metrics_age_seconds", tiny) == math.inf
    assert registry.get_sample_value("kv_sidecar_kv_capacity_blocks", tiny) is None  # not known


def test_demand_ratio_counts_what_runs_and_what_waits_over_the_budget() -> None:
    """The autoscaling signal: (committed + queued peaks) / budget, and it leaves out nothing
    admission holds back; the old oom-risk figure stays flat while the queue grows."""

    async def run() -> None:
        registry, _, ac, clock = build()
        ac.headroom = 0.05  # budget floor(63 * 0.95) = 59
        ac.on_snapshot(snapshot(clock, used=0, running=0))
        # 271 + 700 tokens: 8 blocks each; 7 fit (56), the 8th would reach 64 > 59
        p = project_counts((271,), requested_max_tokens=700, n=1, max_model_len=1024, blocks=BLOCKS)
        admitted = []
        while (d := ac.try_admit(Ask(p, streamed=True))) is not None:
            assert d.reservation is not None
            admitted.append(d.reservation)
        assert len(admitted) == 7

        def value(name: str) -> float | None:
            return registry.get_sample_value(name, {"model_name": "tiny"})

        assert value("kv_sidecar_kv_demand_ratio") == 56 / 59
        risk_before = value("kv_sidecar_oom_risk_ratio")
        waiters = [asyncio.ensure_future(ac.wait(Ask(p, streamed=True))) for _ in range(15)]
        await asyncio.sleep(0)
        assert ac.queue_depth == 15
        assert value("kv_sidecar_kv_demand_ratio") == (56 + 15 * 8) / 59
        assert value("kv_sidecar_queued_demand_ratio") == 15 * 8 / 63
        assert value("kv_sidecar_oom_risk_ratio") == risk_before
        # blocks vLLM holds beyond what the ledger explains (traffic around the sidecar) count
        # too: they are part of what admission counts as spoken for
        ac.on_snapshot(snapshot(clock, used=40, running=7))
        assert ac.external_blocks > 0
        committed = ac.state().committed_blocks
        assert committed >= 56 + ac.external_blocks
        assert value("kv_sidecar_kv_demand_ratio") == (committed + 15 * 8) / 59
        ac.fail_queue()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert ac.queue_depth == 0

    asyncio.run(run())


def test_vllm_cache_config_info_is_served_under_vllms_names() -> None:
    """What the endpoint picker's cacheInfoSpec reads: block_size and num_gpu_blocks as integer
    labels of a gauge named as vLLM names it, with vLLM's spelling of the other labels."""
    registry, _, _, _ = build()
    fixture = (
        Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu" / "metrics-fresh.txt"
    ).read_text()
    vllm_family = next(
        f for f in text_string_to_metric_families(fixture) if f.name == "vllm:cache_config_info"
    )
    ours = next(
        f
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name == "vllm:cache_config_info"
    )
    assert ours.type == vllm_family.type == "gauge"
    [sample] = ours.samples
    assert sample.value == 1.0
    assert sample.labels == {
        "block_size": "128",
        "num_gpu_blocks": "64",
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
    }
    assert set(sample.labels) <= set(vllm_family.samples[0].labels)
    assert vllm_family.samples[0].labels["enable_prefix_caching"] in ("True", "False")


def test_no_cache_config_info_before_discovery() -> None:
    clock = Clock()
    ac = AdmissionController(Ledger(BLOCKS, clock=clock), clock=clock)
    registry = CollectorRegistry()
    Metrics(
        registry,
        ac,
        engine=lambda: None,
        vllm_up=lambda: False,
        ready=lambda: False,
        scrape_errors=lambda: 0,
        config_labels={},
        clock=clock,
    )
    text = generate_latest(registry).decode()
    assert "vllm:cache_config_info" not in text
    assert "kv_sidecar_kv_demand_ratio" not in text  # no budget known yet


def test_request_duration_is_observed_per_answered_request() -> None:
    registry, metrics, _, _ = build()
    tiny = {"model_name": "tiny"}
    assert registry.get_sample_value("kv_sidecar_request_duration_seconds_count", tiny) == 0
    for seconds in (0.2, 3.0, 45.0):
        metrics.answered(seconds)

    def bucket(le: str) -> float | None:
        name = "kv_sidecar_request_duration_seconds_bucket"
        return registry.get_sample_value(name, {"le": le, **tiny})

    assert registry.get_sample_value("kv_sidecar_request_duration_seconds_count", tiny) == 3
    assert registry.get_sample_value("kv_sidecar_request_duration_seconds_sum", tiny) == 48.2
    assert (bucket("0.25"), bucket("5.0"), bucket("30.0"), bucket("60.0")) == (1, 2, 2, 3)


def test_the_sidecars_own_cpu_and_its_limit_are_exported() -> None:
    """The process collector on the sidecar's registry (not only the default one), and the CPU
    the process may use: what KVSidecarCPUSaturated divides."""
    registry, _, _, _ = build()
    cpu = registry.get_sample_value("process_cpu_seconds_total")
    assert cpu is not None and cpu > 0
    assert registry.get_sample_value("process_start_time_seconds")
    limit = registry.get_sample_value("kv_sidecar_cpu_limit_cores")
    assert limit == cpu_limit_cores()
    assert limit is not None and 0 < limit <= (os.cpu_count() or 1)


def _cgroup(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /sys/fs/cgroup tree and /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(self_cgroup)
    return root, proc


def test_cpu_quota_from_cgroup_v2_takes_the_tightest_level(tmp_path: Path) -> None:
    # a host's hierarchy (no cgroup namespace): the pod's limit above the container's
    root, proc = _cgroup(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/cpu.max": "max 100000\n",
            "kubepods/pod1/cpu.max": "150000 100000\n",
            "kubepods/pod1/ctr/cpu.max": "200000 100000\n",
        },
    )
    assert cgroup_quota_cores(root, proc) == 1.5
    # a container's own namespace: its cgroup is the root
    root, proc = _cgroup(tmp_path / "ns", "0::/\n", {"cpu.max": "50000 100000\n"})
    assert cgroup_quota_cores(root, proc) == 0.5


def test_cpu_quota_from_cgroup_v1(tmp_path: Path) -> None:
    root, proc = _cgroup(
        tmp_path,
        "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_quota_cores(root, proc) == 2.5


def test_no_quota_or_unreadable_cgroups_mean_the_cpus_available(tmp_path: Path) -> None:
    cpus = float(len(os.sched_getaffinity(0)))
    root, proc = _cgroup(tmp_path, "1:cpu:/\n0::/\n", {"cpu/cpu.cfs_quota_us": "-1\n"})
    assert cgroup_quota_cores(root, proc) is None
    assert cpu_limit_cores(root, proc) == cpus
    # garbage, or no /proc/self/cgroup at all: no quota, never an exception
    root, proc = _cgroup(tmp_path / "bad", "garbage\n0::/\n", {"cpu.max": "lots 0\n"})
    assert cgroup_quota_cores(root, proc) is None
    assert cgroup_quota_cores(root, tmp_path / "absent") is None
    # a quota above the CPUs the process may run on is capped by them
    root, proc = _cgroup(
        tmp_path / "big", "0::/\n", {"cpu.max": f"{int(cpus + 3) * 100000} 100000"}
    )
    assert cpu_limit_cores(root, proc) == cpus
    assert parse_cpu_max("max 100000") is None and parse_cpu_max("100000 0") is None


def test_vllms_newest_lora_sample_is_relayed_as_it_was() -> None:
    registry, _, ac, clock = build()
    ac.on_snapshot(snapshot(clock))
    text = generate_latest(registry).decode()
    assert "vllm:lora_requests_info" not in text  # vLLM serves no LoRA: nothing relayed
    labels = (
        ("max_lora", "4"),
        ("running_lora_adapters", "sql,chat"),
        ("waiting_lora_adapters", ""),
    )
    ac.on_snapshot(dataclasses.replace(snapshot(clock), lora_info=(labels, 1764500000.5)))
    sample = registry.get_sample_value("vllm:lora_requests_info", dict(labels))
    assert sample == 1764500000.5
