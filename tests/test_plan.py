"""`kv-sidecar plan` on a named GPU: the GPU table, the weights read from a model directory (or
estimated from its config), vLLM's startup refusals as one-line errors, and the `vllm serve`
flags the figures assume (which vLLM's own code, on the simulated GPU, turns into the same pool).

Model directories are made here (a config, an index or sized `*.safetensors` files): no hub."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import harness.gpus
from harness.sim_cost import ModelShape
from sidecar.cli import main
from sidecar.kv import gpus
from sidecar.kv.gpus import GIB, GPUS, batch_defaults, gpu
from sidecar.kv.memory import (
    LOGITS_COPIES,
    NON_TORCH_AND_CUDA_GRAPH_BYTES,
    ModelSize,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
QWEN = CONFIGS / "qwen2.5-7b-instruct.json"  # 28 heads, 4 KV heads, 32,768 positions
LLAMA_8B = CONFIGS / "llama-3.1-8b-instruct.json"
DEEPSEEK_LITE = CONFIGS / "deepseek-v2-lite-chat.json"


def plan(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``kv-sidecar plan ARGS`` in this process: (exit status, stdout, stderr)."""
    try:
        rc = main(["plan", *args])
    except SystemExit as exc:  # argparse's refusals
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(*args: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    rc, out, err = plan(*args, "--json", capsys=capsys)
    assert rc == 0, err
    return dict(json.loads(out))


def refused(*args: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The one line plan refuses ARGS with (exit 2, nothing on stdout)."""
    rc, out, err = plan(*args, capsys=capsys)
    assert rc == 2 and out == "", (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def config(tmp_path: Path, name: str = "model", **fields: Any) -> Path:
    """A model directory holding one ``config.json`` (a small Llama unless ``fields`` say)."""
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    base.update(fields)
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(base))
    return d


# --- the GPU table ------------------------------------------------------------------------------


def test_the_gpu_table_is_one_table() -> None:
    # the simulated engine reads the very objects plan reads
    assert harness.gpus.GPUS is gpus.GPUS and harness.gpus.gpu is gpus.gpu
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l40s-48gb", "l4-24gb"} <= set(
        GPUS
    )
    for alias, name in [("A100", "a100-80gb"), ("h100", "h100-80gb"), ("L40S", "l40s-48gb")]:
        assert gpu(alias) is GPUS[name]
    assert gpu("l4").memory_bytes == 23_034 << 20  # nvidia-smi's total on an L4
    assert gpu("l40s").memory_bytes == 46_068 << 20
    assert gpu("a100-40gb").memory_bytes == 40_960 << 20


@pytest.mark.parametrize("name", sorted(GPUS))
def test_each_gpu_carries_vllms_batch_defaults_for_its_memory(name: str) -> None:
    spec = GPUS[name]
    assert spec.label and spec.hbm_bytes_per_second > 0 and spec.bf16_dense_flops_per_second > 0
    assert (spec.default_max_num_batched_tokens, spec.default_max_num_seqs) == batch_defaults(
        spec.memory_bytes, a100=name.startswith("a100")
    )


# --- weights ----------------------------------------------------------------------------------


#: (fixture, parameters its model card gives), within 1.5%: Meta's Llama 3.1 8B and 3.3 70B,
#: Qwen2.5-7B-Instruct 7.61B, Mistral-7B-v0.1 7.24B, Qwen3-30B-A3B 30.5B, gpt-oss-20b 20.9B (21B
#: in OpenAI's card, 20.9 in its config's safetensors), DeepSeek-V3 671B, Gemma 2 9B 9.24B
PUBLISHED = [
    ("llama-3.1-8b-instruct", 8.03e9),
    ("llama-3.3-70b-instruct", 70.6e9),
    ("qwen2.5-7b-instruct", 7.61e9),
    ("mistral-7b-v0.1", 7.24e9),
    ("qwen3-30b-a3b", 30.5e9),
    ("gpt-oss-20b", 20.9e9),
    ("deepseek-v3", 671e9),
    ("gemma-2-9b-it", 9.24e9),
]


@pytest.mark.parametrize(("name", "params"), PUBLISHED)
def test_the_parameter_count_from_a_config(name: str, params: float) -> None:
    size = ModelSize.from_config(json.loads((CONFIGS / f"{name}.json").read_text()))
    assert size.params_total == pytest.approx(params, rel=0.015)


@pytest.mark.parametrize("path", sorted((ROOT / "harness" / "models").glob("*.json")))
def test_the_count_is_the_simulated_engines(path: Path) -> None:
    cfg = json.loads(path.read_text())
    assert ModelSize.from_config(cfg).params_total == ModelShape.from_config(cfg).params_total


def test_weights_from_the_safetensors_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = config(tmp_path)
    size = 7_000_000_000
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": {}})
    )
    base = plan_json("--model-config", str(model), "--gpu", "l40s", capsys=capsys)
    assert base["weights_bytes"] == size
    assert base["weights_source"] == "model.safetensors.index.json metadata.total_size"
    # the same model at TP 2: half the weights on each rank
    tp2 = plan_json(
        "--model-config", str(model / "config.json"), "--gpu", "l40s", "-tp", "2", capsys=capsys
    )
    assert tp2["weights_bytes"] == size // 2
    # every byte of weights is a byte less of KV cache: ten more blocks' worth, ten fewer blocks
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size + 10 * base["bytes_per_block"]}})
    )
    heavier = plan_json("--model-config", str(model), "--gpu", "l40s", capsys=capsys)
    assert heavier["num_blocks"] == base["num_blocks"] - 10
    # and --weights-gib overrides what the directory says
    given = plan_json(
        "--model-config",
        str(model),
        "--gpu",
        "l40s",
        "--weights-gib",
        repr(size / GIB),
        capsys=capsys,
    )
    assert given["weights_source"] == "--weights-gib"
    assert given["num_blocks"] == base["num_blocks"]


def test_weights_from_the_safetensors_files_then_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = config(tmp_path)
    estimate = plan_json("--model-config", str(model), "--gpu", "l4", capsys=capsys)
    params = ModelSize.from_config(json.loads((model / "config.json").read_text())).params_total
    assert estimate["weights_bytes"] == params * 2
    assert estimate["weights_source"].startswith("estimated from config.json")
    for i, n in enumerate((3_000_000_000, 1_500_000_123)):
        with open(model / f"model-0000{i + 1}-of-00002.safetensors", "wb") as f:
            f.truncate(n)  # sparse: the size is what counts
    files = plan_json("--model-config", str(model), "--gpu", "l4", capsys=capsys)
    assert files["weights_bytes"] == 4_500_000_123
    assert files["weights_source"] == "2 *.safetensors file(s)"


def test_a_float32_checkpoint_is_loaded_in_16_bits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = config(tmp_path, torch_dtype="float32")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 8_000_000_000}})
    )
    out = plan_json("--model-config", str(model), "--gpu", "a100-40gb", capsys=capsys)
    assert out["model_dtype"] == "bfloat16"
    assert out["weights_bytes"] == 4_000_000_000
    assert "float32 checkpoint loaded as bfloat16" in out["weights_source"]


def test_the_budget_is_vllms_formula(capsys: pytest.CaptureFixture[str]) -> None:
    """ceil(total x utilization) - weights - activation peak - other, on the GPU's own defaults."""
    out = plan_json("--model-config", str(QWEN), "--gpu", "h100", capsys=capsys)
    spec = gpu("h100")
    assert (out["max_num_batched_tokens"], out["max_num_seqs"]) == (8192, 1024)
    assert out["requested_bytes"] == math.ceil(spec.memory_bytes * 0.92)
    assert out["weights_bytes"] == 7_615_283_200 * 2  # 7.62B parameters (no norms, biases), bf16
    # 8,192 tokens x (gate and up: 2 x 18,944 + 4 x 3,584) x 2 B, and 1,024 rows of fp32 logits
    logits = LOGITS_COPIES * 1024 * 152_064 * 4
    assert out["activation_bytes"] == 8192 * (2 * 18_944 + 4 * 3584) * 2 + logits
    assert out["other_bytes"] == NON_TORCH_AND_CUDA_GRAPH_BYTES
    kv = out["requested_bytes"] - out["weights_bytes"] - out["activation_bytes"] - (1 << 30)
    assert out["kv_cache_memory_bytes"] == kv
    assert out["num_blocks"] == kv // (16 * 57_344)


# --- vLLM's refusals ---------------------------------------------------------------------------


def test_tensor_parallel_must_divide_the_attention_heads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = refused("--model-config", str(QWEN), "-tp", "3", capsys=capsys)
    assert "tensor parallel size 3 does not divide the model's 28 attention heads" in line
    assert "sizes that work: 1, 2, 4, 28" in line
    # the MLA model: 16 heads, no KV heads to split; 8 works, 3 does not
    assert plan_json("--model-config", str(DEEPSEEK_LITE), "-tp", "8", capsys=capsys)
    line = refused("--model-config", str(DEEPSEEK_LITE), "-tp", "3", capsys=capsys)
    assert "16 attention heads" in line


def test_kv_heads_split_evenly_or_replicate_evenly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 40 heads and 8 KV heads: TP 5 divides the heads, not the KV heads
    a = config(tmp_path, "a", hidden_size=5120, num_attention_heads=40, num_key_value_heads=8)
    line = refused("--model-config", str(a), "-tp", "5", capsys=capsys)
    assert "8 KV heads do not split evenly over 5 ranks" in line
    assert "sizes that work: 1, 2, 4, 8, 40" in line
    # 48 heads and 4 KV heads: TP 6 divides the heads, and is no multiple of the 4 KV heads
    b = config(tmp_path, "b", hidden_size=6144, num_attention_heads=48, num_key_value_heads=4)
    line = refused("--model-config", str(b), "-tp", "6", capsys=capsys)
    assert "6 ranks are not a multiple of the 4 KV heads they replicate" in line
    # 8 ranks over 4 KV heads replicate each twice: vLLM runs it, one KV head per rank
    assert plan_json("--model-config", str(b), "-tp", "8", capsys=capsys)["kv_heads_per_rank"] == 1


def test_max_model_len_within_what_the_model_allows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    line = refused("--model-config", str(QWEN), "--max-model-len", "32769", capsys=capsys)
    assert "--max-model-len 32,769 is above what the model allows" in line
    assert "max_position_embeddings=32,768" in line and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in line
    assert plan_json("--model-config", str(QWEN), "--max-model-len", "32768", capsys=capsys)
    # Llama 3.1's llama3 RoPE leaves 131,072 as it is; a linear factor of 4 multiplies it
    refused("--model-config", str(LLAMA_8B), "--max-model-len", "131073", capsys=capsys)
    linear = config(tmp_path, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert plan_json("--model-config", str(linear), capsys=capsys)["max_model_len"] == 32768
    refused("--model-config", str(linear), "--max-model-len", "32769", capsys=capsys)
    # the tokenizer's model_max_length bounds it too, as in vLLM (before any RoPE factor)
    tok = config(tmp_path, "tok")
    (tok / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    assert plan_json("--model-config", str(tok), capsys=capsys)["max_model_len"] == 4096
    line = refused("--model-config", str(tok), "--max-model-len", "8192", capsys=capsys)
    assert "tokenizer_config.json model_max_length=4,096" in line
    # vLLM's override, honoured the same way, and said in the command it assumes
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    long = plan_json("--model-config", str(QWEN), "--max-model-len", "65536", capsys=capsys)
    assert long["vllm_serve_command"].startswith("VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve")


def test_a_pool_too_small_for_one_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3.1-8B on an L4: 15 GiB of weights leave about 4 GiB, 128 KiB a token
    line = refused("--model-config", str(LLAMA_8B), "--gpu", "l4", capsys=capsys)
    assert "cannot hold one request of --max-model-len 131,072: it needs 16.00 GiB" in line
    assert "To serve at least one request with the model's max seq len (131072)" in line
    longest = int(line.split("the longest that fits is ")[1].split(";")[0].replace(",", ""))
    assert 16_000 < longest < 40_000
    # the estimate is exact: that length starts, one token more does not
    fits = plan_json(
        "--model-config",
        str(LLAMA_8B),
        "--gpu",
        "l4",
        "--max-model-len",
        str(longest),
        capsys=capsys,
    )
    assert fits["num_blocks"] - 1 >= fits["blocks_per_sequence"]  # the null block held back
    refused(
        "--model-config",
        str(LLAMA_8B),
        "--gpu",
        "l4",
        "--max-model-len",
        str(longest + 1),
        capsys=capsys,
    )
    # the same check on KV memory given directly
    line = refused("--model-config", str(LLAMA_8B), "--kv-cache-memory-gib", "1", capsys=capsys)
    assert "it needs 16.00 GiB, 1.00 GiB is available" in line


def test_no_memory_left_for_the_kv_cache(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(
        "--model-config",
        str(CONFIGS / "llama-3.3-70b-instruct.json"),
        "--gpu",
        "h100",
        capsys=capsys,
    )
    assert "no memory left for the KV cache" in line
    assert "estimated from config.json: 70.55B parameters" in line
    assert "No available memory for the cache blocks" in line
    # four of them hold it
    four = plan_json(
        "--model-config",
        str(CONFIGS / "llama-3.3-70b-instruct.json"),
        "--gpu",
        "h100",
        "-tp",
        "4",
        capsys=capsys,
    )
    assert four["num_blocks"] > 0


def test_flags_that_cannot_go_together_and_unknown_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = refused("--model-config", str(QWEN), "--gpu", "b200", capsys=capsys)
    assert "unknown GPU 'b200'" in line
    assert "known: a100-40gb, a100-80gb, h100-80gb, h200-141gb, l4-24gb, l40s-48gb" in line
    line = refused(
        "--model-config", str(QWEN), "--gpu", "h100", "--gpu-memory-gib", "80", capsys=capsys
    )
    assert "not allowed with argument" in line
    line = refused(
        "--model-config",
        str(QWEN),
        "--kv-cache-memory-gib",
        "4",
        "--weights-gib",
        "14",
        capsys=capsys,
    )
    assert "do not apply with --kv-cache-memory-gib" in line
    line = refused("--model-config", str(QWEN), "--weights-gib", "14", capsys=capsys)
    assert "need --gpu or --gpu-memory-gib" in line
    line = refused(
        "--model-config", str(QWEN), "--gpu", "h100", "--weights-gib", "-1", capsys=capsys
    )
    assert "--weights-gib must not be negative" in line
    line = refused(
        "--model-config",
        str(QWEN),
        "--gpu",
        "h100",
        "--gpu-memory-utilization",
        "1.5",
        capsys=capsys,
    )
    assert "GPU memory utilization must be in (0, 1], got 1.5" in line
    line = refused("--model-config", str(QWEN), "--max-num-seqs", "0", capsys=capsys)
    assert "--max-num-batched-tokens and --max-num-seqs must be positive" in line


def test_a_config_too_bare_to_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare = config(tmp_path)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["vocab_size"]
    (bare / "config.json").write_text(json.dumps(cfg))
    assert plan_json("--model-config", str(bare), capsys=capsys)["bytes_per_token"]  # no GPU
    line = refused("--model-config", str(bare), "--gpu", "l4", capsys=capsys)
    assert line.endswith("its config is missing 'vocab_size'; pass --weights-gib")
    line = refused("--model-config", str(bare), "--gpu", "l4", "--weights-gib", "3", capsys=capsys)
    assert line.endswith("its config is missing 'vocab_size'; pass --overhead-gib")
    given = ("--gpu", "l4", "--weights-gib", "3", "--overhead-gib", "1.5")
    out = plan_json("--model-config", str(bare), *given, capsys=capsys)
    assert out["kv_cache_memory_bytes"] == math.ceil((23_034 << 20) * 0.92) - int(4.5 * GIB)


# --- the flags it assumed ----------------------------------------------------------------------


def test_the_table_ends_with_the_vllm_serve_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = config(tmp_path)
    rc, out, err = plan(
        "--model-config",
        str(model),
        "--gpu",
        "a100-40gb",
        "-tp",
        "2",
        "--kv-cache-dtype",
        "fp8",
        "--max-model-len",
        "4096",
        capsys=capsys,
    )
    assert rc == 0, err
    assert (
        "GPU memory (as the driver reports)  40.00 GiB (a100-40gb: NVIDIA A100 SXM4 40 GB)" in out
    )
    assert "(estimated from config.json: " in out
    assert out.rstrip().splitlines()[-1] == (
        f"assumes: vllm serve {model} --tensor-parallel-size 2 --max-model-len 4096 "
        "--block-size 16 --kv-cache-dtype fp8 --gpu-memory-utilization 0.92 "
        "--max-num-batched-tokens 2048 --max-num-seqs 256"
    )
    js = plan_json(
        "--model-config",
        str(model),
        "--kv-cache-memory-gib",
        "2",
        "-pp",
        "2",
        "--max-concurrent-batches",
        "1",
        capsys=capsys,
    )
    assert js["vllm_serve_args"] == [
        "--tensor-parallel-size",
        "1",
        "--pipeline-parallel-size",
        "2",
        "--max-model-len",
        "8192",
        "--block-size",
        "16",
        "--kv-cache-dtype",
        "auto",
        "--kv-cache-memory-bytes",
        str(2 << 30),
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "1024",
        "--no-async-scheduling",
    ]


@pytest.mark.vllm
def test_vllm_turns_the_printed_flags_into_the_same_pool(tmp_path: Path) -> None:
    """The flags plan prints, parsed by vLLM's own `vllm serve` parser and sized by its own KV
    code on the simulated GPU (``harness.sim_vllm.dry_run``): the pool plan predicted."""
    from harness.vllm_cpu import vllm_python

    cases = [
        (ROOT / "harness/models/qwen2.5-7b-instruct.json", "l40s", ["--max-model-len", "16384"]),
        (ROOT / "harness/models/llama-3.1-8b-instruct.json", "a100-40gb", ["-tp", "2"]),
    ]
    plans, argvs = [], []
    for path, name, extra in cases:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "sidecar",
                "plan",
                "--model-config",
                str(path),
                "--gpu",
                name,
                *extra,
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        figures = json.loads(proc.stdout)
        plans.append(figures)
        argvs.append(["--gpu", name, "--model-config", str(path), *figures["vllm_serve_args"]])
    script = (
        "import json, sys\n"
        "from harness.sim_vllm import dry_run\n"
        "print('SIM-POOLS ' + json.dumps([dry_run(a) for a in json.loads(sys.argv[1])]))\n"
    )
    proc = subprocess.run(
        [str(vllm_python()), "-c", script, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("SIM-POOLS ")]
    for figures, pool in zip(plans, json.loads(line.removeprefix("SIM-POOLS ")), strict=True):
        assert pool["max_model_len"] == figures["max_model_len"]
        assert pool["max_num_seqs"] == figures["max_num_seqs"]
        assert pool["max_num_batched_tokens"] == figures["max_num_batched_tokens"]
        assert pool["kv_cache_memory_bytes"] == figures["kv_cache_memory_bytes"]
        assert pool["num_gpu_blocks"] == figures["num_blocks"]
