"""The HTTP/1.1 transport to vLLM under httpx, and the translation of its errors."""

from sidecar.http.transport.errors import map_httpx_exceptions
from sidecar.http.transport.pool import UpstreamTransport

__all__ = ["UpstreamTransport", "map_httpx_exceptions"]
