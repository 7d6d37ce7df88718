"""What a test, the demo or a benchmark needs to know about a running vLLM, read from the server.

Nothing here assumes the generated tiny model: the served name and ``max_model_len`` come from
``/v1/models``, the block size and pool from ``vllm:cache_config_info``, the bytes per block from
the model's ``config.json`` when the directory is readable here, else from a sidecar in front of
the server (its ``kv_sidecar_kv_capacity_bytes`` over ``kv_sidecar_kv_capacity_blocks``). So the
same tests run against the harness's CPU build and against an external vLLM
(``KV_SIDECAR_TEST_VLLM_URL``) with any model.

    info = describe_vllm("http://127.0.0.1:8000")
    body = {"model": info.served_name, "max_tokens": info.max_model_len // 2, ...}
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.exposition import cache_config_labels, metric_value
from harness.local import http_get


class Server(Protocol):
    """What :class:`VllmInfo` keeps of the process that serves vLLM, when the harness started
    it (``harness.vllm_cpu.VllmServer`` is one): its model directory and its process."""

    model_dir: Path | None
    proc: subprocess.Popen[bytes] | None

    @property
    def url(self) -> str: ...


#: Bytes per element of a KV cache dtype (vLLM's ``--kv-cache-dtype`` / the model's dtype).
_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
}


def _get(url: str, timeout: float = 10.0) -> bytes:
    return http_get(url, timeout)


def served_model(url: str) -> dict[str, Any]:
    """The first entry of ``GET url/v1/models`` (vLLM's, or relayed by a sidecar at ``url``)."""
    data = json.loads(_get(url.rstrip("/") + "/v1/models"))["data"]
    if not data:
        raise LookupError(f"{url}/v1/models lists no model")
    return dict(data[0])


def kv_bytes_per_block(config: dict[str, Any], block_size: int, cache_dtype: str) -> int | None:
    """K and V of every layer for ``block_size`` tokens, for a plain decoder's ``config.json``.

    None when the config does not say (or describes an attention this formula does not cover,
    such as MLA): the caller then asks a sidecar.
    """
    text = config.get("text_config") or config
    if "kv_lora_rank" in text:  # multi-head latent attention: another layout
        return None
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    dtype = cache_dtype if cache_dtype not in ("", "auto", "None") else None
    dtype = dtype or text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
    element = _DTYPE_BYTES.get(str(dtype))
    if element is None:
        return None
    return 2 * layers * kv_heads * head_dim * element * block_size


@dataclass(frozen=True)
class VllmInfo:
    """A running vLLM as the tests see it; every figure read from the server itself."""

    url: str
    served_name: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    cache_dtype: str
    model_dir: Path | None  # None: the model directory is not readable from here
    server: Server | None = None  # None: started outside the tests

    def metrics_text(self) -> str:
        return _get(self.url + "/metrics").decode()

    def blocks_for(self, tokens: int) -> int:
        """KV blocks one sequence of ``tokens`` tokens holds."""
        return -(-tokens // self.block_size)

    def model_config(self) -> dict[str, Any] | None:
        if self.model_dir is None or not (self.model_dir / "config.json").is_file():
            return None
        return dict(json.loads((self.model_dir / "config.json").read_text()))

    def bytes_per_block(self, sidecar_metrics_url: str | None = None) -> int:
        """Bytes of one KV block: from the model's config, else from the sidecar at the URL."""
        config = self.model_config()
        if config is not None:
            found = kv_bytes_per_block(config, self.block_size, self.cache_dtype)
            if found is not None:
                return found
        if sidecar_metrics_url is not None:
            text = _get(sidecar_metrics_url.rstrip("/") + "/metrics").decode()
            size = metric_value(text, "kv_sidecar_kv_capacity_bytes")
            blocks = metric_value(text, "kv_sidecar_kv_capacity_blocks")
            if size and blocks:
                return round(size / blocks)
        raise LookupError(
            f"bytes per KV block unknown: no usable config.json ({self.model_dir}) and no sidecar "
            "exporting kv_sidecar_kv_capacity_bytes (set KV_SIDECAR_TEST_MODEL_DIR)"
        )


def describe_vllm(
    url: str, *, server: Server | None = None, model_dir: Path | None = None
) -> VllmInfo:
    """Read a running vLLM's served name, context, block size and pool from the server.

    ``model_dir``: where its model directory is readable, when known; otherwise the harness's
    server's, or ``/v1/models``' ``root`` when that is a directory here.
    """
    url = url.rstrip("/")
    model = served_model(url)
    labels = cache_config_labels(_get(url + "/metrics").decode())
    if model_dir is None and server is not None:
        model_dir = server.model_dir
    if model_dir is None and Path(str(model.get("root", ""))).is_dir():
        model_dir = Path(model["root"])
    return VllmInfo(
        url=url,
        served_name=str(model["id"]),
        max_model_len=int(model["max_model_len"]),
        block_size=int(labels["block_size"]),
        num_gpu_blocks=int(labels["num_gpu_blocks"]),
        cache_dtype=labels.get("cache_dtype", "auto"),
        model_dir=model_dir,
        server=server,
    )
