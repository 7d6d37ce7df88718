"""This checkout and this machine: the repository root, the cache, free loopback ports, a GET.

A leaf: it imports nothing from the project, so every other harness module (the vLLM launcher,
the workloads, the benchmark helpers) can share these without importing each other.

    port = free_port()
    body = http_get(f"http://127.0.0.1:{port}/health")
"""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

#: the repository root (where ``python -m sidecar`` runs from in the harness)
ROOT = Path(__file__).resolve().parent.parent
#: where the harness keeps the vLLM venv, the generated models and the logs
CACHE = Path(os.environ.get("KV_SIDECAR_CACHE", Path.home() / ".cache" / "vllm-kv-sidecar"))


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> bytes:
    """The body of ``GET url`` (raises ``OSError`` on a failure or a non-2xx status)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())
