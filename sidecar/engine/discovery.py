"""Discovery: what vLLM serves and how its KV cache is laid out, as one frozen value.

:func:`discover` reads ``/v1/models`` (served model, context length), the cache config in a
scrape of ``/metrics`` (block size, pool, cache dtype, prefix caching) and, when vLLM's model
directory is readable, the model's ``config.json`` for the exact KV geometry and its
``generation_config.json`` for the default ``max_tokens`` (:func:`generation_config_max_tokens`;
``--default-max-tokens`` and ``--max-tokens-cap`` say what the directory cannot) and
``/version`` for vLLM's version, checked against the versions the sidecar mirrors
(:mod:`sidecar.engine.versions`: one warning line per version seen, never a failure). The
result is an :class:`EngineConfig` that the app swaps in with one assignment, as the scraper swaps
snapshots; nothing edits it in place (a new pool size is a new value,
:meth:`EngineConfig.with_snapshot`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sidecar.engine.snapshot import EngineSnapshot
from sidecar.engine.versions import ReportedVersion, VersionCheck, parse_version_answer
from sidecar.errors import ConfigError, GeometryError
from sidecar.kv.geometry import KVGeometry, ModelKV, UniformBlocks, load_config
from sidecar.kv.memory import model_weights
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
    #: vLLM's default max_tokens for a chat or Responses request that names none (the
    #: generation config's ``max_new_tokens``); None: the rest of the context
    default_max_tokens: int | None = None
    #: vLLM's ``override_max_tokens``: caps every request, even one naming its own max_tokens
    max_tokens_cap: int | None = None
    #: what vLLM's ``GET /version`` said (None: no /version, or an answer that names none)
    vllm_version: str | None = None
    #: the model's weight bytes (its checkpoint's, else its parameters') where its config was
    #: read, for the costs' roofline (``EngineCosts.roofline``)
    weights_bytes: int | None = None

    @property
    def roofline(self) -> tuple[int, int] | None:
        """(weight bytes, KV block bytes), the whole model's both; None: not known."""
        if self.weights_bytes is None or self.model_dir is None or not self.bytes_per_block:
            return None
        return self.weights_bytes, self.bytes_per_block

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
    default_max_tokens: int | None = None,
    max_tokens_cap: int | None = None,
    version_check: VersionCheck | None = None,
) -> EngineConfig:
    """Ask vLLM what it serves; raise LookupError (or an httpx error) while it cannot say, and
    :class:`ConfigError` for a setting that cannot work (``--model-config`` that cannot be read
    or sized, a ``--tokenizer`` that does not exist): waiting would not mend it.

    ``default_max_tokens`` and ``max_tokens_cap`` are the operator's word on vLLM's generation
    config (``--default-max-tokens``, ``--max-tokens-cap``); a given default wins over the model
    directory's ``generation_config.json`` (0: vLLM has none, whatever the file says).

    vLLM's version comes from ``GET /version``; a vLLM without it, or with an answer that is not
    one, is discovered all the same (``vllm_version`` None). ``version_check`` remembers what was
    said already (the process's own by default): a version outside the supported range, or none,
    is logged once as a warning.
    """
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
    weights: int | None = None
    if model_dir is not None:
        try:
            config = load_config(model_dir)
            kv = ModelKV.from_config(config, kv_cache_dtype=snap.cache_dtype or "auto")
            geometry = KVGeometry.build(
                kv,
                block_size=snap.block_size,
                max_model_len=context,
                mamba_cache_mode=snap.state_cache_mode,
            )
            weights = _weights(config, kv.model_dtype, model_dir)
        except GeometryError as exc:
            if model_config_path is not None:
                raise ConfigError(f"--model-config: {exc}") from None
            log.warning(
                "cannot size the model from %s (%s); assuming full attention", model_dir, exc
            )
    blocks: BlockMath
    if geometry is not None:
        log.info("KV counted as vLLM holds it: %s", describe_groups(geometry))
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

    reported = await _vllm_version(client, upstream)
    problem = (version_check or _VERSION_CHECK).problem(reported)
    if problem is not None:
        log.warning("%s", problem)

    tokenizer_path = _tokenizer(tokenizer, model_dir)
    default, source = _default_max_tokens(default_max_tokens, model_dir)
    _log_max_tokens_defaults(default, source, max_tokens_cap)

    return EngineConfig(
        model=served,
        max_model_len=context,
        block_size=snap.block_size,
        num_gpu_blocks=snap.num_gpu_blocks,
        cache_dtype=snap.cache_dtype or "",
        prefix_caching=snap.prefix_caching,
        blocks=blocks,
        bytes_per_block=bytes_per_block,
        tokenizer_path=tokenizer_path,
        model_dir=model_dir if geometry is not None else None,
        default_max_tokens=default,
        max_tokens_cap=max_tokens_cap,
        vllm_version=reported.version,
        weights_bytes=weights,
    )


