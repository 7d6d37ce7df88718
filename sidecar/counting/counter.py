"""Prompt token counting: how many tokens vLLM will put in the KV cache for a request's prompt.

:class:`PromptCounter` answers one question, asked once per generation request before
admission: *how many prompt tokens will vLLM keep for this body?* The answer must be exact,
because the KV projection and the admission decision rest on it. The body is planned
(:mod:`sidecar.counting.plan`, with vLLM's rendering rules in :mod:`sidecar.counting.render`),
counted one of three ways, reported in :class:`TokenCount.method`, and truncated as vLLM
truncates it (:class:`~sidecar.counting.plan.Truncation`, applied here to every count):

1. ``exact_local``: the model's own fast tokenizer and chat template, in this process
   (:mod:`sidecar.counting.tokenizer`). Long inputs (more than ``offload_threshold_chars``) are
   tokenized on a small dedicated thread pool so the event loop keeps serving; short ones
   inline, where a thread hop would cost more than the work. A sample of local counts is
   checked against ``/tokenize`` in the background (:mod:`sidecar.counting.self_check`);
   a shape whose counts differ (vLLM started with its own ``--chat-template``, say) is counted
   upstream from then on.
2. ``exact_upstream``: vLLM's ``POST /tokenize`` (one loopback round trip per prompt, concurrent
   for a list of prompts), used when no tokenizer is loaded, for content the tokenizer cannot
   expand (images, audio), for request-supplied chat templates, and whenever the local path fails.
   A 400 from it is vLLM refusing the prompt: :class:`PromptError` with vLLM's message.
3. ``estimate``: neither is available (or, after a failure, /tokenize is left alone for a while),
   an upper bound (:mod:`sidecar.counting.estimate`). Shapes nobody can count exactly are
   estimates too: Responses with ``previous_response_id`` (the history lives in vLLM),
   completions with ``suffix``, and gpt-oss chats (vLLM renders Harmony; the template's count is
   reported, flagged). A warning is logged at most once a minute per cause.

What the counter cannot see: vLLM's server flags that change rendering (``--chat-template``,
``--chat-template-content-format``, ``--default-chat-template-kwargs``, ``--tokenizer-mode``,
``--exclude-tools-when-tool-choice-none``) and a processor chat template that differs from the
tokenizer's (multimodal models). The self-check catches all of them but
``--exclude-tools-when-tool-choice-none``, which /tokenize does not apply (the count then
includes tools vLLM leaves out: too high, never too low).

Only :class:`PromptError` (a ``BadRequest``) leaves :meth:`PromptCounter.count`: the body's
prompt cannot be interpreted and vLLM would answer 400 too (or it is ``prompt_embeds``, which
the sidecar cannot size). Everything else degrades to a less exact method.

>>> import asyncio
>>> counter = PromptCounter(client=None, upstream=None, served_model=None, tokenizer_path=None,
...                         max_model_len=1024)
>>> count = asyncio.run(counter.count("completions", {"prompt": [[1] * 2000, [2, 3]],
...                                                    "truncate_prompt_tokens": -1}))
>>> count.prompts, count.method
((1023, 2), <CountMethod.LOCAL: 'exact_local'>)
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from sidecar.counting.estimate import estimate_anything
from sidecar.counting.plan import ChatPlan, CompletionPlan, EstimatePlan, Plan, plan_count
from sidecar.counting.render import NeedsUpstream
from sidecar.counting.request import CountedEndpoint
from sidecar.counting.self_check import (
    CountingObserver,
    PromptShape,
    SelfCheckSchedule,
    prompt_shape,
)
from sidecar.counting.tokenizer import OFFLOAD_WORKERS, ModelTokenizer, count_locally
from sidecar.errors import PromptError, SidecarError

__all__ = ["CountMethod", "PromptCounter", "TokenCount"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_UPSTREAM_TIMEOUT_S = 10.0
#: After /tokenize fails, requests are estimated without asking it again for this long.
_RETRY_AFTER_ERROR_S = 1.0
_RETRY_AFTER_MISSING_S = 30.0
_WARN_EVERY_S = 60.0


class CountMethod(enum.StrEnum):
    """How a prompt was counted; the value is the metric label."""

    LOCAL = "exact_local"
    UPSTREAM = "exact_upstream"
    ESTIMATE = "estimate"


@dataclass(frozen=True, slots=True)
class TokenCount:
    """The prompt tokens of one request body, truncated as vLLM truncates them.

    ``prompts`` has one entry per engine request vLLM makes of the body: several for a
    completions ``prompt`` that is a list of prompts, one otherwise.

    >>> TokenCount((3, 4), CountMethod.UPSTREAM, 0.001).total
    7
    """

    prompts: tuple[int, ...]
    method: CountMethod
    seconds: float

    @property
    def total(self) -> int:
        return sum(self.prompts)

    @property
    def exact(self) -> bool:
        return self.method is not CountMethod.ESTIMATE


class _UpstreamUnavailable(SidecarError):
    """vLLM's /tokenize did not answer usefully; the counter falls back to an estimate.

    Control flow inside the counter, never raised out of it.
    """


class _RateLimitedWarning:
    """At most one warning per key per interval; the rest are counted and reported with it."""

    def __init__(self, every_s: float = _WARN_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        suffix = f" ({suppressed} more since the last warning)" if suppressed else ""
        logger.warning(message + suffix, *args)


class PromptCounter:
    """Counts the prompt tokens of generation request bodies, as vLLM will.

    ``tokenizer_path`` is loaded in the background (it takes seconds); until it is ready, and
    when it fails to load, counts go to vLLM's ``/tokenize``. Pass ``tokenizer=`` to share one
    already loaded. ``max_model_len`` resolves ``truncate_prompt_tokens: -1`` (pass the
    engine's; it is also learnt from ``/tokenize`` answers). The first local count of each
    :class:`PromptShape`, then one in ``self_check_every``, is compared with ``/tokenize`` in
    the background and the outcome told to ``observer``.

    >>> import asyncio
    >>> counter = PromptCounter(client=None, upstream=None, served_model=None,
    ...                         tokenizer_path=None)
    >>> asyncio.run(counter.count("completions", {"prompt": [[1, 2], [3]]})).prompts
    (2, 1)
    """

    def __init__(
        self,
        *,
        client: httpx.AsyncClient | None,
        upstream: str | None,
        served_model: str | None,
        tokenizer_path: str | Path | None,
        offload_threshold_chars: int = 2000,
        tokenizer: ModelTokenizer | None = None,
        max_model_len: int | None = None,
        upstream_timeout_s: float = _UPSTREAM_TIMEOUT_S,
        self_check_every: int = 100,
        observer: CountingObserver | None = None,
    ) -> None:
        self._client = client
        self._tokenize_url = None if upstream is None else str(upstream).rstrip("/") + "/tokenize"
        self._served_model = served_model
        self.offload_threshold_chars = offload_threshold_chars
        self.max_model_len = max_model_len
        self._timeout = httpx.Timeout(upstream_timeout_s)
        self._executor: ThreadPoolExecutor | None = None
        self._local: ModelTokenizer | None = tokenizer
        self._loading: Future[ModelTokenizer | None] | None = None
        self._warnings = _RateLimitedWarning()
        self._upstream_retry_at = 0.0
        self._upstream_failure = ""
        self._schedule = SelfCheckSchedule(self_check_every)
        self._observer = observer
        #: shapes counted by /tokenize since a local count of theirs disagreed with it
        self._mismatched: set[PromptShape] = set()
        self._checks: set[asyncio.Task[None]] = set()
        if tokenizer is None and tokenizer_path is not None:
            self._loading = self._pool().submit(_load_tokenizer, Path(tokenizer_path))

    @property
    def local_available(self) -> bool:
        return self._tokenizer() is not None

    async def wait_ready(self) -> bool:
        """Wait for a background tokenizer load; return whether local counting is available."""
        loading = self._loading
        if loading is not None and not loading.cancelled():
            # asyncio.wait, unlike awaiting the future, cannot raise into the caller.
            await asyncio.wait([asyncio.wrap_future(loading)])
        return self.local_available

    async def wait_checks(self) -> None:
        """Wait for the background self-checks in flight (tests, orderly shutdown)."""
        while self._checks:
            await asyncio.gather(*self._checks, return_exceptions=True)

    def close(self) -> None:
        """Stop the self-checks and the tokenizer threads (work in progress finishes alone)."""
        for task in self._checks:
            task.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def count(self, endpoint: CountedEndpoint, body: Mapping[str, Any]) -> TokenCount:
        """Count the prompt tokens of ``body`` sent to ``endpoint``, truncated as vLLM will.

        Raises :class:`PromptError` for a prompt vLLM would refuse to interpret; never anything
        else but cancellation.
        """
        started = time.perf_counter()
        plan: Plan | None = None
        try:
            plan = plan_count(endpoint, body)
            counts, method = await self._count(endpoint, plan)
        except PromptError:
            raise
        except Exception as exc:
            # A bug here must cost precision, never the request.
            self._warnings.warn(
                "internal",
                "prompt counting failed (%s: %s); using an estimate",
                type(exc).__name__,
                exc,
            )
            counts = plan.estimate() if plan is not None else (estimate_anything(body),)
            method = CountMethod.ESTIMATE
        if plan is not None:
            if plan.truncation.keep == -1 and self.max_model_len is None:
                self._warnings.warn(
                    "truncation",
                    "truncate_prompt_tokens=-1 needs max_model_len, which the prompt counter "
                    "was not given; the prompt is counted whole",
                )
            counts = plan.truncation.apply_all(counts, self.max_model_len)
        return TokenCount(tuple(counts), method, time.perf_counter() - started)

    # -- the three ways ----------------------------------------------------------------------

    async def _count(
        self, endpoint: CountedEndpoint, plan: Plan
    ) -> tuple[Sequence[int], CountMethod]:
        """The untruncated counts of ``plan``, and how they were made."""
        if isinstance(plan, EstimatePlan):
            self._warnings.warn(
                f"unsupported:{plan.reason}",
                "cannot count %s exactly; using an upper-bound estimate",
                plan.reason,
            )
            return plan.estimate(), CountMethod.ESTIMATE
        if isinstance(plan, ChatPlan) and plan.reused_ids is not None:
            return (plan.reused_ids,), CountMethod.LOCAL
        if isinstance(plan, CompletionPlan) and plan.token_ids_only:
            return [len(p) for p in plan.prompts], CountMethod.LOCAL  # no tokenizer needed
        local = self._tokenizer()
        shape = prompt_shape(endpoint, plan)
        usable = not (isinstance(plan, ChatPlan) and plan.upstream_only)
        if local is not None and usable and shape not in self._mismatched:
            try:
                counts = await self._run(plan.chars, count_locally, local, plan)
            except NeedsUpstream as exc:
                logger.debug("local count not exact (%s); asking vLLM", exc)
            except Exception as exc:
                # vLLM may still render it (or refuse it with its own message).
                self._warnings.warn(
                    f"local:{type(exc).__name__}",
                    "local prompt count failed (%s: %s); asking vLLM's /tokenize",
                    type(exc).__name__,
                    exc,
                )
            else:
                if local.harmony and isinstance(plan, ChatPlan):
                    # vLLM renders gpt-oss chats with Harmony, not with this template.
                    self._warnings.warn(
                        "harmony",
                        "%s renders chats with Harmony; its chat template only approximates "
                        "vLLM's count",
                        local.path,
                    )
                    return counts, CountMethod.ESTIMATE
                self._maybe_self_check(shape, plan, counts)
                return counts, CountMethod.LOCAL
        try:
            return await self._count_upstream(plan), CountMethod.UPSTREAM
        except _UpstreamUnavailable as exc:
            self._warnings.warn(
                "upstream",
                "vLLM's /tokenize is unavailable (%s); prompt counts are upper-bound estimates",
                exc,
            )
        return plan.estimate(), CountMethod.ESTIMATE

    # -- the self-check ----------------------------------------------------------------------

    def _maybe_self_check(
        self, shape: PromptShape, plan: CompletionPlan | ChatPlan, counts: Sequence[int]
    ) -> None:
        """Compare this local count with /tokenize in the background, if the schedule says so."""
        if self._client is None or self._tokenize_url is None:
            return
        if not self._schedule.due(shape):
            return
        if time.monotonic() < self._upstream_retry_at:
            self._schedule.done(shape, checked=False)  # /tokenize is failing: owe it, ask later
            return
        task = asyncio.get_running_loop().create_task(self._check(shape, plan, list(counts)))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check(
        self, shape: PromptShape, plan: CompletionPlan | ChatPlan, local_counts: list[int]
    ) -> None:
        try:
            upstream_counts = await self._count_upstream(plan)
        except _UpstreamUnavailable as exc:
            # Not verifiable now: the next count of this shape is checked instead.
            logger.debug("self-check of %s counts postponed: %s", shape, exc)
            self._schedule.done(shape, checked=False)
            return
        except Exception as exc:
            # vLLM refuses a prompt the tokenizer took: left to the next sample (and to the
            # request itself, which vLLM will refuse with its own message).
            logger.debug("self-check of %s counts skipped: %s", shape, exc)
            self._schedule.done(shape, checked=True)
            return
        self._schedule.done(shape, checked=True)
        matched = upstream_counts == local_counts
        if not matched and shape not in self._mismatched:
            self._mismatched.add(shape)
            logger.error(
                "local %s prompt count %s differs from vLLM's /tokenize %s; counting %s prompts "
                "with /tokenize from now on (is vLLM started with its own --chat-template, "
                "--chat-template-content-format or --default-chat-template-kwargs, or another "
                "tokenizer?)",
                shape,
                local_counts,
                upstream_counts,
                shape,
            )
        elif matched:
            logger.debug("local %s prompt count agrees with vLLM's /tokenize", shape)
        if self._observer is not None:
            try:
                self._observer.self_checked(shape, matched)
            except Exception:
                logger.exception("the counting observer failed")

    # -- vLLM's /tokenize --------------------------------------------------------------------

    async def _count_upstream(self, plan: CompletionPlan | ChatPlan) -> list[int]:
        if self._client is None or self._tokenize_url is None:
            raise _UpstreamUnavailable("no upstream configured")
        if time.monotonic() < self._upstream_retry_at:
            # Recently failed: estimate now rather than make every request wait for a timeout.
            raise _UpstreamUnavailable(self._upstream_failure)
        if isinstance(plan, ChatPlan):
            return [await self._tokenize(plan.upstream_payload())]
        counts = [len(p) if isinstance(p, list) else 0 for p in plan.prompts]
        texts = [(i, p) for i, p in enumerate(plan.prompts) if isinstance(p, str)]
        results = await asyncio.gather(
            *(
                self._tokenize({"prompt": p, "add_special_tokens": plan.add_special_tokens})
                for _, p in texts
            ),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            # vLLM refusing any one prompt is the answer for the whole body.
            raise next((f for f in failures if isinstance(f, PromptError)), failures[0])
        for (i, _), result in zip(texts, results, strict=True):
            if not isinstance(result, BaseException):
                counts[i] = result
        return counts

    async def _tokenize(self, payload: dict[str, Any]) -> int:
        assert self._client is not None and self._tokenize_url is not None
        if self._served_model is not None:
            payload = {"model": self._served_model, **payload}
        try:
            response = await self._client.post(
                self._tokenize_url, json=payload, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise self._upstream_failed(
                f"{type(exc).__name__}: {exc}", _RETRY_AFTER_ERROR_S
            ) from exc
        if response.status_code == 400:
            raise PromptError(_error_message(response))
        if response.status_code in (404, 405):
            # /tokenize is disabled or absent (not vLLM?): that does not change soon.
            raise self._upstream_failed(f"HTTP {response.status_code}", _RETRY_AFTER_MISSING_S)
        if response.status_code != 200:
            raise self._upstream_failed(f"HTTP {response.status_code}", _RETRY_AFTER_ERROR_S)
        try:
            data = response.json()
            count = data["count"]
            if not isinstance(count, int):
                raise TypeError("count is not an integer")
        except (ValueError, KeyError, TypeError) as exc:
            raise _UpstreamUnavailable(f"unexpected /tokenize answer: {exc}") from exc
        max_model_len = data.get("max_model_len")
        if self.max_model_len is None and isinstance(max_model_len, int):
            self.max_model_len = max_model_len
        return count

    def _upstream_failed(self, failure: str, retry_after_s: float) -> _UpstreamUnavailable:
        self._upstream_failure = f"{failure} (not retried for {retry_after_s:g} s)"
        self._upstream_retry_at = time.monotonic() + retry_after_s
        return _UpstreamUnavailable(failure)

    # -- plumbing -----------------------------------------------------------------------------

    async def _run(self, chars: int, fn: Callable[..., _T], *args: Any) -> _T:
        if chars <= self.offload_threshold_chars:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool(), fn, *args)

    def _tokenizer(self) -> ModelTokenizer | None:
        if self._local is None and self._loading is not None and self._loading.done():
            loading, self._loading = self._loading, None
            try:
                self._local = loading.result()
            except Exception:
                self._local = None
        return self._local

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=OFFLOAD_WORKERS, thread_name_prefix="kv-sidecar-tokens"
            )
        return self._executor


def _load_tokenizer(path: Path) -> ModelTokenizer | None:
    """Load the model's tokenizer; None (and a warning) when it cannot be used locally."""
    try:
        tokenizer = ModelTokenizer.load(path)
    except Exception as exc:
        logger.warning(
            "cannot load the tokenizer in %s (%s: %s); prompts will be counted by vLLM's /tokenize",
            path,
            type(exc).__name__,
            exc,
        )
        return None
    logger.info("loaded the tokenizer in %s for exact local prompt counts", path)
    return tokenizer


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, Mapping) else None
    except (ValueError, AttributeError):
        message = None
    return str(message or f"vLLM refused the prompt (HTTP {response.status_code})")
