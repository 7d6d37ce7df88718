"""The simulated engine's cost model (harness.sim_cost) and GPU table (harness.gpus): pure."""

from __future__ import annotations

import doctest
import json
import math
from pathlib import Path

import pytest

from harness import gpus, sim_cost
from harness.gpus import GIB, GPUS, gpu
from harness.sim_cost import ModelShape, SeqWork, memory_budget, step_cost

MODELS = Path(__file__).resolve().parent.parent / "harness" / "models"


def shape(name: str) -> ModelShape:
    return ModelShape.from_config(json.loads((MODELS / f"{name}.json").read_text()))


# (config, params in billions as published, active params, KV bytes per token at TP 1 and 8)
SHAPES = [
    # 32 layers x 8 KV heads x (128 + 128) x 2 bytes = 131,072; at TP 8 one KV head per rank
    ("llama-3.1-8b-instruct", 8.03, 8.03, 131_072, 16_384),
    # 80 layers x 8 x 256 x 2 = 327,680; TP 8: 80 x 1 x 256 x 2
    ("llama-3.1-70b-instruct", 70.55, 70.55, 327_680, 40_960),
    # 28 layers x 4 KV heads x 256 x 2 = 57,344; TP 8 keeps one head (max(1, 4 // 8))
    ("qwen2.5-7b-instruct", 7.62, 7.62, 57_344, 14_336),
    # MLA: 27 layers x (512 + 64) x 2 = 31,104, the latent is not split by TP
    ("deepseek-v2-lite-chat", 15.71, 2.66, 31_104, 31_104),
]


@pytest.mark.parametrize(("name", "params_b", "active_b", "kv_tp1", "kv_tp8"), SHAPES)
def test_model_shapes_match_published_sizes(
    name: str, params_b: float, active_b: float, kv_tp1: int, kv_tp8: int
) -> None:
    m = shape(name)
    assert m.params_total / 1e9 == pytest.approx(params_b, abs=0.01)
    assert m.params_active / 1e9 == pytest.approx(active_b, abs=0.01)
    assert m.kv_bytes_per_token(tp=1) == kv_tp1
    assert m.kv_bytes_per_token(tp=8) == kv_tp8
    assert m.weights_bytes(tp=8) == math.ceil(m.weights_bytes(tp=1) / 8)


def test_kv_cache_dtype_changes_the_element_size() -> None:
    assert shape("llama-3.1-8b-instruct").kv_bytes_per_token(kv_dtype_bytes=1) == 65_536


def test_a_moe_forward_reads_only_the_experts_its_tokens_were_routed_to() -> None:
    ds = shape("deepseek-v2-lite-chat")
    one = ds.weights_bytes_read(1) / ds.dtype_bytes
    # one token: everything always read plus 6 of 64 experts in each of the 26 MoE layers
    assert one == pytest.approx(ds.params_active)
    # many tokens touch every expert: the whole model
    assert ds.weights_bytes_read(10_000) == pytest.approx(ds.weights_bytes())
    dense = shape("llama-3.1-8b-instruct")
    assert dense.weights_bytes_read(1) == dense.weights_bytes_read(4096) == dense.weights_bytes()


H100 = GPUS["h100-80gb"]
BW = H100.hbm_bytes_per_second * sim_cost.HBM_EFFICIENCY
LINEAR = H100.bf16_dense_flops_per_second * sim_cost.LINEAR_FLOPS_EFFICIENCY
ATTN = H100.bf16_dense_flops_per_second * sim_cost.ATTENTION_FLOPS_EFFICIENCY
W8 = 8_029_995_008 * 2  # Llama-3.1-8B's bf16 weights
PAIR8 = 2 * 32 * 32 * 256  # FLOPs per (query, key) pair: layers x heads x (Q.K + P.V)

