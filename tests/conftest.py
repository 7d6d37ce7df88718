"""Shared fixtures: the real vLLM (CPU build, generated model), the generated model's tokenizer
and fixture-file helpers.

The ``vllm`` fixture starts one vLLM server per test session with a small fixed KV pool (64
blocks of 128 tokens). Set ``KV_SIDECAR_TEST_VLLM_URL`` to run the same tests against a vLLM
that is already running (for example the GPU build with a real model); ``KV_SIDECAR_TEST_MODEL_DIR``
then names its model directory when it is readable from here. Either way the tests take the
served model's name, its context, block size, pool and bytes per block from the server
(:class:`harness.vllm_info.VllmInfo`), never from the generated model.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from harness.vllm_cpu import VllmServer, ensure_tokenizer_model
from harness.vllm_info import VllmInfo, describe_vllm

if TYPE_CHECKING:
    from sidecar.counting import ModelTokenizer

__all__ = ["FIXTURES", "SESSION_BLOCKS", "VllmInfo"]

#: The helpers the test modules share live in tests/support/ (never in another test module):
#: pytest rewrites the asserts of test modules and conftest files only, so that a helper's
#: failed assert reports its operands as it did in the test module it came from.
pytest.register_assert_rewrite("tests.support")

#: fixtures of a fake vLLM that several test modules share (a module's own fixture of the same
#: name still takes precedence)
pytest_plugins = ["tests.support.fake_upstream"]

FIXTURES = Path(__file__).parent / "fixtures"

#: Captured data and the scripts that captured it (they run in the vLLM venv and import vllm):
#: never test modules, and ``--doctest-modules`` must not import them.
collect_ignore = ["fixtures"]

#: Most tests here were written for the zero-preemption guarantee and count blocks as
#: worst-case mode reserves them: every sidecar the suite builds or starts (in-process Settings
#: and SidecarProcess inherit the environment) runs in that mode unless a test names another.
#: The default itself (adaptive) is asserted in tests/test_cli.py with this variable removed,
#: and the tests of adaptive admission pass --reservation adaptive.
os.environ.setdefault("KV_SIDECAR_RESERVATION", "worst-case")

#: The session server's KV pool: small enough that a burst of long requests preempts.
SESSION_BLOCKS = 64


@pytest.fixture(scope="session")
def vllm() -> Iterator[VllmInfo]:
    """A running real vLLM: started here (CPU build, 64 blocks) or the one at the env URL."""
    external = os.environ.get("KV_SIDECAR_TEST_VLLM_URL")
    if external:
        model_dir = os.environ.get("KV_SIDECAR_TEST_MODEL_DIR")
        yield describe_vllm(external, model_dir=Path(model_dir) if model_dir else None)
        return
    # --enable-scale-out: vLLM serves its render endpoints, which sidecars count prompts with
    server = VllmServer(num_gpu_blocks=SESSION_BLOCKS, extra_args=["--enable-scale-out"])
    server.start()
    try:
        info = server.info()
        warm_up(info)
        yield info
    finally:
        server.stop()


def warm_up(info: VllmInfo) -> None:
    """Eight short streamed answers at once, sent straight to a fresh vLLM.

    The first batch a fresh vLLM CPU server decodes was seen to hold every stream back: in one
    fresh-clone CI run the session's first test got all eight of its streams' tokens at their
    end, 2 s later, so that the eight had ended before the test could see them running. The
    warm-up pays that once, before any test measures anything (tests read vLLM's counters as
    differences, never as absolute values).
    """

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(k: int) -> None:
                body = {
                    "model": info.served_name,
                    "prompt": f"warm up {k} " * 40,
                    "max_tokens": 32,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with client.stream("POST", info.url + "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass

            await asyncio.gather(*(one(k) for k in range(8)))

    asyncio.run(run())


@pytest.fixture
def fixture_text() -> Iterator[object]:
    def read(*parts: str) -> str:
        return FIXTURES.joinpath(*parts).read_text()

    yield read


@pytest.fixture(scope="session")
def tiny_tokenizer() -> ModelTokenizer:
    """The generated test model's tokenizer, without starting vLLM."""
    from sidecar.counting import ModelTokenizer

    return ModelTokenizer.load(ensure_tokenizer_model())
