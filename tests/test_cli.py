"""`kv-sidecar plan` as users run it: a real subprocess, its table, its JSON and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
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
        run("plan", "--model-config", QWEN, "--kv-cache-memory-gib", "1", "--json").stdout
    )
    assert mem["num_blocks"] == (1 << 30) // base["bytes_per_block"]


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
