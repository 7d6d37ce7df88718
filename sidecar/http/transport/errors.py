"""The one translation of the HTTP client's errors into the sidecar's tree (``sidecar.errors``),
as httpx's own ``map_httpcore_exceptions()`` does for httpcore.

>>> try:
...     with map_httpx_exceptions():
...         raise httpx.ConnectError("refused")
... except UpstreamUnavailable as exc:
...     print(type(exc).__name__, exc.kind)
UpstreamUnavailable connect
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from sidecar.errors import UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable


@contextlib.contextmanager
def map_httpx_exceptions() -> Iterator[None]:
    """Raise :class:`~sidecar.errors.UpstreamError` for any ``httpx.HTTPError`` inside."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout(f"vLLM did not answer in time: {type(exc).__name__}") from exc
    except (httpx.ConnectError, httpx.WriteError) as exc:
        raise UpstreamUnavailable(f"vLLM is unreachable: {type(exc).__name__}") from exc
    except httpx.HTTPError as exc:
        raise UpstreamProtocolError(f"vLLM's answer broke off: {type(exc).__name__}") from exc