# (batch, expected linear seconds, expected attention seconds) for Llama-3.1-8B on one H100
STEPS = [
    # one decode token at context 1,000: the weights and 1,001 tokens of KV over HBM
    ([SeqWork(1, 1000)], W8 / BW, 1001 * 131_072 / BW),
    # 256 decodes at 4k context: the GEMMs just cross the ridge (0.6 x 989 / (0.7 x 3.35) =
    # 253 tokens) and become compute-bound; the batch's KV read dominates the step
    ([SeqWork(1, 4096)] * 256, 2 * 8_029_995_008 * 256 / LINEAR, 256 * 4097 * 131_072 / BW),
    # an 8k-token prefill from nothing: compute-bound, attention's causal pairs 8192 x 8193 / 2
    ([SeqWork(8192, 0)], 2 * 8_029_995_008 * 8192 / LINEAR, 8192 * 8193 // 2 * PAIR8 / ATTN),
    # a 512-token chunk after 1,536 computed tokens: pairs 512 x 1536 + 512 x 513 / 2
    (
        [SeqWork(512, 1536)],
        max(W8 / BW, 2 * 8_029_995_008 * 512 / LINEAR),
        max(2048 * 131_072 / BW, (512 * 1536 + 512 * 513 // 2) * PAIR8 / ATTN),
    ),
]


@pytest.mark.parametrize(("batch", "linear", "attention"), STEPS)
def test_step_cost_is_a_roofline_per_kernel_class(
    batch: list[SeqWork], linear: float, attention: float
) -> None:
    cost = step_cost(shape("llama-3.1-8b-instruct"), H100, batch)
    assert cost.linear_seconds == pytest.approx(linear, rel=1e-9)
    assert cost.attention_seconds == pytest.approx(attention, rel=1e-9)
    assert cost.allreduce_seconds == 0
    assert cost.seconds == pytest.approx(linear + attention + sim_cost.STEP_OVERHEAD_SECONDS)


def test_decode_on_an_h100_takes_about_seven_milliseconds_per_step() -> None:
    # 16.06 GB / (3.35 TB/s x 0.7) = 6.85 ms, + KV + overhead
    cost = step_cost(shape("llama-3.1-8b-instruct"), H100, [SeqWork(1, 1000)])
    assert cost.seconds == pytest.approx(0.0074, abs=0.0001)


def test_a_mixed_step_pays_the_weights_once() -> None:
    m = shape("llama-3.1-8b-instruct")
    decode = [SeqWork(1, 2000)] * 32
    chunk = [SeqWork(256, 0)]
    mixed = step_cost(m, H100, decode + chunk).seconds
    alone = step_cost(m, H100, decode).seconds + step_cost(m, H100, chunk).seconds
    assert max(step_cost(m, H100, decode).seconds, step_cost(m, H100, chunk).seconds) < mixed
    assert mixed < alone


def test_an_empty_step_costs_nothing() -> None:
    assert step_cost(shape("llama-3.1-8b-instruct"), H100, []).seconds == 0
    assert step_cost(shape("llama-3.1-8b-instruct"), H100, [SeqWork(0, 100)]).seconds == 0


def test_tensor_parallel_divides_per_rank_and_adds_all_reduces() -> None:
    m = shape("llama-3.1-70b-instruct")
    tp1 = step_cost(m, H100, [SeqWork(1, 1000)], tp=1)
    tp8 = step_cost(m, H100, [SeqWork(1, 1000)], tp=8)
    assert tp8.linear_seconds == pytest.approx(tp1.linear_seconds / 8)
    assert tp8.attention_seconds == pytest.approx(tp1.attention_seconds / 8)
    # 2 all-reduces per layer, each at least the latency
    assert tp8.allreduce_seconds >= 2 * 80 * sim_cost.ALLREDUCE_LATENCY_SECONDS
    assert tp1.allreduce_seconds == 0


@pytest.mark.parametrize(
    ("gpu_name", "decode_seconds"),
    # the 8B's weights over each GPU's bandwidth x 0.7, + KV at context 1,000 + 0.5 ms
    [("h100-80gb", 0.007405), ("h200-141gb", 0.005319), ("a100-80gb", 0.011844)],
)
def test_faster_memory_decodes_faster(gpu_name: str, decode_seconds: float) -> None:
    cost = step_cost(shape("llama-3.1-8b-instruct"), gpu(gpu_name), [SeqWork(1, 1000)])
    assert cost.seconds == pytest.approx(decode_seconds, abs=2e-6)


# (GPU, model, TP, KV-cache bytes per rank at utilization 0.9 with the GPU's batch defaults)
BUDGETS = [
    ("h100-80gb", "llama-3.1-8b-instruct", 1, 58_046_126_490),
    ("h100-80gb", "llama-3.1-70b-instruct", 8, 56_551_905_690),
    ("h200-141gb", "llama-3.1-8b-instruct", 1, 116_756_735_591),
    ("a100-80gb", "qwen2.5-7b-instruct", 1, 60_479_766_528),
    ("h100-80gb", "deepseek-v2-lite-chat", 1, 43_150_580_122),
]


@pytest.mark.parametrize(("gpu_name", "model", "tp", "kv_bytes"), BUDGETS)
def test_memory_budget_as_a_gpu_worker_finds_it(
    gpu_name: str, model: str, tp: int, kv_bytes: int
) -> None:
    spec, m = gpu(gpu_name), shape(model)
    b = memory_budget(
        m,
        spec,
        tp=tp,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=spec.default_max_num_batched_tokens,
        max_num_seqs=spec.default_max_num_seqs,
    )
    assert b.requested_bytes == math.ceil(spec.memory_bytes * 0.9)
    assert b.weights_bytes == m.weights_bytes(tp)
    assert b.kv_cache_bytes == kv_bytes
    assert b.kv_cache_bytes == b.requested_bytes - b.non_kv_bytes


def test_a_70b_does_not_fit_one_h100() -> None:
    b = memory_budget(
        shape("llama-3.1-70b-instruct"),
        gpu("h100-80gb"),
        max_num_batched_tokens=8192,
        max_num_seqs=1024,
    )
    assert b.kv_cache_bytes < 0
    with pytest.raises(ValueError, match="utilization"):
        memory_budget(
            shape("llama-3.1-8b-instruct"),
            gpu("h100"),
            gpu_memory_utilization=1.5,
            max_num_batched_tokens=8192,
            max_num_seqs=1024,
        )


def test_gpu_names() -> None:
    assert gpu("H100") is GPUS["h100-80gb"]
    assert gpu("h200").memory_bytes == 143_771 * (1 << 20)
    assert GPUS["a100-80gb"].memory_bytes / GIB == 80.0
    with pytest.raises(
        ValueError, match="known: a100-40gb, a100-80gb, h100-80gb, h200-141gb, l4-24gb, l40s-48gb"
    ):
        gpu("b200")


@pytest.mark.parametrize("module", [gpus, sim_cost])
def test_doctests(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0


# --- checked against measured kernels: harness.gpu_probe's H200 runs, committed raw -----------

PROBES = Path(__file__).resolve().parent.parent / "bench" / "results" / "gpu-probe"


def probe(name: str, tp: int) -> dict[str, object]:
    return dict(json.loads((PROBES / f"probe-{name}-tp{tp}.json").read_text()))


def test_a_probe_case_is_the_batch_it_timed() -> None:
    from harness.sim_calibrate import probe_batch

    assert probe_batch({"kind": "decode", "batch": 3, "context": 512}) == [SeqWork(1, 511)] * 3
    assert probe_batch({"kind": "prefill", "sequences": 2, "tokens": 64}) == [SeqWork(64, 0)] * 2
    assert probe_batch({"kind": "chunk", "tokens": 64, "context": 128}) == [SeqWork(64, 128)]
    mixed = probe_batch({"kind": "mixed", "batch": 2, "context": 9, "tokens": 32})
    assert mixed == [SeqWork(1, 8), SeqWork(1, 8), SeqWork(32, 0)]
    with pytest.raises(ValueError, match="unknown probe case"):
        probe_batch({"kind": "sample"})


def test_a_probe_row_is_step_cost_without_the_all_reduce() -> None:
    from harness.sim_calibrate import probe_rows

    data = probe("llama-3.1-70b-instruct", 8)
    rows = probe_rows(data, "h200", "llama-3.1-70b-instruct")
    assert len(rows) == len(data["cases"])  # type: ignore[arg-type]
    m, spec = shape("llama-3.1-70b-instruct"), gpu("h200")
    first = rows[0]  # decode, batch 1, 512 tokens of context
    cost = step_cost(m, spec, [SeqWork(1, 511)], tp=8)
    assert first["allreduce_s"] == cost.allreduce_seconds > 0
    assert first["sim_s"] == pytest.approx(cost.seconds - cost.allreduce_seconds)
    assert first["sim_over_real"] == pytest.approx(first["sim_s"] / first["real_s"])


@pytest.mark.parametrize("name", ["llama-3.1-8b-instruct", "qwen2.5-7b-instruct"])
def test_the_cost_model_agrees_with_the_h200_kernels_at_tp_1(name: str) -> None:
    """The cost model's constants against one GPU's measured steps (docs/simulated-engine.md,
    Accuracy): at tensor parallel 1 the median simulated-to-measured ratio of the CUDA-graph
    decode steps and of the prefill, chunk and mixed steps stays within 20%. Fails when a
    constant moves the model off what the GPU did."""
    import statistics

    from harness.sim_calibrate import probe_rows

    rows = probe_rows(probe(name, 1), "h200", name)
    decode = [
        r["sim_over_real"]
        for r in rows
        if r["case"].startswith("kind=decode") and "graphs=0" not in r["case"]
    ]
    compute = [r["sim_over_real"] for r in rows if not r["case"].startswith("kind=decode")]
    assert len(decode) >= 15 and len(compute) >= 9
    assert 0.8 <= statistics.median(decode) <= 1.2
    assert 0.8 <= statistics.median(compute) <= 1.2


@pytest.mark.vllm
def test_the_gpu_probe_runs_every_kind_of_case(tmp_path: Path) -> None:
    """harness.gpu_probe's code paths on the CPU (``--small``), with the vLLM venv's PyTorch:
    every case is timed and none records an error, and the calibration prints them."""
    import subprocess

    from harness.sim_calibrate import probe_rows
    from harness.vllm_cpu import ensure_vllm

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 1000,
                "num_hidden_layers": 2,
            }
        )
    )
    out = tmp_path / "probe.json"
    argv = ["-m", "harness.gpu_probe", "--model-config", str(config), "--small"]
    argv += ["--out", str(out), "--iters", "2", "--repeats", "2"]
    root = Path(__file__).resolve().parent.parent
    python = str(ensure_vllm())
    subprocess.run([python, *argv], cwd=root, check=True, timeout=300)
    doctests = "import doctest, harness.gpu_probe as m; raise SystemExit(doctest.testmod(m).failed)"
    subprocess.run([python, "-c", doctests], cwd=root, check=True, timeout=300)
    data = json.loads(out.read_text())
    kinds = {c["kind"] for c in data["cases"]}
    assert kinds == {"decode", "prefill", "chunk", "mixed"}
    assert all("error" not in c and c["seconds"] > 0 for c in data["cases"]), data["cases"]
    rows = probe_rows(data, "h200", str(config))
    assert [r["tokens"] for r in rows] == [2, 4, 32, 16, 18]
    # --compiled: each decode case as it is and with its layer through torch.compile
    compiled = tmp_path / "compiled.json"
    argv = ["-m", "harness.gpu_probe", "--model-config", str(config), "--compiled", "2x16"]
    argv += ["--small", "--out", str(compiled), "--iters", "2", "--repeats", "2"]
    subprocess.run([python, *argv], cwd=root, check=True, timeout=600)
    cases = json.loads(compiled.read_text())["cases"]
    assert [c.get("compiled", 0) for c in cases] == [0, 1], cases
    assert all("error" not in c and c["seconds"] > 0 for c in cases), cases