def _weights(config: dict[str, Any], model_dtype: str, model_dir: Path) -> int | None:
    """The model's weight bytes (``sidecar.kv.memory.model_weights``); None where its config
    does not say (the costs' roofline is then not known, nothing else changes)."""
    try:
        return model_weights(config, model_dtype, model_dir).total_bytes
    except (ConfigError, GeometryError, KeyError, TypeError, ValueError) as exc:
        log.info("the model's weight bytes are not known (%s): no roofline for the costs", exc)
        return None


#: what this process said about vLLM's version already (each problem is logged once)
_VERSION_CHECK = VersionCheck()


async def _vllm_version(client: httpx.AsyncClient, upstream: str) -> ReportedVersion:
    """vLLM's ``GET /version``; never raises (an older or stripped-down vLLM may lack it)."""
    try:
        resp = await client.get(upstream + "/version")
        body = await resp.aread()
    except httpx.HTTPError as exc:
        return ReportedVersion(None, f"GET /version failed: {type(exc).__name__}")
    return parse_version_answer(resp.status_code, body)


#: Where ``transformers``' ``GenerationConfig.from_model_config`` looks for generation
#: attributes a model config leaves unset (``PreTrainedConfig.get_text_config(decoder=True)``).
_DECODER_CONFIGS = ("decoder", "generator", "text_config")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if value > 0 else None


def generation_config_max_tokens(model_dir: Path) -> tuple[int | None, Path | None]:
    """The default ``max_tokens`` vLLM 0.32 takes from a local model directory, and its file.

    As vLLM's ``--generation-config auto`` (the default) reads it: ``try_get_generation_config``
    loads ``generation_config.json`` (``GenerationConfig.from_pretrained``); when that file is
    missing or not valid JSON, it builds one from ``config.json``
    (``GenerationConfig.from_model_config``: a top-level ``max_new_tokens``, else the decoder's).
    ``get_diff_sampling_param`` then keeps ``max_new_tokens`` when it is set (not null) as the
    default ``max_tokens``; ``max_length`` does not count. ``model_dir`` may name the
    ``config.json`` itself. ``(None, None)``: no default, or nothing readable.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = (Path(d) / "config.json").write_text('{"max_new_tokens": 9}')
    ...     _ = (Path(d) / "generation_config.json").write_text('{"max_new_tokens": 256}')
    ...     value, source = generation_config_max_tokens(Path(d))
    >>> value, source.name
    (256, 'generation_config.json')
    """
    directory = model_dir if model_dir.is_dir() else model_dir.parent
    generation = _read_json(directory / "generation_config.json")
    if isinstance(generation, dict):
        value = _positive_int(generation.get("max_new_tokens"))
        return (value, directory / "generation_config.json") if value else (None, None)
    config = _read_json(directory / "config.json")
    if not isinstance(config, dict):
        return None, None
    value = _positive_int(config.get("max_new_tokens"))
    if value is None:
        decoder = next(
            (config[k] for k in _DECODER_CONFIGS if isinstance(config.get(k), dict)), None
        )
        if decoder is not None:
            value = _positive_int(decoder.get("max_new_tokens"))
    return (value, directory / "config.json") if value else (None, None)


