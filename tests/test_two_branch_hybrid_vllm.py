"""Two-branch hybrid models on the real vLLM: Falcon-H1, whose every decoder layer runs an
attention branch beside a Mamba 2 one (``FalconH1ParallelHybrid``), and Zamba2, a Mamba 2 mixer
in every layer and the shared attention block, with a cache of its own, in those its config
calls hybrid. vLLM keeps an attention cache and a recurrent state in separate groups of the
hybrid allocator (``sidecar.kv.layers``). Until d2790d9 the sidecar could not read such configs
and counted the models as full attention in one group: each request short of its state's
blocks.

The harness's ``falcon`` variant (``harness.tiny_model.VARIANTS``: two such layers) and its
``zamba`` variant (four Mamba 2 layers, two of them hybrid: one attention group of two layers,
two state groups of two), each with a 4k context, are served with prefix caching off (vLLM's
``mamba_cache_mode`` ``none``: a state group holds one block a request): with it on, vLLM
0.32's CPU Mamba 2 mixer fails its first batched step (``IndexError`` in ``conv_ssm_forward``),
on this build only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from harness.vllm_cpu import VllmServer, ensure_model
from harness.vllm_info import VllmInfo
from harness.workload import SidecarProcess, make_prompts
from sidecar.kv.geometry import cdiv
from tests.support.stepped import admitted, frozen_engine
from tests.support.vllm_geometry import vllm_geometry
from tests.support.vllm_idle import idle_preemptions

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 600
MAX_TOKENS = 3000
REQUESTS = 4
#: a pool whose budget (less the 5% headroom) holds two such requests with their state blocks
#: and three without
POOL = 93
#: per variant: (attention layers, state groups of how many layers each)
GROUPS = {"falcon": (2, [2]), "zamba": (2, [2, 2])}


@pytest.fixture(scope="module", params=sorted(GROUPS))
def falcon_vllm(request: pytest.FixtureRequest) -> Iterator[tuple[str, VllmInfo]]:
    server = VllmServer(
        num_gpu_blocks=POOL,
        max_model_len=4096,
        model_dir=ensure_model(variant=request.param),
        served_name=f"tiny-{request.param}",
        extra_args=["--no-enable-prefix-caching"],
    )
    with server:
        yield request.param, server.info()


def test_the_groups_are_vllm_s(falcon_vllm: tuple[str, VllmInfo]) -> None:
    """The geometry built from the config and vLLM's ``cache_config_info`` has one attention
    group and the state groups of two layers each, and gives vLLM's own startup figure,
    ``kv_cache_max_concurrency``: the pool over one request of the whole context, its pages
    and its states' blocks (one group of full attention alone gives another)."""
    variant, falcon_vllm = falcon_vllm
    geometry, info = vllm_geometry(falcon_vllm)
    assert info["mamba_cache_mode"] == "none", info
    attention, states = GROUPS[variant]
    assert sorted((g.state, g.num_layers) for g in geometry.groups) == sorted(
        [(False, attention)] + [(True, n) for n in states]
    )
    reported = float(info["kv_cache_max_concurrency"])
    blocks = int(info["num_gpu_blocks"])
    assert geometry.max_concurrency(blocks) == pytest.approx(reported)
    pages = cdiv(falcon_vllm.max_model_len, geometry.block_size)
    assert blocks / pages != pytest.approx(reported)  # the state's block counts


def test_worst_case_admits_what_the_pool_holds_with_the_state_blocks(
    falcon_vllm: tuple[str, VllmInfo],
) -> None:
    """Four 600-token prompts with 3,000 tokens to generate each, sent at once through
    worst-case mode: each is reserved at its pages and a block in each state group, so two run
    at once where the pages alone would have let three in; all four complete in full, and vLLM
    preempts nothing."""
    variant, falcon_vllm = falcon_vllm
    assert falcon_vllm.model_dir is not None
    states = len(GROUPS[variant][1])
    before = idle_preemptions(falcon_vllm.url)
    prompts = make_prompts(falcon_vllm.model_dir, REQUESTS, PROMPT_TOKENS, seed=5)
    answers: list[tuple[int, int]] = []

    def send(prompt: str) -> None:
        r = httpx.post(
            sc.url + "/v1/completions",
            json={
                "model": falcon_vllm.served_name,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
            },
            timeout=600,
        )
        tokens = r.json().get("usage", {}).get("completion_tokens", -1) if r.is_success else -1
        answers.append((r.status_code, tokens))

    with SidecarProcess(falcon_vllm.url, "--reservation", "worst-case", "--policy", "queue") as sc:
        threads = [threading.Thread(target=send, args=(p,), daemon=True) for p in prompts]
        with frozen_engine(falcon_vllm):
            for t in threads:
                t.start()
            state = admitted(sc, REQUESTS)
        block = falcon_vllm.block_size
        each = cdiv(PROMPT_TOKENS + MAX_TOKENS, block) + states  # pages and a block a state
        budget = state["budget_blocks"]
        assert state["in_flight"] == budget // each == 2 < budget // (each - states), (state, block)
        assert state["reserved_blocks"] == 2 * each, state
        for t in threads:
            t.join(timeout=600)
    assert answers == [(200, MAX_TOKENS)] * REQUESTS
    assert idle_preemptions(falcon_vllm.url) == before
