"""Discovery: what vLLM serves and how its KV cache is laid out, as one frozen value.

:func:`discover` reads ``/v1/models`` (served model, context length), the cache config in a
scrape of ``/metrics`` (block size, pool, cache dtype, prefix caching) and, when vLLM's model
directory is readable, the model's ``config.json`` for the exact KV geometry. The result is an
:class:`EngineConfig` that the app swaps in with one assignment, as the scraper swaps snapshots;
nothing edits it in place (a new pool size is a new value, :meth:`EngineConfig.with_snapshot`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sidecar.engine.snapshot import EngineSnapshot
from sidecar.errors import ConfigError, GeometryError
from sidecar.kv.geometry import KVGeometry, ModelKV, UniformBlocks, load_config
from sidecar.kv.projection import BlockMath

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine behind the sidecar, as discovered (labels of ``kv_sidecar_vllm_info``)."""

    model: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    cache_dtype: str
    prefix_caching: bool | None
    blocks: BlockMath
    bytes_per_block: int | None  # None: unknown (no model config and no KV memory figure)
    tokenizer_path: Path | None = None
    model_dir: Path | None = None

    def with_snapshot(self, snap: EngineSnapshot) -> EngineConfig:
        """This config with the pool a newer scrape reports (a new value, or ``self``)."""
        if not snap.num_gpu_blocks or snap.num_gpu_blocks == self.num_gpu_blocks:
            return self
        return dataclasses.replace(self, num_gpu_blocks=snap.num_gpu_blocks)


async def discover(
    client: httpx.AsyncClient,
    upstream: str,
    snap: EngineSnapshot,
    *,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    model_config_path: Path | None = None,
    tokenizer: Path | None = None,
) -> EngineConfig:
    """Ask vLLM what it serves; raise LookupError (or an httpx error) while it cannot say."""
    resp = await client.get(upstream + "/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise LookupError("vLLM lists no models")
    entry = models[0]
    if served_model_name:
        entry = next((m for m in models if m.get("id") == served_model_name), entry)
    served = str(entry.get("id"))
    context = max_model_len or int(entry.get("max_model_len") or 0)
    if context <= 0:
        raise LookupError("vLLM did not report max_model_len; set --max-model-len")
    if not snap.block_size or not snap.num_gpu_blocks:
        raise LookupError("no cache config in vLLM's /metrics yet")

    model_dir = _model_dir(model_config_path, entry.get("root"))
    geometry: KVGeometry | None = None
    if model_dir is not None:
        try:
            kv = ModelKV.from_config(
                load_config(model_dir), kv_cache_dtype=snap.cache_dtype or "auto"
            )
            geometry = KVGeometry.build(kv, block_size=snap.block_size, max_model_len=context)
        except GeometryError as exc:
            if model_config_path is not None:
                raise ConfigError(f"--model-config: {exc}") from None
            log.warning(
                "cannot size the model from %s (%s); assuming full attention", model_dir, exc
            )
    blocks: BlockMath
    if geometry is not None:
        blocks = geometry
        bytes_per_block: int | None = geometry.bytes_per_block
    else:
        # Without a config, block math is exact for full-attention models; bytes come from
        # vLLM's KV memory figure, which is only right when the pool was not overridden.
        bytes_per_block = (
            snap.kv_cache_memory_bytes // snap.num_gpu_blocks
            if snap.kv_cache_memory_bytes
            else None
        )
        blocks = UniformBlocks(snap.block_size, bytes_per_block)

    if tokenizer is None and model_dir is not None:
        directory = model_dir if model_dir.is_dir() else model_dir.parent
        if any((directory / name).exists() for name in _TOKENIZER_FILES):
            tokenizer = directory
    return EngineConfig(
        model=served,
        max_model_len=context,
        block_size=snap.block_size,
        num_gpu_blocks=snap.num_gpu_blocks,
        cache_dtype=snap.cache_dtype or "",
        prefix_caching=snap.prefix_caching,
        blocks=blocks,
        bytes_per_block=bytes_per_block,
        tokenizer_path=tokenizer,
        model_dir=model_dir if geometry is not None else None,
    )


def _model_dir(explicit: Path | None, root: Any) -> Path | None:
    if explicit is not None:
        return explicit
    if isinstance(root, str) and root:
        path = Path(root)
        with contextlib.suppress(OSError):
            if (path / "config.json").is_file():
                return path
    return None