def _default_max_tokens(flag: int | None, model_dir: Path | None) -> tuple[int | None, str]:
    """The default max_tokens in force and where it comes from (for the log)."""
    if flag is not None:
        return (flag or None), "--default-max-tokens"
    if model_dir is None:
        return None, (
            "vLLM's model directory is not readable here: set --default-max-tokens if its "
            "generation config sets max_new_tokens"
        )
    with contextlib.suppress(OSError):
        value, source = generation_config_max_tokens(model_dir)
        if value is not None:
            return value, f"max_new_tokens in {source}"
    return None, f"no max_new_tokens in {model_dir}"


def describe_groups(geometry: KVGeometry) -> str:
    """The geometry's KV-cache groups in words, for the start-up log.

    >>> from sidecar.kv.geometry import ModelKV
    >>> kv = ModelKV.from_config({"num_hidden_layers": 4, "num_attention_heads": 4,
    ...     "hidden_size": 256, "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    >>> said = describe_groups(KVGeometry.build(kv, block_size=256, mamba_cache_mode="align"))
    >>> for part in said.split(", "):
    ...     print(part)
    256 tokens a block; 1 full-attention group
    3 recurrent-state groups (2 blocks a request at most)
    """
    full = sum(1 for g in geometry.groups if g.sliding_window is None)
    state = sum(1 for g in geometry.groups if g.state)
    parts = [f"{full} full-attention group{'s' * (full != 1)}"] if full else []
    for w in sorted({g.sliding_window for g in geometry.groups if g.sliding_window} - {0}):
        n = sum(1 for g in geometry.groups if g.sliding_window == w)
        kind = "chunked-local group" if w < 0 else "sliding-window group"
        parts.append(f"{n} {kind}{'s' * (n != 1)} of {abs(w)} tokens")
    if state:
        parts.append(
            f"{state} recurrent-state group{'s' * (state != 1)} "
            f"({geometry.state_peak_blocks} block{'s' * (geometry.state_peak_blocks != 1)} "
            "a request at most)"
        )
    return f"{geometry.block_size} tokens a block; " + ", ".join(parts)


def _log_max_tokens_defaults(default: int | None, source: str, cap: int | None) -> None:
    if cap is not None and (default is None or cap < default):
        said = f"{cap} (--max-tokens-cap; {source})"
    elif default is not None:
        said = f"{default} ({source})"
    else:
        said = f"the rest of the context ({source})"
    completions = 16 if cap is None else min(16, cap)
    capped = "" if cap is None else f"; every request capped at {cap} (--max-tokens-cap)"
    log.info(
        "max_tokens: chat and responses requests without one get %s, completions %d%s",
        said,
        completions,
        capped,
    )


def _tokenizer(explicit: Path | None, model_dir: Path | None) -> Path | None:
    """The tokenizer to load: ``--tokenizer``, which must exist (the operator's own path, looked
    at once vLLM serves: a volume shared with it is filled by then), else the model directory
    when it holds one."""
    if explicit is not None:
        if not explicit.exists():
            raise ConfigError(f"--tokenizer: no such file or directory: {explicit}")
        return explicit
    if model_dir is not None:
        directory = model_dir if model_dir.is_dir() else model_dir.parent
        if any((directory / name).exists() for name in _TOKENIZER_FILES):
            return directory
    return None


def _model_dir(explicit: Path | None, root: Any) -> Path | None:
    if explicit is not None:
        return explicit
    if isinstance(root, str) and root:
        path = Path(root)
        with contextlib.suppress(OSError):
            if (path / "config.json").is_file():
                return path
    return None
