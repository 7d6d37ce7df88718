"""vLLM's own server on the simulated GPU (harness.sim_vllm): endpoints, lengths, pool, steps.

One server per module: Llama-3.1-8B's config on an H100 80 GB, sized by a low
``--gpu-memory-utilization`` (so the pool is small, and still sized as a GPU worker sizes it,
not pinned by ``--num-gpu-blocks-override``), with the control channel on. Tests that step the
engine by hand switch it to manual mode and back.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import sim_cost
from harness.gpus import gpu
from harness.sim_server import SimServer, model_config
from tests.support.sim import cache_config, metrics

pytestmark = pytest.mark.vllm

MODEL = "llama-3.1-8b-instruct"
GPU = "h100-80gb"
#: 0.22 x 79.65 GiB = 17.52 GiB requested - 17.02 GiB (weights, activations, other) leaves
#: about 0.5 GiB: 256 blocks of 16 tokens x 128 KiB per token.
UTILIZATION = 0.22
MAX_MODEL_LEN = 2048
BLOCK = 16
#: small enough that a prompt of the 2k context is prefilled in chunks
MAX_NUM_BATCHED_TOKENS = 1024


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimServer]:
    server = SimServer(
        model=MODEL,
        gpu=GPU,
        max_model_len=MAX_MODEL_LEN,
        trace=tmp_path_factory.mktemp("sim") / "steps.jsonl",
        extra_args=[
            "--gpu-memory-utilization",
            str(UTILIZATION),
            "--max-num-batched-tokens",
            str(MAX_NUM_BATCHED_TOKENS),
        ],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def complete(sim: SimServer, **body: Any) -> dict[str, Any]:
    body = {"model": sim.served_name, "prompt": "the cache block token", **body}
    resp = httpx.post(sim.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_it_starts_fast(sim: SimServer) -> None:
    assert sim.startup_seconds is not None
    # 11-27 s measured (idle to loaded 2-core machine); a bound that a busy CI run keeps
    assert sim.startup_seconds < 90, f"startup took {sim.startup_seconds:.1f} s"


def test_models_lists_the_served_model(sim: SimServer) -> None:
    models = httpx.get(sim.url + "/v1/models", timeout=10).json()
    (entry,) = models["data"]
    assert entry["id"] == MODEL
    assert entry["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("body", "tokens", "finish"),
    [
        ({"max_tokens": 100, "vllm_xargs": {"sim_output_tokens": 37}}, 37, "stop"),
        ({"max_tokens": 23}, 23, "length"),  # no length given: runs to max_tokens
        (
            {"max_tokens": 30, "ignore_eos": True, "vllm_xargs": {"sim_output_tokens": 10}},
            30,
            "length",
        ),
        ({"max_tokens": 5, "vllm_xargs": {"sim_output_tokens": 50}}, 5, "length"),
        ({"max_tokens": 40, "min_tokens": 20, "vllm_xargs": {"sim_output_tokens": 10}}, 20, "stop"),
        # a length that is not a number is ignored, and the engine lives on
        ({"max_tokens": 7, "vllm_xargs": {"sim_output_tokens": "many"}}, 7, "length"),
    ],
)
def test_a_request_ends_where_the_workload_says(
    sim: SimServer, body: dict[str, Any], tokens: int, finish: str
) -> None:
    answer = complete(sim, **body)
    assert answer["usage"]["completion_tokens"] == tokens
    assert answer["choices"][0]["finish_reason"] == finish


def test_log_probs_come_back_for_the_tokens_sampled(sim: SimServer) -> None:
    answer = complete(sim, max_tokens=4, logprobs=2, vllm_xargs={"sim_output_tokens": 50})
    lp = answer["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [0.0] * 4
    assert all(len(top) == 3 for top in lp["top_logprobs"])


def test_a_streamed_chat_ends_at_its_length(sim: SimServer) -> None:
    body = {
        "model": sim.served_name,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "vllm_xargs": {"sim_output_tokens": 12},
    }
    usage = None
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == 12


def test_a_sidecar_in_front_sees_the_gpu_pool_and_passes_the_length_through(
    sim: SimServer,
) -> None:
    from harness.vllm_cpu import free_port

    port, metrics_port = free_port(), free_port()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "sidecar", "serve",
            "--upstream", sim.url,
            "--port", str(port),
            "--metrics-port", str(metrics_port),
            "--model-config", str(sim.model_dir),
        ],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).status_code:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "the sidecar exited"
            assert time.monotonic() < deadline, "the sidecar did not start"
            time.sleep(0.2)
        body = {
            "model": sim.served_name,
            "prompt": "through the sidecar",
            "max_tokens": 100,
            "vllm_xargs": {"sim_output_tokens": 17},
        }
        deadline = time.monotonic() + 60
        while True:  # until the sidecar has discovered vLLM and admits
            resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 17  # the sidecar saw max_tokens 100
        exposed = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        capacity = {
            s.name: s.value
            for f in text_string_to_metric_families(exposed)
            for s in f.samples
            if s.name == "kv_sidecar_kv_capacity_blocks"
        }
        # vLLM's pool less its null block
        assert capacity == {
            "kv_sidecar_kv_capacity_blocks": int(cache_config(sim)["num_gpu_blocks"]) - 1
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_stream_batched_by_stream_interval_is_counted_by_vllms_count(sim: SimServer) -> None:
    """A request's ``stream_interval`` makes vLLM send one event per 50 tokens: counted by its
    events the sidecar saw 32 tokens of a 1,500-token answer. Asked for the usage on every event
    (``--stream-usage``, the default), it counts all 1,500, and the client, which asked for
    none, gets no usage."""
    from harness.workload import SidecarProcess, metric_value
    from tests.support.wait import wait_for

    body = {
        "model": sim.served_name,
        "prompt": "through the sidecar",
        "max_tokens": 1600,
        "stream": True,
        "stream_interval": 50,
        "vllm_xargs": {"sim_output_tokens": 1500},
    }
    with SidecarProcess(sim.url, "--model-config", str(sim.model_dir)) as sc:
        with httpx.stream("POST", sc.url + "/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            events = [line for line in resp.iter_lines() if line.startswith("data: {")]
        assert len(events) < 100  # batched: one event for many tokens
        assert not any('"usage"' in e for e in events)
        wait_for(lambda: sc.state()["in_flight"] == 0, "the stream released", 30)
        counted = metric_value(sc.metrics(), "kv_sidecar_completion_tokens_total")
    assert counted == 1500


def test_the_calibration_script_compares_two_servers(
    sim: SimServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its plumbing, with the simulation standing in for the real engine (no GPU here)."""
    from harness import sim_calibrate

    argv = ["--real-url", sim.url, "--sim-url", sim.url, "--concurrency", "1,2"]
    argv += ["--requests", "1", "--input-len", "64", "--output-len", "8", "--json"]
    assert sim_calibrate.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    figures = {(r["concurrency"], r["figure"]) for r in rows}
    assert figures == {
        (c, f)
        for c in (1, 2)
        for f in ("itl_step_s", "prefill_s", "ttft_s", "tpot_s", "latency_s", "output_tok_per_s")
    }
    # every figure measured on both sides (their ratio is timing on a shared machine: not
    # asserted)
    assert all(r["real"] and r["sim"] and r["sim_slower"] for r in rows), rows


