"""The model's weight bytes, read at discovery for the costs' roofline (``EngineCosts.roofline``:
the decode step's fixed share at a full pool until the decode line is measured): from the
checkpoint's index where the model directory has one, else from the config's parameters, the
whole model's both, beside the whole model's KV block bytes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from harness.fake_vllm import FakeServer, FakeVllm
from harness.vllm_formats import write_model_dir
from sidecar.engine.discovery import EngineConfig, discover
from sidecar.engine.snapshot import parse_vllm_metrics
from sidecar.kv.geometry import KVGeometry, ModelKV, load_config
from sidecar.kv.memory import ModelSize

MODELS = Path(__file__).resolve().parent.parent / "harness" / "models"


async def discovered(fake: FakeVllm, model_config: Path | None = None) -> EngineConfig:
    with FakeServer(fake) as server:
        snap = parse_vllm_metrics(fake.metrics_text(), taken_at=0.0)
        async with httpx.AsyncClient(timeout=5) as client:
            return await discover(client, server.url, snap, model_config_path=model_config)


@pytest.mark.asyncio
async def test_a_config_alone_gives_its_parameters_at_the_models_dtype(tmp_path: Path) -> None:
    root = tmp_path / "8b"
    root.mkdir()
    (root / "config.json").write_text((MODELS / "llama-3.1-8b-instruct.json").read_text())
    config = await discovered(FakeVllm(model_root=root))
    size = ModelSize.from_config(load_config(root))
    kv = ModelKV.from_config(load_config(root))
    assert config.weights_bytes == size.params_total * kv.dtype_bytes
    assert config.weights_bytes == pytest.approx(16.06e9, rel=0.001)
    assert isinstance(config.blocks, KVGeometry)
    assert config.roofline == (config.weights_bytes, config.blocks.bytes_per_block)


@pytest.mark.asyncio
async def test_a_config_that_cannot_be_sized_gives_no_roofline_and_its_geometry(
    tmp_path: Path,
) -> None:
    """The harness's tiny config names no ``intermediate_size``: its KV is counted all the
    same, and the costs have no roofline."""
    config = await discovered(FakeVllm(model_root=write_model_dir(tmp_path / "tiny")))
    assert isinstance(config.blocks, KVGeometry)
    assert config.weights_bytes is None and config.roofline is None


@pytest.mark.asyncio
async def test_a_checkpoint_index_gives_its_total_size(tmp_path: Path) -> None:
    root = tmp_path / "8b"
    root.mkdir()
    (root / "config.json").write_text((MODELS / "llama-3.1-8b-instruct.json").read_text())
    index = {"metadata": {"total_size": 123_456_789}, "weight_map": {}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    config = await discovered(FakeVllm(model_root=root))
    assert config.weights_bytes == 123_456_789


@pytest.mark.asyncio
async def test_a_70b_config_gives_141_gb_and_a_roofline_share_of_0_72(tmp_path: Path) -> None:
    """The simulated 70B's config (``--model-config``): 70.6B parameters in bf16, 5 MiB a
    16-token block; over the 10,303 blocks of the benchmarks' pool, a fixed share of 0.72."""
    fake = FakeVllm(model_root=None)
    fake.block_size = 16
    config = await discovered(fake, MODELS / "llama-3.1-70b-instruct.json")
    assert config.roofline is not None
    weights, block = config.roofline
    assert weights == pytest.approx(141.1e9, rel=0.001)
    assert block == 16 * 80 * 8 * 128 * 2 * 2
    assert weights / (weights + 10_303 * block) == pytest.approx(0.723, abs=0.001)


@pytest.mark.asyncio
async def test_no_config_no_roofline() -> None:
    config = await discovered(FakeVllm(model_root=None))
    assert config.weights_bytes is None and config.roofline is None
