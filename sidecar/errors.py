"""Every exception the sidecar raises on purpose, in one tree.

::

    SidecarError
    ├── BadRequest            a request refused before it reaches vLLM (4xx, OpenAI-shaped)
    │   └── PromptError       its prompt cannot be interpreted (vLLM would answer 400)
    ├── CountingBusy          too many long prompts being counted: shed (429 counting_busy)
    ├── ConfigError           a setting, model config or flag that cannot be used
    │   └── GeometryError     a model config the KV geometry cannot size
    ├── MetricsParseError     vLLM's /metrics text that cannot be read
    └── UpstreamError         talking to vLLM failed
        ├── UpstreamUnavailable   refused, or the request could not be sent
        ├── UpstreamTimeout       no answer (or no next chunk) in time
        └── UpstreamProtocolError reset or closed, or an answer that broke off or broke HTTP

Expected refusals (KV full, queue full, ...) are values, not exceptions: see
``sidecar.admission.decisions``. ``sidecar.http.refusals`` maps both to HTTP in one place, and
``sidecar.http.transport.map_httpx_exceptions`` is the one translation of the HTTP client's
errors into this tree. This module imports nothing but the standard library, so that the pure
parts (``kv``, ``engine.snapshot``, ``counting``) can raise from it.

>>> isinstance(PromptError("no prompt"), BadRequest), UpstreamTimeout.kind
(True, 'timeout')
"""

from __future__ import annotations

from typing import ClassVar


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""


class BadRequest(SidecarError):
    """A request refused before it reaches vLLM; mapped to an OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str = "invalid_request",
        status: int = 400,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class PromptError(BadRequest, ValueError):
    """The body's prompt cannot be interpreted; vLLM would refuse it with a 400.

    The message is one line, fit for an OpenAI-shaped error body.
    """

    def __init__(self, message: str) -> None:
        super().__init__(one_line(str(message), 1000), param="prompt")


class CountingBusy(SidecarError):
    """A long prompt found every counting slot taken and too long a wait for one: the request is
    shed (``Reason.COUNTING_BUSY``: 429 with ``Retry-After``), not counted.

    Raised by the prompt counter; the generation path turns it into the refusal.
    """

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        #: seconds until the counting work ahead of the request should be done
        self.retry_after_s = retry_after_s


class ConfigError(SidecarError, ValueError):
    """A setting, flag or model config the sidecar cannot use."""


class GeometryError(ConfigError):
    """A model config the KV geometry cannot size."""


class MetricsParseError(SidecarError, ValueError):
    """vLLM's /metrics text could not be read."""


class UpstreamError(SidecarError):
    """Talking to vLLM failed. ``kind`` is the ``upstream_errors_total`` label."""

    kind: ClassVar[str] = "protocol"


class UpstreamUnavailable(UpstreamError):
    """vLLM refused the connection, or the request could not be written."""

    kind = "connect"


class UpstreamTimeout(UpstreamError):
    """vLLM did not answer, or send its next chunk, in time."""

    kind = "timeout"


class UpstreamProtocolError(UpstreamError):
    """The connection was reset or closed, or vLLM's answer broke off or broke HTTP."""

    kind = "protocol"


def one_line(message: str, limit: int = 300) -> str:
    """``message`` on one line, at most ``limit`` characters (for logs and error bodies)."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