def expected_budget() -> sim_cost.MemoryBudget:
    spec = gpu(GPU)
    shape = sim_cost.ModelShape.from_config(json.loads(model_config(MODEL).read_text()))
    return sim_cost.memory_budget(
        shape,
        spec,
        gpu_memory_utilization=UTILIZATION,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=spec.default_max_num_seqs,
    )


def test_the_pool_agrees_with_kv_sidecar_plan(sim: SimServer) -> None:
    labels = cache_config(sim)
    assert labels["block_size"] == str(BLOCK)
    assert labels["num_gpu_blocks_override"] == "None"
    budget = expected_budget()
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "plan",
            "--model-config",
            str(model_config(MODEL)),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--block-size",
            str(BLOCK),
            "--gpu",
            GPU,
            "--gpu-memory-utilization",
            str(UTILIZATION),
            "--max-num-batched-tokens",
            str(MAX_NUM_BATCHED_TOKENS),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    figures = json.loads(plan.stdout)
    # plan --gpu reads nothing else: the weights from the config's parameter count, the
    # activation peak and other memory from the same estimates the simulated worker uses
    assert figures["weights_bytes"] == budget.weights_bytes
    assert figures["activation_bytes"] + figures["other_bytes"] == (
        budget.activation_bytes + budget.other_bytes
    )
    assert int(labels["num_gpu_blocks"]) == figures["num_blocks"]
    assert figures["num_blocks"] == budget.kv_cache_bytes // figures["bytes_per_block"]
    assert 200 < figures["num_blocks"] < 300  # the small pool the other tests rely on


