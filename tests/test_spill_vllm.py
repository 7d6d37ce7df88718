"""``--policy spill`` in front of the real vLLM (CPU build, the session server): a burst over the
KV budget sent at once. What fits is forwarded; every other request would wait for an answer of
700 tokens to end (hundreds of decode steps, or, before vLLM has started the ones admitted, a
wait the trajectories cannot bound), so each is refused at once with 429 ``spilled`` and both
retry headers, and none is queued; vLLM never preempts.

Nothing here samples the free-running engine: the decisions are made within the first moments
of the burst, when the shortest wait is an answer's whole run (at least 700 steps: seconds on any
machine this runs on, against ``--spill-wait 2``). A short wait that queues is asserted on the
stepped simulated engine (tests/test_spill_sim.py), where it can be made exactly.
"""

from __future__ import annotations

import asyncio

import pytest

from harness.workload import SidecarProcess, burst, make_prompts
from tests.conftest import VllmInfo
from tests.support.external import unless_external
from tests.support.vllm_idle import idle_preemptions

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 271
MAX_TOKENS = 700
REQUESTS = 20


def counts(sc: SidecarProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in sc.metrics().splitlines():
        if line.startswith("kv_sidecar_requests_total{"):
            labels, value = line.split("{", 1)[1].split("} ")
            pairs = dict(p.split("=", 1) for p in labels.split(","))
            out[f"{pairs['decision'].strip(chr(34))}/{pairs['reason'].strip(chr(34))}"] = float(
                value
            )
    return out


def test_a_burst_beyond_the_budget_is_spilled_at_once_not_queued(vllm: VllmInfo) -> None:
    assert vllm.model_dir is not None, "set KV_SIDECAR_TEST_MODEL_DIR for an external vLLM"
    if vllm.max_model_len < PROMPT_TOKENS + MAX_TOKENS:
        unless_external(f"a context of {vllm.max_model_len} tokens is too short for this burst")
    each = vllm.blocks_for(PROMPT_TOKENS + MAX_TOKENS)
    if REQUESTS * each <= vllm.num_gpu_blocks:
        unless_external(f"{REQUESTS} requests of {each} blocks fit a pool of {vllm.num_gpu_blocks}")
    prompts = make_prompts(vllm.model_dir, REQUESTS, PROMPT_TOKENS, seed=41)
    before = idle_preemptions(vllm.url)
    with SidecarProcess(vllm.url, "--policy", "spill", "--spill-wait", "2") as sc:
        results = asyncio.run(burst(sc.url, prompts, max_tokens=MAX_TOKENS, model=vllm.served_name))
        decided = counts(sc)
    served = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    assert len(served) + len(refused) == REQUESTS, [(r.status, r.error) for r in results]
    assert 1 <= len(served) < REQUESTS
    assert all(r.completion_tokens == MAX_TOKENS for r in served)
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert int(r.headers["retry-after-ms"]) >= 1000
    assert decided.get("reject/spilled") == len(refused)
    assert decided.get("admit/queued", 0) == 0  # none was kept waiting
    assert decided.get("admit/fits") == len(served)
    assert idle_preemptions(vllm.url) == before
