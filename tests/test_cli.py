"""`kv-sidecar plan` and `kv-sidecar serve` as users run them: a real subprocess, plan's table,
its JSON and its errors; serve's settings in either spelling of an enum value, and its refusals
of a bad setting or a model config that cannot work, each one line and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir
from harness.workload import SidecarProcess, metric_value
from sidecar.config import ReservationMode, Settings

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
QWEN = str(CONFIGS / "qwen2.5-7b-instruct.json")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=60
    )


def test_plan_json_has_the_contract_fields() -> None:
    proc = run(
        "plan",
        "--model-config",
        QWEN,
        "--max-model-len",
        "8192",
        "--gpu-memory-gib",
        "24",
        "--gpu-memory-utilization",
        "1.0",
        "--weights-gib",
        "14",
        "--overhead-gib",
        "0",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["weights_source"], out["overhead_source"]) == ("--weights-gib", "--overhead-gib")
    assert out["bytes_per_token"] == 57_344
    assert out["bytes_per_sequence"] == 8192 * 57_344
    assert out["num_blocks"] == (10 << 30) // (16 * 57_344)
    assert int(out["max_concurrency"]) == 22


def test_plan_table_is_readable() -> None:
    proc = run("plan", "--model-config", QWEN)
    assert proc.returncode == 0, proc.stderr
    assert "57,344 (56.00 KiB)" in proc.stdout
    assert "per sequence of 32,768 tokens" in proc.stdout
    assert "max concurrency" not in proc.stdout  # no GPU memory given


def test_plan_options_change_the_figures() -> None:
    base = json.loads(run("plan", "--model-config", QWEN, "--json").stdout)
    fp8 = json.loads(
        run("plan", "--model-config", QWEN, "--kv-cache-dtype", "fp8", "--json").stdout
    )
    tp4 = json.loads(run("plan", "--model-config", QWEN, "-tp", "4", "--json").stdout)
    assert fp8["bytes_per_token"] * 2 == base["bytes_per_token"]
    assert tp4["bytes_per_token"] * 4 == base["bytes_per_token"]
    mem = json.loads(
        run("plan", "--model-config", QWEN, "--kv-cache-memory-gib", "4", "--json").stdout
    )
    assert mem["num_blocks"] == (4 << 30) // base["bytes_per_block"]


def test_python_dash_m_and_console_script_agree() -> None:
    script = Path(sys.executable).with_name("kv-sidecar")
    a = subprocess.run(
        [str(script), "plan", "--model-config", QWEN, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert a.stdout == run("plan", "--model-config", QWEN, "--json").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--model-config", "/nonexistent/config.json"], "model config not found"),
        (["plan", "--model-config", "{bad}"], "model config not found"),
        (["plan", "--model-config", QWEN, "--kv-cache-dtype", "fp3"], "unknown kv cache dtype"),
        (
            ["plan", "--model-config", QWEN, "--gpu-memory-gib", "8", "--weights-gib", "14"],
            "no memory left",
        ),
        (["plan", "--model-config", QWEN, "--tensor-parallel-size", "0"], "at least 1"),
        (["plan", "--model-config", QWEN, "--block-size", "-16"], "block size must be positive"),
        (["plan", "--model-config", QWEN, "--max-model-len", "abc"], "invalid int value"),
        (["plan"], "required: --model-config"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_plan_errors_are_one_line(args: list[str], message: str) -> None:
    proc = run(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2  # argparse may print its usage line first


def test_plan_invalid_json_and_bad_fields(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 2,')
    proc = run("plan", "--model-config", str(tmp_path))
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr
    bad.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 8}))
    proc = run("plan", "--model-config", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "kv-sidecar: error: 'num_attention_heads' must be a positive integer, got 0"
    )


# --- serve ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    model_dir = write_model_dir(tmp_path_factory.mktemp("model") / "tiny")
    with FakeServer(FakeVllm(model_root=model_dir)) as server:
        yield server


def refused(upstream: FakeServer, *args: str, env: dict[str, str] | None = None) -> str:
    """What a ``kv-sidecar serve`` that must refuse to run says (it exits 2)."""
    sc = SidecarProcess(upstream.url, "--log-level", "error", *args, env=env)
    sc.start(wait_ready=False)
    try:
        assert sc.proc is not None
        code = sc.proc.wait(timeout=60)
    finally:
        sc.stop()
    said = sc.log()
    assert code == 2, said
    assert "Traceback" not in said
    lines = said.strip().splitlines()
    assert len(lines) == 1, said
    assert lines[0].startswith("kv-sidecar serve: error: ")
    return lines[0].removeprefix("kv-sidecar serve: error: ")


def test_the_default_reservation_is_adaptive(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest pins worst-case for the suite; without that, a sidecar reserves adaptively."""
    monkeypatch.delenv("KV_SIDECAR_RESERVATION", raising=False)
    settings = Settings(_cli_parse_args=[])  # type: ignore[call-arg]
    assert settings.reservation is ReservationMode.adaptive
    assert (settings.risk_steps, settings.tpot_target) == (1.0, None)


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--reservation", "worst_case"], {}),  # as `serve --help` prints worst-case
        (["--reservation", "worst-case"], {}),  # the value, as the choices list it
        (["--reservation=worst_case"], {}),
        ([], {"KV_SIDECAR_RESERVATION": "worst_case"}),
    ],
)
def test_serve_takes_either_spelling_of_an_enum_value(
    upstream: FakeServer, args: list[str], env: dict[str, str]
) -> None:
    with SidecarProcess(upstream.url, *args, "--policy", "reject", env=env) as sc:
        text = sc.metrics()
    assert metric_value(text, "kv_sidecar_config_info", reservation="worst-case") == 1
    assert metric_value(text, "kv_sidecar_config_info", policy="reject") == 1


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--reservation", "bogus"], {}, "--reservation (KV_SIDECAR_RESERVATION): Input should be"),
        (["--policy", "maybe"], {}, "--policy (KV_SIDECAR_POLICY): Input should be 'reject'"),
        (["--stale-policy=shut"], {}, "--stale-policy (KV_SIDECAR_STALE_POLICY): "),
        (["--log-format", "yaml"], {}, "--log-format (KV_SIDECAR_LOG_FORMAT): "),
        (["--access-log", "some"], {}, "--access-log (KV_SIDECAR_ACCESS_LOG): "),
        (["--log-level", "loud"], {}, "--log-level (KV_SIDECAR_LOG_LEVEL): "),
        (
            ["--workers", "0"],
            {},
            "--workers (KV_SIDECAR_WORKERS): Input should be greater than or equal to 1, or "
            "'auto', got '0'",
        ),
        (["--port", "x"], {}, "--port (KV_SIDECAR_PORT): Input should be a valid integer"),
        ([], {"KV_SIDECAR_HEADROOM": "2"}, "--headroom (KV_SIDECAR_HEADROOM): Input should be"),
        (["--upstream-api-key"], {}, "argument --upstream-api-key: expected one argument"),
        (["--no-such-flag", "1"], {}, "unrecognized arguments: --no-such-flag 1"),
    ],
)
def test_serve_refuses_a_bad_setting_in_one_line_naming_the_flag(
    upstream: FakeServer, args: list[str], env: dict[str, str], said: str
) -> None:
    line = refused(upstream, *args, env=env)
    assert line.startswith(said), line
    if args and args[-1] in ("bogus", "maybe", "yaml"):
        assert line.endswith(f", got {args[-1]!r}")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_stops_at_once_on_a_model_config_that_cannot_be_read(
    upstream: FakeServer, tmp_path: Path, workers: str
) -> None:
    """A garbled --model-config cannot get better by waiting: once vLLM answers, the sidecar
    (the single process, or the relay workers' owner) stops with one line, exit 2."""
    garbled = tmp_path / "config.json"
    garbled.write_text('{"num_hidden_layers": 2,')
    said = refused(upstream, "--model-config", str(garbled), "--workers", workers)
    assert said == (
        f"--model-config: model config {garbled} is not valid JSON: Expecting property name "
        "enclosed in double quotes at line 1"
    )


def test_serve_stops_at_once_on_a_tokenizer_that_does_not_exist(
    upstream: FakeServer, tmp_path: Path
) -> None:
    said = refused(upstream, "--tokenizer", str(tmp_path / "absent"), "--workers", "1")
    assert said == f"--tokenizer: no such file or directory: {tmp_path / 'absent'}"
