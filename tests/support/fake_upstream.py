"""Fixtures of a fake vLLM (``harness.fake_vllm``) for test modules that start sidecars in front
of one: a tiny model directory and one server per module, given a fresh app per test. A module
takes them with ``from tests.support.fake_upstream import model_dir, server, upstream``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[FakeServer]:
    with FakeServer(FakeVllm(model_root=model_dir)) as s:
        yield s


@pytest.fixture
def upstream(server: FakeServer, model_dir: Path) -> FakeServer:
    """The module's server, serving a fresh fake vLLM (its state reset) for this test."""
    server.app = FakeVllm(model_root=model_dir)
    return server.start()
