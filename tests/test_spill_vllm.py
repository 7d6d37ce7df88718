"""``--policy spill`` in front of the real vLLM (CPU build, the session server): a burst over the
KV budget sent at once. What fits is forwarded; every other request would wait for an answer of
700 tokens to end, so each is refused at once with 429 ``spilled`` and both retry headers, and
none is queued; vLLM never preempts.

The burst arrives with vLLM's engine stopped (``tests/support/stepped.frozen_engine``), so no
answer starts or ends while it is decided. The requests admitted have not started, and are laid
out as starting now (``sidecar.kv.rows``, since ``819c648``): the wait for room behind them is
their 700 decode steps at the learned step time. With the default ``--spill-wait`` of 2 s that
was under the threshold on a host decoding this model at 2.5 ms a step or faster, and the
stragglers of the burst were queued (a fresh-clone CI run of ``674aacc``: 7 queued). So the
test runs with ``--spill-wait 0.1``: 700 steps are over it on any host slower than 0.15 ms a
step. A known wait, short (queued) and long (refused), is asserted on the stepped simulated
engine (tests/test_spill_sim.py), where it can be made exactly.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.workload import SidecarProcess, burst, make_prompts
from tests.conftest import VllmInfo
from tests.support.external import unless_external
from tests.support.stepped import frozen_engine
from tests.support.vllm_idle import idle_preemptions
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 271
MAX_TOKENS = 700
REQUESTS = 20
#: seconds: a wait of 700 decode steps is over it on any host slower than 0.15 ms a step
SPILL_WAIT = 0.1


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
    with SidecarProcess(vllm.url, "--policy", "spill", "--spill-wait", str(SPILL_WAIT)) as sc:
        fits = sc.state()["budget_blocks"] // each
        assert 1 <= fits < REQUESTS, sc.state()
        with ThreadPoolExecutor(1) as pool:
            with frozen_engine(vllm):
                sent = pool.submit(
                    asyncio.run,
                    burst(sc.url, prompts, max_tokens=MAX_TOKENS, model=vllm.served_name),
                )
                # every request decided (or queued) while no token can be made
                wait_for(
                    lambda: sum(counts(sc).values()) + sc.state()["queue_depth"] == REQUESTS,
                    f"the sidecar's decisions on all {REQUESTS} requests",
                    within=60,
                )
                decided = {k: v for k, v in counts(sc).items() if v}
                state = sc.state()
            results = sent.result(timeout=600)
    assert state["in_flight"] == fits and state["queue_depth"] == 0, state
    assert decided == {"admit/fits": fits, "reject/spilled": REQUESTS - fits}, decided
    served = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    assert len(served) == fits and len(refused) == REQUESTS - fits, [
        (r.status, r.error) for r in results
    ]
    assert all(r.completion_tokens == MAX_TOKENS for r in served)
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert int(r.headers["retry-after-ms"]) >= 1000
    assert idle_preemptions(vllm.url) == before
