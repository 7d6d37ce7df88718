"""Fixtures of a fake vLLM (``harness.fake_vllm``) for test modules that start sidecars in front
of one: a tiny model directory and one server per module, given a fresh app per test. They are
registered for every test module from tests/conftest.py (``pytest_plugins``); a module's own
fixture of the same name takes precedence, and the shared ones then build on it (a module that
overrides ``model_dir`` gets ``server`` and ``upstream`` on its model directory).

:func:`serve_fresh` is what ``upstream`` does, for a module whose fresh fake differs (its own
knobs, or another server such as a second host on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.fake_vllm import FakeServer, FakeVllm, write_model_dir


def serve_fresh(server: FakeServer, app: FakeVllm) -> FakeServer:
    """``server`` serving ``app`` from now on, running (a test before may have stopped it): a
    fresh fake per test on a server kept for the module, so no knob, log or counter outlives
    its test."""
    server.app = app
    return server.start()


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
    return serve_fresh(server, FakeVllm(model_root=model_dir))
