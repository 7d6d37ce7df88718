"""The geometry the sidecar builds for a harness vLLM: its model's config, and the block size and
``mamba_cache_mode`` that vLLM's ``cache_config_info`` reports, beside those labels."""

from __future__ import annotations

import httpx

from harness.exposition import cache_config_labels
from harness.vllm_info import VllmInfo
from sidecar.kv.geometry import KVGeometry, ModelKV, load_config


def vllm_geometry(vllm: VllmInfo) -> tuple[KVGeometry, dict[str, str]]:
    """``vllm``'s model as the sidecar counts it, and vLLM's ``cache_config_info`` labels."""
    assert vllm.model_dir is not None
    info = cache_config_labels(httpx.get(vllm.url + "/metrics", timeout=10).text)
    geometry = KVGeometry.build(
        ModelKV.from_config(load_config(vllm.model_dir / "config.json")),
        block_size=int(info["block_size"]),
        max_model_len=vllm.max_model_len,
        mamba_cache_mode=info["mamba_cache_mode"],
    )
    return geometry, info
