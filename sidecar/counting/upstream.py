"""vLLM's own counting endpoints, as the prompt counter calls them: its render endpoints first,
``POST /tokenize`` where they are not served.

**Render** (vLLM 0.32, ``vllm/entrypoints/scale_out/render/``): ``/v1/completions/render``,
``/v1/chat/completions/render``, ``/v1/responses/render`` and ``/v1/messages/render`` take the
generation body itself and answer what vLLM would hand its engine: a ``GenerateRequest`` (a list
of them for completions, one per prompt) with the prompt's ``token_ids`` as vLLM rendered,
tokenized and truncated them, and the resolved ``sampling_params`` (``max_tokens`` included:
vLLM's ``get_max_tokens`` of the request, the generation config and the rest of the context; it is
left out of the JSON when it equals ``SamplingParams``' default of 16). So one call covers every
endpoint exactly as vLLM serves it: Responses rendered by vLLM itself rather than as the chat the
sidecar builds for ``/tokenize``, and server flags ``/tokenize`` ignores
(``--exclude-tools-when-tool-choice-none``). vLLM registers them only with ``--enable-scale-out``
(or ``--tokens-only``); otherwise each answers 403 ``PermissionDeniedError``, and older servers 404.
Then the counter uses ``/tokenize``, and tries render again a minute later
(:data:`RENDER_RETRY_S`).

A render refusal (400, or 404 for an unknown model) is not taken as vLLM's verdict on the
request: the render endpoint refuses things its generating twin accepts (``use_beam_search``;
a prompt over the context, which it stops tokenizing at ``max_model_len + 1`` tokens), so such
a body is counted by ``/tokenize``, whose 400 is the prompt error
(:class:`~sidecar.errors.PromptError`).

**/tokenize** takes a prompt, or messages with the template inputs, and answers ``count``,
``tokens`` and ``max_model_len``; its 400 is vLLM refusing the prompt.

A transport failure (vLLM unreachable, a timeout, a 5xx from ``/tokenize``) closes both for a
second, and a missing ``/tokenize`` for 30 s, so that requests are estimated at once rather
than each waiting for a timeout (:class:`UpstreamUnavailable`); a 5xx from render only sends
that body to ``/tokenize``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from sidecar.counting.plan import ChatPlan, CompletionPlan
from sidecar.counting.request import CountedEndpoint
from sidecar.errors import PromptError, SidecarError

__all__ = [
    "RENDER_MODES",
    "RENDER_PATHS",
    "RENDER_RETRY_S",
    "RenderDeclined",
    "RenderMode",
    "Rendered",
    "UpstreamUnavailable",
    "VllmCounting",
    "render_first",
    "renderable",
]

logger = logging.getLogger(__name__)

RenderEndpoint = Literal["completions", "chat", "responses", "messages"]

#: The render endpoint of each generation endpoint (vLLM 0.32, scale_out/render/api_router.py).
RENDER_PATHS: dict[RenderEndpoint, str] = {
    "completions": "/v1/completions/render",
    "chat": "/v1/chat/completions/render",
    "responses": "/v1/responses/render",
    "messages": "/v1/messages/render",
}
#: ``SamplingParams.max_tokens``' default: vLLM's JSON omits a field at its default.
SAMPLING_DEFAULT_MAX_TOKENS = 16
#: After vLLM says it serves no render endpoint (403, 404, 405, 501), /tokenize for this long.
RENDER_RETRY_S = 60.0
RenderMode = Literal["off", "better", "always"]
#: The prompt counter's ``render``: never; where :func:`render_first` says (and for shapes only
#: render can count, and the self-check's oracle); for every count that goes to vLLM.
RENDER_MODES: tuple[RenderMode, ...] = ("off", "better", "always")
_RETRY_AFTER_ERROR_S = 1.0
_RETRY_AFTER_MISSING_S = 30.0


class UpstreamUnavailable(SidecarError):
    """vLLM did not answer usefully; the counter falls back (never raised out of it)."""


class RenderDeclined(SidecarError):
    """The render endpoint did not count this body (not served, or it refused it): the counter
    asks ``/tokenize`` instead."""


@dataclass(frozen=True, slots=True)
class Rendered:
    """One engine prompt as vLLM's render endpoint answered it: the token ids vLLM would cache
    (rendered, tokenized and truncated) and the ``max_tokens`` it resolved for them."""

    ids: list[int]
    max_tokens: int | None


def renderable(endpoint: RenderEndpoint, body: Mapping[str, Any]) -> bool:
    """Whether the render endpoint can answer for ``body`` as the generating one would.

    Beam search and a Responses ``previous_response_id`` (the stateless renderer has no history)
    are refused by render alone.

    >>> renderable("chat", {"messages": [], "use_beam_search": True})
    False
    >>> renderable("responses", {"input": "hi", "previous_response_id": None})
    True
    """
    if body.get("use_beam_search"):
        return False
    return not (endpoint == "responses" and body.get("previous_response_id") is not None)


def render_first(endpoint: CountedEndpoint, plan: CompletionPlan | ChatPlan) -> bool:
    """Where render is the better way for vLLM to count (``render="better"``), measured against
    /tokenize by ``bench.render`` (BENCHMARKS.md): Responses, which /tokenize only counts as the
    chat this process builds of them, and completions of several text prompts (one call instead
    of one per prompt). /tokenize counts a chat, or one prompt, alike for as little or less.

    >>> from sidecar.counting.plan import plan_count
    >>> render_first("completions", plan_count("completions", {"prompt": ["a", "b"]}))
    True
    >>> render_first("chat", plan_count("chat", {"messages": [{"role": "user", "content": "hi"}]}))
    False
    """
    if endpoint == "responses":
        return True
    return isinstance(plan, CompletionPlan) and sum(isinstance(p, str) for p in plan.prompts) > 1


class VllmCounting:
    """vLLM's ``/tokenize`` and render endpoints at ``upstream``, with their back-off gates.

    ``served_model`` is put in every payload that names no model (vLLM checks it).
    """

    def __init__(
        self,
        client: httpx.AsyncClient | None,
        upstream: str | None,
        *,
        served_model: str | None,
        timeout_s: float,
        render: bool = True,
    ) -> None:
        self._client = client
        self._base = None if upstream is None else str(upstream).rstrip("/")
        self._served_model = served_model
        self._timeout = httpx.Timeout(timeout_s)
        self._retry_at = 0.0
        self.failure = ""
        #: whether render is tried at all (False: /tokenize only, as before vLLM served render)
        self.render_enabled = render
        self._render_retry_at = 0.0
        #: why render is not used now ("" while it is, or before it was tried)
        self.render_off = ""

    @property
    def configured(self) -> bool:
        return self._client is not None and self._base is not None

    @property
    def failing(self) -> bool:
        """vLLM failed a moment ago: estimate rather than wait for another timeout."""
        return time.monotonic() < self._retry_at

    def render_ready(self) -> bool:
        """Render is worth a try now (configured, enabled, not found missing lately)."""
        return (
            self.configured
            and self.render_enabled
            and not self.failing
            and time.monotonic() >= self._render_retry_at
        )

    # -- render ------------------------------------------------------------------------------

    async def render(self, endpoint: RenderEndpoint, body: Mapping[str, Any]) -> list[Rendered]:
        """vLLM's rendering of ``body`` for ``endpoint``: one :class:`Rendered` per engine prompt.

        Raises :class:`RenderDeclined` when render does not answer for this body (then
        /tokenize may), :class:`UpstreamUnavailable` when vLLM cannot be reached.
        """
        response = await self._post(RENDER_PATHS[endpoint], self._with_model(body))
        status = response.status_code
        if status == 200:
            try:
                return _rendered(endpoint, response.json())
            except (ValueError, TypeError, KeyError) as exc:
                raise self._render_missing(f"unexpected answer ({exc})") from exc
        if status in (403, 405, 501) or (status == 404 and _route_missing(response)):
            hint = " (vLLM serves it with --enable-scale-out)" if status == 403 else ""
            raise self._render_missing(f"HTTP {status}{hint}")
        raise RenderDeclined(f"render refused it: HTTP {status}: {_error_message(response)}")

    def _render_missing(self, reason: str) -> RenderDeclined:
        if not self.render_off:
            logger.info(
                "vLLM's render endpoints are not usable (%s); counting with /tokenize, "
                "trying render again every %g s",
                reason,
                RENDER_RETRY_S,
            )
        self.render_off = reason
        self._render_retry_at = time.monotonic() + RENDER_RETRY_S
        return RenderDeclined(reason)

    def render_served(self) -> None:
        if self.render_off:
            logger.info("vLLM's render endpoints answer again; counting with them")
        self.render_off = ""

    # -- /tokenize -----------------------------------------------------------------------------

    async def tokenize(
        self, payload: dict[str, Any], want_tokens: bool = False
    ) -> tuple[int, list[int] | None, int | None]:
        """``/tokenize``'s count, its token ids (when asked for and consistent with the count),
        and the ``max_model_len`` it reports."""
        response = await self._post("/tokenize", self._with_model(payload))
        if response.status_code == 400:
            raise PromptError(_error_message(response))
        if response.status_code in (404, 405):
            # /tokenize is disabled or absent (not vLLM?): that does not change soon.
            raise self._failed(f"HTTP {response.status_code}", _RETRY_AFTER_MISSING_S)
        if response.status_code != 200:
            raise self._failed(f"HTTP {response.status_code}", _RETRY_AFTER_ERROR_S)
        try:
            data = response.json()
            count = data["count"]
            if not isinstance(count, int):
                raise TypeError("count is not an integer")
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamUnavailable(f"unexpected /tokenize answer: {exc}") from exc
        max_model_len = data.get("max_model_len")
        ids = data.get("tokens") if want_tokens else None
        if not (isinstance(ids, list) and len(ids) == count and all(type(t) is int for t in ids)):
            ids = None  # not the ids of this count: no prefix rather than a wrong one
        return count, ids, max_model_len if isinstance(max_model_len, int) else None

    # -- plumbing ------------------------------------------------------------------------------

    def _with_model(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        if self._served_model is None:
            return dict(payload)
        return {"model": self._served_model, **payload}

    async def _post(self, path: str, payload: dict[str, Any]) -> httpx.Response:
        if self._client is None or self._base is None:
            raise UpstreamUnavailable("no upstream configured")
        if self.failing:
            raise UpstreamUnavailable(self.failure)
        try:
            return await self._client.post(self._base + path, json=payload, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise self._failed(f"{type(exc).__name__}: {exc}", _RETRY_AFTER_ERROR_S) from exc

    def _failed(self, failure: str, retry_after_s: float) -> UpstreamUnavailable:
        self.failure = f"{failure} (not retried for {retry_after_s:g} s)"
        self._retry_at = time.monotonic() + retry_after_s
        return UpstreamUnavailable(failure)


def _rendered(endpoint: RenderEndpoint, data: object) -> list[Rendered]:
    """The engine prompts of a render answer (a list of them for completions)."""
    items = data if endpoint == "completions" else [data]
    if not isinstance(items, list) or not items:
        raise TypeError("no GenerateRequest")
    out = []
    for item in items:
        if not isinstance(item, Mapping):
            raise TypeError("a GenerateRequest is not an object")
        ids = item["token_ids"]
        if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
            raise TypeError("token_ids is not a list of token ids")
        params = item.get("sampling_params")
        max_tokens = (
            params.get("max_tokens", SAMPLING_DEFAULT_MAX_TOKENS)
            if isinstance(params, Mapping)
            else None
        )
        out.append(Rendered(ids, max_tokens if type(max_tokens) is int else None))
    return out


def _route_missing(response: httpx.Response) -> bool:
    """A 404 of the web framework (no such route), not vLLM's own (an unknown model)."""
    try:
        data = response.json()
    except ValueError:
        return True
    return not (isinstance(data, Mapping) and isinstance(data.get("error"), Mapping))


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, Mapping) else None
    except (ValueError, AttributeError):
        message = None
    return str(message or f"vLLM refused the prompt (HTTP {response.status_code})")