def test_the_clock_is_the_cost_model(sim: SimServer) -> None:
    shape = sim_cost.ModelShape.from_config(json.loads(model_config(MODEL).read_text()))
    before = sim.state()
    started = time.monotonic()
    answer = complete(sim, prompt="roofline clock " * 20, max_tokens=60)
    elapsed = time.monotonic() - started
    prompt = answer["usage"]["prompt_tokens"]
    steps = [[sim_cost.SeqWork(prompt, 0)]] + [[sim_cost.SeqWork(1, prompt + i)] for i in range(59)]
    expected = sum(step_cost_seconds(shape, batch) for batch in steps)
    after = sim.state()
    assert after["steps"] - before["steps"] == 60
    # prefix caching could skip part of the prompt: the exact figure then differs; this
    # prompt is used once per server, so every token is computed
    assert after["simulated_seconds"] - before["simulated_seconds"] == pytest.approx(expected)
    assert elapsed >= 0.95 * expected  # real time: sleeping never runs faster


def step_cost_seconds(shape: sim_cost.ModelShape, batch: list[sim_cost.SeqWork]) -> float:
    return sim_cost.step_cost(shape, gpu(GPU), batch).seconds


def wait_for_generated(sim: SimServer, total: float, timeout: float = 30.0) -> dict[str, float]:
    """The first scrape whose generation-token counter has reached ``total``."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(sim)
        if m.get("vllm:generation_tokens_total", 0) >= total:
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm:generation_tokens_total never reached {total}: {m}")
        time.sleep(0.01)


def test_each_step_moves_kv_usage_by_exactly_the_blocks_expected(sim: SimServer) -> None:
    num_blocks = int(cache_config(sim)["num_gpu_blocks"])
    length = 40
    prompt = "stepwise unique prompt " * 7
    base = metrics(sim)
    generated0 = base.get("vllm:generation_tokens_total", 0)
    assert base["vllm:kv_cache_usage_perc"] == 0
    answers: list[dict[str, Any]] = []
    sim.set_mode("manual")
    try:
        thread = threading.Thread(
            target=lambda: answers.append(
                complete(
                    sim, prompt=prompt, max_tokens=64, vllm_xargs={"sim_output_tokens": length}
                )
            )
        )
        thread.start()
        state0 = sim.wait_waiting()  # the prefill is scheduled and waits
        steps0 = state0["steps"]
        tokens = httpx.post(
            sim.url + "/tokenize", json={"model": sim.served_name, "prompt": prompt}, timeout=10
        ).json()["count"]
        held = []
        for k in range(1, length + 1):
            sim.step(1)
            m = wait_for_generated(sim, generated0 + k)
            assert m["vllm:generation_tokens_total"] == generated0 + k
            held.append(round(m["vllm:kv_cache_usage_perc"] * (num_blocks - 1)))
        thread.join(timeout=30)
        # after step k the request holds the blocks of the tokens computed so far: the prompt
        # and the k - 1 tokens fed back; the EOS at step `length` ends it and frees them all
        expected = [math.ceil((tokens + k - 1) / BLOCK) for k in range(1, length)] + [0]
        assert held == expected
        assert len(set(expected)) >= 3  # the test crossed block boundaries
        assert sim.state()["steps"] - steps0 == length
        # the test's pauses between grants are not the engine's lag
        assert sim.state()["cpu_lag_seconds"] == state0["cpu_lag_seconds"]
        assert answers and answers[0]["usage"]["completion_tokens"] == length
        assert answers[0]["usage"]["prompt_tokens"] == tokens
    finally:
        sim.set_mode("roofline")


def wait_for_usage(sim: SimServer, blocks: int, num_blocks: int, timeout: float = 30.0) -> None:
    """Until vLLM's KV usage reads ``blocks`` held (the engine is held still in manual mode, so
    the gauge settles on the value after the last step)."""
    deadline = time.monotonic() + timeout
    while True:
        held = round(metrics(sim)["vllm:kv_cache_usage_perc"] * (num_blocks - 1))
        if held == blocks:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV usage reads {held} blocks, expected {blocks}")
        time.sleep(0.01)


def test_a_chunked_prefill_samples_only_at_its_last_chunk(sim: SimServer) -> None:
    num_blocks = int(cache_config(sim)["num_gpu_blocks"])
    prompt = "chunked prefill of a long prompt " * 120
    tokens = httpx.post(
        sim.url + "/tokenize", json={"model": sim.served_name, "prompt": prompt}, timeout=10
    ).json()["count"]
    chunks = math.ceil(tokens / MAX_NUM_BATCHED_TOKENS)
    assert chunks >= 2 and tokens + 3 <= MAX_MODEL_LEN
    assert sim.trace is not None
    traced = sim.trace.stat().st_size if sim.trace.exists() else 0
    answers: list[dict[str, Any]] = []
    sim.set_mode("manual")
    try:
        thread = threading.Thread(
            target=lambda: answers.append(
                complete(sim, prompt=prompt, max_tokens=3, vllm_xargs={"sim_output_tokens": 3})
            )
        )
        thread.start()
        sim.wait_waiting()
        for c in range(1, chunks + 1):
            last = sim.step(1)["last_step"]
            computed = min(c * MAX_NUM_BATCHED_TOKENS, tokens)
            assert last["tokens"] == computed - (c - 1) * MAX_NUM_BATCHED_TOKENS
            assert last["sampled"] == (1 if c == chunks else 0)  # no token for a partial chunk
            wait_for_usage(sim, math.ceil(computed / BLOCK), num_blocks)
        for _ in range(2):  # two decode steps, the second samples the EOS
            last = sim.step(1)["last_step"]
            assert (last["tokens"], last["sampled"]) == (1, 1)
        thread.join(timeout=30)
        assert answers and answers[0]["usage"]["completion_tokens"] == 3
        wait_for_usage(sim, 0, num_blocks)
    finally:
        sim.set_mode("roofline")
    # the step trace (KV_SIDECAR_SIM_TRACE): the request new in the first chunk's step, each
    # chunk's tokens at the context computed before it, then two decode steps
    with open(sim.trace, encoding="utf-8") as fh:
        fh.seek(traced)
        steps = [json.loads(line) for line in fh]
    assert len(steps) == chunks + 2
    (req_id, prompt), *others = steps[0]["new"]
    assert prompt == tokens and not others
    chunk = MAX_NUM_BATCHED_TOKENS
    work = [[[req_id, min(chunk, tokens - c), c]] for c in range(0, tokens, chunk)]
    work += [[[req_id, 1, tokens]], [[req_id, 1, tokens + 1]]]
    assert [step["work"] for step in steps] == work
    assert all(not step["new"] for step in steps[1:])
    clock = [(step["simulated"], step["seconds"]) for step in steps]
    assert all(s + d == pytest.approx(t) for (s, d), (t, _) in itertools.pairwise(clock))


def in_engine(sim: SimServer) -> float:
    m = metrics(sim)
    return m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)


def test_a_burst_over_the_pool_preempts(sim: SimServer) -> None:
    """Deterministic: the engine is held in manual mode until the whole burst is inside it (no
    request can end first, however slowly this machine sends them), then runs at 1 ms a step."""
    num_blocks = int(cache_config(sim)["num_gpu_blocks"])
    before = metrics(sim).get("vllm:num_preemptions_total", 0)
    state0 = sim.state()
    count, output = 16, 400
    # each request reaches about (200 + 400) / 16 = 38 blocks; 16 of them want ~600 > the pool
    prompts = [f"burst {i} " + "the cache block token " * 40 for i in range(count)]
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def one(prompt: str) -> None:
        try:
            results.append(
                complete(
                    sim, prompt=prompt, max_tokens=600, vllm_xargs={"sim_output_tokens": output}
                )
            )
        except BaseException as exc:
            errors.append(exc)

    sim.set_mode("manual")
    try:
        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        # one step at a time lets the engine take in what arrived; a request needs 400 steps to
        # end, so all 16 are inside long before any could finish
        while in_engine(sim) < count:
            assert time.monotonic() < deadline, f"{in_engine(sim)} of {count} reached vLLM"
            assert not errors, errors
            if sim.state()["waiting"]:
                sim.step(1)
            else:
                time.sleep(0.01)
        sim.set_mode("0.001")  # a fixed 1 ms step: the burst's ~500 steps take seconds
        for t in threads:
            t.join(timeout=120)
    finally:
        sim.set_mode("roofline")
    assert not errors, errors
    assert len(results) == count
    assert all(r["usage"]["completion_tokens"] == output for r in results)
    demand = sum(math.ceil((r["usage"]["prompt_tokens"] + output) / BLOCK) for r in results)
    assert demand > 2 * num_blocks
    after = metrics(sim)["vllm:num_preemptions_total"]
    assert after > before
    # each preemption is paid for by computing the request again when it resumes: at least
    # its last token (what the prefix cache kept is not computed again), at most its prompt
    # and all it had generated; the cost model prices those tokens
    state = sim.state()
    recomputed = state["recomputed_tokens"] - state0["recomputed_tokens"]
    longest = max(r["usage"]["prompt_tokens"] for r in results) + output
    assert after - before <= recomputed <= (after - before) * longest, (recomputed, after - before)
    assert state["recompute_seconds"] > state0["recompute_seconds"]


#: (config, GPU, tensor parallel, max model len): the pools the issue names, each sized by
#: vLLM's own code (``python -m harness.sim_vllm --sim-dry-run``), none served
POOLS = [
    ("llama-3.1-8b-instruct", "h100-80gb", 1, 8192),
    ("qwen2.5-7b-instruct", "a100-80gb", 1, 32768),
    ("llama-3.1-70b-instruct", "h100-80gb", 8, 32768),
    ("llama-3.1-70b-instruct", "h200-141gb", 4, 32768),
    ("deepseek-v2-lite-chat", "h200-141gb", 1, 32768),
]


def test_pools_at_scale_agree_with_kv_sidecar_plan() -> None:
    from harness.vllm_cpu import vllm_python

    argvs = [
        [
            "--gpu",
            g,
            "--model-config",
            str(model_config(m)),
            "-tp",
            str(tp),
            "--max-model-len",
            str(mml),
        ]
        for m, g, tp, mml in POOLS
    ]
    # and vLLM's own overrides of the sizing, as on a GPU
    overridden = [
        ["--model-config", str(model_config(MODEL)), "--max-model-len", "1024", *extra]
        for extra in (
            ["--num-gpu-blocks-override", "100"],
            ["--kv-cache-memory-bytes", str(1 << 30)],
        )
    ]
    argvs += overridden
    script = (
        "import json, sys\n"
        "from harness.sim_vllm import dry_run\n"
        "print('SIM-POOLS ' + json.dumps([dry_run(a) for a in json.loads(sys.argv[1])]))\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [str(vllm_python()), "-c", script, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("SIM-POOLS ")]
    *pools, blocks_override, memory_override = json.loads(line.removeprefix("SIM-POOLS "))
    assert blocks_override["num_gpu_blocks"] == 100
    # 1 GiB over 2 MiB blocks (16 tokens x 128 KiB)
    assert memory_override["kv_cache_memory_bytes"] == 1 << 30
    assert memory_override["num_gpu_blocks"] == 512
    for (model, gpu_name, tp, mml), pool in zip(POOLS, pools, strict=True):
        spec = gpu(gpu_name)
        assert pool["block_size"] == BLOCK
        assert pool["max_num_batched_tokens"] == spec.default_max_num_batched_tokens
        assert pool["max_num_seqs"] == spec.default_max_num_seqs
        plan = subprocess.run(
            [
                sys.executable,
                "-m",
                "sidecar",
                "plan",
                "--model-config",
                str(model_config(model)),
                "-tp",
                str(tp),
                "--max-model-len",
                str(mml),
                "--block-size",
                str(BLOCK),
                "--gpu",
                gpu_name,
                "--gpu-memory-utilization",
                str(pool["gpu_memory_utilization"]),
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
        )
        figures = json.loads(plan.stdout)
        # the same model and GPU, nothing else given: the same weights, the same pool
        assert figures["weights_bytes"] == pool["weights_bytes"], (model, gpu_name, tp)
        assert figures["kv_cache_memory_bytes"] == pool["kv_cache_memory_bytes"]
        assert pool["num_gpu_blocks"] == figures["num_blocks"], (model, gpu_name, tp)
        # at the scale users run: tens of thousands of blocks
        assert pool["num_gpu_blocks"] > 20_000, (model, gpu_name, tp, pool)
