"""Prompt token counting: how many tokens vLLM will put in the KV cache for a request's prompt.

:class:`PromptCounter` answers one question, asked once per generation request before
admission: *how many prompt tokens will vLLM keep for this body?* The answer must be exact,
because the KV projection and the admission decision rest on it. The body is planned
(:mod:`sidecar.counting.plan`, with vLLM's rendering rules in :mod:`sidecar.counting.render`),
counted one of three ways, reported in :class:`TokenCount.method`, and truncated as vLLM
truncates it (:class:`~sidecar.counting.plan.Truncation`, applied here to every count):

1. ``exact_local``: the model's own fast tokenizer and chat template, in this process
   (:mod:`sidecar.counting.tokenizer`). Long inputs (more than ``offload_threshold_chars``) are
   tokenized on a small dedicated thread pool, with the GIL released while the Rust tokenizer
   works, so the event loop keeps serving; short ones inline, where a thread hop would cost
   more than the work. Long counts take one of ``max_concurrent_counts`` slots
   (:mod:`sidecar.counting.slots`); one that would wait more than ``max_count_wait_s`` for a
   slot is shed with :class:`~sidecar.errors.CountingBusy`. A sample of local counts is
   checked against vLLM in the background (:mod:`sidecar.counting.self_check`): its render
   endpoint where it serves one, else ``/tokenize``; a shape whose counts differ (vLLM started
   with its own ``--chat-template``, say) is counted upstream from then on.
2. ``exact_upstream``: vLLM counts it (:mod:`sidecar.counting.upstream`): ``POST /tokenize``
   (one round trip per prompt, concurrent for a list of prompts), or its render endpoint for the
   request's endpoint (one round trip for the whole body) where vLLM serves render
   (``--enable-scale-out``) and it is the better of the two (``render``: see
   :func:`~sidecar.counting.upstream.render_first`). Used when no tokenizer is loaded, for
   content the tokenizer cannot expand (images, audio), for request-supplied chat templates, and
   whenever the local path fails. A 400 from /tokenize is vLLM refusing the prompt:
   :class:`PromptError` with vLLM's message.
3. ``estimate``: nothing above can count it (or, after a failure, vLLM is left alone for a
   while), an upper bound (:mod:`sidecar.counting.estimate`). Shapes only render can count are
   estimates without it: completions with ``suffix``, Responses input items the sidecar does not
   mirror, and gpt-oss chats (vLLM renders Harmony; the template's count is reported, flagged);
   Responses with ``previous_response_id`` always are (the history lives in vLLM). A warning is
   logged at most once a minute per cause.

With ``block_size`` set, each exact count also carries, per prompt, the chain hashes of the
prompt's full KV blocks (:func:`sidecar.kv.prefix.block_hashes` of the very token ids vLLM will
cache: rendered, tokenized and truncated as vLLM does, salted with the body's model name and
``cache_salt``), so that the ledger can charge the blocks that requests in flight share once.
They come from the ids the count was made from, never from a second tokenization: the local
tokenizer's ids, token-id prompts as given, or ``/tokenize``'s ``tokens``. Where the ids are not
known for certain (estimates, non-text content, gpt-oss chats, ``prompt_logprobs``, which makes
vLLM skip the prefix cache), :attr:`TokenCount.prefix` is None.

What the counter cannot see: vLLM's server flags that change rendering (``--chat-template``,
``--chat-template-content-format``, ``--default-chat-template-kwargs``, ``--tokenizer-mode``,
``--exclude-tools-when-tool-choice-none``) and a processor chat template that differs from the
tokenizer's (multimodal models). The self-check catches all of them; with /tokenize as its
oracle (vLLM without render) all but ``--exclude-tools-when-tool-choice-none``, which /tokenize
does not apply (the count then includes tools vLLM leaves out: too high, never too low).

Only :class:`PromptError` (a ``BadRequest``) leaves :meth:`PromptCounter.count`: the body's
prompt cannot be interpreted and vLLM would answer 400 too (or it is ``prompt_embeds``, which
the sidecar cannot size); and :class:`~sidecar.errors.CountingBusy` when long prompts are shed.
Everything else degrades to a less exact method.

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
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import httpx

from sidecar.counting.estimate import estimate_anything
from sidecar.counting.plan import (
    ChatPlan,
    CompletionPlan,
    EstimatePlan,
    Plan,
    PromptTokens,
    Truncation,
    plan_count,
)
from sidecar.counting.prefix_ids import hash_prompts, reads_prefix_cache, salt_value
from sidecar.counting.render import NeedsUpstream
from sidecar.counting.request import CountedEndpoint
from sidecar.counting.self_check import (
    CountingObserver,
    PromptShape,
    SelfCheckSchedule,
    prompt_shape,
)
from sidecar.counting.slots import DEFAULT_MAX_COUNT_WAIT_S, CountingSlots, Slot, default_slots
from sidecar.counting.tokenizer import OFFLOAD_WORKERS, ModelTokenizer, count_locally
from sidecar.counting.upstream import (
    RENDER_MODES,
    RenderDeclined,
    RenderMode,
    UpstreamUnavailable,
    VllmCounting,
    render_first,
    renderable,
)
from sidecar.errors import CountingBusy, PromptError
from sidecar.kv.prefix import BlockHashes

__all__ = [
    "RENDER_MODES",
    "CountMethod",
    "PromptCounter",
    "RenderMode",
    "TokenCount",
    "render_first",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_UPSTREAM_TIMEOUT_S = 10.0
_WARN_EVERY_S = 60.0
#: Prompts with more tokens than this are hashed on a worker thread (~1 ms at 16-token blocks).
_HASH_INLINE_TOKENS = 32_768


class CountMethod(enum.StrEnum):
    """How a prompt was counted; the value is the metric label."""

    LOCAL = "exact_local"
    UPSTREAM = "exact_upstream"
    ESTIMATE = "estimate"


@dataclass(frozen=True, slots=True)
class TokenCount:
    """The prompt tokens of one request body, truncated as vLLM truncates them.

    ``prompts`` has one entry per engine request vLLM makes of the body: several for a
    completions ``prompt`` that is a list of prompts, one otherwise. ``prefix``, aligned with
    ``prompts``, holds the chain hashes of each prompt's full KV blocks
    (:mod:`sidecar.kv.prefix`), or is None: the counter has no ``block_size``, or the ids vLLM
    will cache are not known for certain (estimates, non-text content, ...).

    >>> TokenCount((3, 4), CountMethod.UPSTREAM, 0.001).total
    7
    """

    prompts: tuple[int, ...]
    method: CountMethod
    seconds: float
    prefix: tuple[BlockHashes, ...] | None = None
    #: the ``max_tokens`` vLLM resolved for each prompt, when its render endpoint counted them
    #: (its ``get_max_tokens`` of the request, the generation config and the context); None:
    #: not rendered, and the projection resolves it as vLLM 0.32 does
    max_tokens: tuple[int, ...] | None = None

    @property
    def total(self) -> int:
        return sum(self.prompts)

    @property
    def exact(self) -> bool:
        return self.method is not CountMethod.ESTIMATE


class _Counted(NamedTuple):
    """The untruncated counts of a plan, how they were made, the tokens behind them (None: not
    known, or not asked for) and, when vLLM rendered them, the max_tokens it resolved."""

    counts: Sequence[int]
    method: CountMethod
    tokens: Sequence[PromptTokens] | None
    max_tokens: tuple[int, ...] | None = None


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
    when it fails to load, counts go to vLLM: ``/tokenize``, or its render endpoints where
    ``render`` says (:data:`~sidecar.counting.upstream.RENDER_MODES`) and vLLM serves them.
    Pass ``tokenizer=`` to share one already loaded.
    ``max_model_len`` resolves ``truncate_prompt_tokens: -1`` (pass the engine's; it is also
    learnt from ``/tokenize`` answers). The first local count of each :class:`PromptShape`,
    then one in ``self_check_every``, is compared with vLLM's (render, else /tokenize) in the
    background and the outcome told to ``observer``. ``block_size`` (vLLM's KV block size)
    turns on :attr:`TokenCount.prefix`; None costs nothing. At most ``max_concurrent_counts``
    long prompts are tokenized at once (None: the CPUs less one), the others wait up to
    ``max_count_wait_s`` for a slot (:attr:`slots`).

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
        block_size: int | None = None,
        max_concurrent_counts: int | None = None,
        max_count_wait_s: float = DEFAULT_MAX_COUNT_WAIT_S,
        render: RenderMode = "off",
    ) -> None:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, not {block_size}")
        if render not in RENDER_MODES:
            raise ValueError(f"render must be one of {RENDER_MODES}, not {render!r}")
        self.render = render
        self.block_size = block_size
        #: vLLM's counting endpoints: render, /tokenize
        self.upstream = VllmCounting(
            client,
            upstream,
            served_model=served_model,
            timeout_s=upstream_timeout_s,
            render=render != "off",
        )
        self._served_model = served_model
        self.offload_threshold_chars = offload_threshold_chars
        self.max_model_len = max_model_len
        self._executor: ThreadPoolExecutor | None = None
        #: long counts at once and their bounded wait
        self.slots = CountingSlots(
            max_concurrent_counts if max_concurrent_counts is not None else default_slots(),
            max_wait_s=max_count_wait_s,
        )
        self._local: ModelTokenizer | None = tokenizer
        self._loading: Future[ModelTokenizer | None] | None = None
        self._warnings = _RateLimitedWarning()
        self._schedule = SelfCheckSchedule(self_check_every)
        self._observer = observer
        #: shapes counted by vLLM since a local count of theirs disagreed with vLLM's
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
        tokens: Sequence[PromptTokens] | None = None
        try:
            plan = plan_count(endpoint, body)
            counts, method, tokens, max_tokens = await self._count(endpoint, body, plan)
        except (PromptError, CountingBusy):
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
            method, max_tokens = CountMethod.ESTIMATE, None
        prefix = None
        if plan is not None:
            if plan.truncation.keep == -1 and self.max_model_len is None:
                self._warnings.warn(
                    "truncation",
                    "truncate_prompt_tokens=-1 needs max_model_len, which the prompt counter "
                    "was not given; the prompt is counted whole",
                )
            counts = plan.truncation.apply_all(counts, self.max_model_len)
            if tokens is not None and method is not CountMethod.ESTIMATE:
                prefix = await self._prefix(endpoint, body, plan.truncation, tokens, counts)
        return TokenCount(tuple(counts), method, time.perf_counter() - started, prefix, max_tokens)

    # -- the prefix: chain hashes of the full blocks vLLM will cache -----------------------------

    async def _prefix(
        self,
        endpoint: CountedEndpoint,
        body: Mapping[str, Any],
        truncation: Truncation,
        tokens: Sequence[PromptTokens],
        counts: Sequence[int],
    ) -> tuple[BlockHashes, ...] | None:
        block_size = self.block_size
        if block_size is None or not reads_prefix_cache(endpoint, body):
            return None
        salt = (self._salt_model(body), salt_value(body.get("cache_salt")))
        n_tokens = sum(len(t.ids) for t in tokens)
        try:
            if n_tokens <= _HASH_INLINE_TOKENS:
                return hash_prompts(
                    tokens, counts, truncation, self.max_model_len, block_size, salt
                )
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._pool(),
                hash_prompts,
                tokens,
                counts,
                truncation,
                self.max_model_len,
                block_size,
                salt,
            )
        except Exception as exc:
            # A bug here must cost sharing (blocks charged in full), never the request.
            self._warnings.warn(
                "prefix",
                "prompt block hashing failed (%s: %s); the prompt's blocks are not shared",
                type(exc).__name__,
                exc,
            )
            return None

    def _salt_model(self, body: Mapping[str, Any]) -> str | None:
        """The model name the request asks for: a LoRA adapter is selected by it, and vLLM keys
        an adapter's blocks apart from the base model's."""
        model = body.get("model")
        if isinstance(model, str) and model:
            return model
        return self._served_model

    # -- the three ways ----------------------------------------------------------------------

    async def _count(
        self, endpoint: CountedEndpoint, body: Mapping[str, Any], plan: Plan
    ) -> _Counted:
        """The untruncated counts of ``plan``, how they were made, and the tokens behind them
        (only when prefixes are asked for, and only if they are what vLLM will cache)."""
        want = self.block_size is not None and not (isinstance(plan, ChatPlan) and plan.multimodal)
        if isinstance(plan, EstimatePlan):
            rendered = await self._render(endpoint, body, want)
            if rendered is not None:
                return rendered
            self._warnings.warn(
                f"unsupported:{plan.reason}",
                "cannot count %s exactly; using an upper-bound estimate",
                plan.reason,
            )
            return _Counted(plan.estimate(), CountMethod.ESTIMATE, None)
        if isinstance(plan, ChatPlan) and plan.reused_ids is not None:
            reused = plan.reused_ids
            return _Counted(
                (len(reused),), CountMethod.LOCAL, [PromptTokens(reused)] if want else None
            )
        if isinstance(plan, CompletionPlan) and plan.token_ids_only:
            # no tokenizer needed
            ids = [p for p in plan.prompts if isinstance(p, list)]
            return _Counted(
                [len(p) for p in ids], CountMethod.LOCAL, [PromptTokens(p) for p in ids]
            )
        local = self._tokenizer()
        shape = prompt_shape(endpoint, plan)
        usable = not (isinstance(plan, ChatPlan) and plan.upstream_only)
        if local is not None and local.harmony and isinstance(plan, ChatPlan):
            # vLLM renders gpt-oss chats with Harmony, not with the template: only it can count.
            rendered = await self._render(endpoint, body, want)
            if rendered is not None:
                return rendered
        if local is not None and usable and shape not in self._mismatched:
            try:
                tokens = await self._run(plan.chars, count_locally, local, plan)
            except CountingBusy:
                raise
            except NeedsUpstream as exc:
                logger.debug("local count not exact (%s); asking vLLM", exc)
            except Exception as exc:
                # vLLM may still render it (or refuse it with its own message).
                self._warnings.warn(
                    f"local:{type(exc).__name__}",
                    "local prompt count failed (%s: %s); asking vLLM",
                    type(exc).__name__,
                    exc,
                )
            else:
                counts = [len(t.ids) for t in tokens]
                if local.harmony and isinstance(plan, ChatPlan):
                    self._warnings.warn(
                        "harmony",
                        "%s renders chats with Harmony; its chat template only approximates "
                        "vLLM's count (vLLM's render endpoint would count it exactly)",
                        local.path,
                    )
                    return _Counted(counts, CountMethod.ESTIMATE, None)
                self._maybe_self_check(shape, endpoint, body, plan, counts)
                return _Counted(counts, CountMethod.LOCAL, tokens if want else None)
        if self.render == "always" or render_first(endpoint, plan):
            rendered = await self._render(endpoint, body, want)
            if rendered is not None:
                return rendered
        try:
            counts, known = await self._count_upstream(plan, want_tokens=want)
        except UpstreamUnavailable as exc:
            self._warnings.warn(
                "upstream",
                "vLLM's /tokenize is unavailable (%s); prompt counts are upper-bound estimates",
                exc,
            )
            return _Counted(plan.estimate(), CountMethod.ESTIMATE, None)
        return _Counted(counts, CountMethod.UPSTREAM, known)

    # -- vLLM's render endpoints -------------------------------------------------------------

    async def _render(
        self, endpoint: CountedEndpoint, body: Mapping[str, Any], want_tokens: bool
    ) -> _Counted | None:
        """vLLM's own rendering of ``body``, when it serves render and answers for this body;
        None sends the count on (to the local tokenizer, /tokenize or an estimate)."""
        upstream = self.upstream
        if not (upstream.render_ready() and renderable(endpoint, body)):
            return None
        try:
            rendered = await upstream.render(endpoint, body)
        except (RenderDeclined, UpstreamUnavailable) as exc:
            logger.debug("vLLM's render did not count the prompt (%s)", exc)
            return None
        upstream.render_served()
        counts = [len(r.ids) for r in rendered]
        # The ids are the ones vLLM keeps, already truncated: which of them the tokenizer added
        # does not matter unless the counter would truncate further (then: no prefix).
        tokens = [PromptTokens(r.ids, None) for r in rendered] if want_tokens else None
        resolved = [r.max_tokens for r in rendered]
        max_tokens = tuple(m for m in resolved if m is not None)
        return _Counted(
            counts,
            CountMethod.UPSTREAM,
            tokens,
            max_tokens if len(max_tokens) == len(resolved) else None,
        )

    # -- the self-check ----------------------------------------------------------------------

    def _maybe_self_check(
        self,
        shape: PromptShape,
        endpoint: CountedEndpoint,
        body: Mapping[str, Any],
        plan: CompletionPlan | ChatPlan,
        counts: Sequence[int],
    ) -> None:
        """Compare this local count with vLLM's in the background, if the schedule says so."""
        if not self.upstream.configured:
            return
        if not self._schedule.due(shape):
            return
        if self.upstream.failing:
            self._schedule.done(shape, checked=False)  # vLLM is failing: owe it, ask later
            return
        check = self._check(shape, endpoint, body, plan, list(counts))
        task = asyncio.get_running_loop().create_task(check)
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _oracle(
        self, endpoint: CountedEndpoint, body: Mapping[str, Any], plan: CompletionPlan | ChatPlan
    ) -> tuple[str, list[int], bool]:
        """vLLM's counts of ``plan``: which endpoint answered, the counts, and whether vLLM
        truncated them already (render) or not (/tokenize)."""
        rendered = await self._render(endpoint, body, want_tokens=False)
        if rendered is not None:
            return "render", list(rendered[0]), True
        counts, _ = await self._count_upstream(plan)
        return "/tokenize", counts, False

    async def _check(
        self,
        shape: PromptShape,
        endpoint: CountedEndpoint,
        body: Mapping[str, Any],
        plan: CompletionPlan | ChatPlan,
        local_counts: list[int],
    ) -> None:
        try:
            oracle, upstream_counts, truncated = await self._oracle(endpoint, body, plan)
        except UpstreamUnavailable as exc:
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
        if truncated:
            truncation = plan.truncation
            if truncation.keep == -1 and self.max_model_len is None:
                # vLLM truncated to a context this counter does not know: not comparable.
                logger.debug("self-check of %s counts skipped: max_model_len unknown", shape)
                return
            local_counts = list(truncation.apply_all(local_counts, self.max_model_len))
        matched = upstream_counts == local_counts
        if not matched and shape not in self._mismatched:
            self._mismatched.add(shape)
            logger.error(
                "local %s prompt count %s differs from vLLM's %s %s; counting %s prompts "
                "with vLLM from now on (is vLLM started with its own --chat-template, "
                "--chat-template-content-format or --default-chat-template-kwargs, or another "
                "tokenizer?)",
                shape,
                local_counts,
                oracle,
                upstream_counts,
                shape,
            )
        elif matched:
            logger.debug("local %s prompt count agrees with vLLM's %s", shape, oracle)
        if self._observer is not None:
            try:
                self._observer.self_checked(shape, matched)
            except Exception:
                logger.exception("the counting observer failed")

    # -- vLLM's /tokenize --------------------------------------------------------------------

    async def _count_upstream(
        self, plan: CompletionPlan | ChatPlan, *, want_tokens: bool = False
    ) -> tuple[list[int], list[PromptTokens] | None]:
        """The untruncated counts by /tokenize, and (``want_tokens``) the ids it answered."""
        if not self.upstream.configured:
            raise UpstreamUnavailable("no upstream configured")
        # Which of the answered ids the tokenizer added (BOS, EOS) /tokenize does not say: only
        # without special tokens is it known (none), and truncation needs it.
        added = None if plan.add_special_tokens else (0, 0)
        if isinstance(plan, ChatPlan):
            count, ids = await self._tokenize(plan.upstream_payload(), want_tokens)
            return [count], None if ids is None else [PromptTokens(ids, added)]
        counts = [len(p) if isinstance(p, list) else 0 for p in plan.prompts]
        tokens: list[PromptTokens | None] = [
            PromptTokens(p) if isinstance(p, list) else None for p in plan.prompts
        ]
        texts = [(i, p) for i, p in enumerate(plan.prompts) if isinstance(p, str)]
        results = await asyncio.gather(
            *(
                self._tokenize(
                    {"prompt": p, "add_special_tokens": plan.add_special_tokens}, want_tokens
                )
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
                counts[i], ids = result
                tokens[i] = None if ids is None else PromptTokens(ids, added)
        known = [t for t in tokens if t is not None]
        return counts, known if want_tokens and len(known) == len(tokens) else None

    async def _tokenize(
        self, payload: dict[str, Any], want_tokens: bool = False
    ) -> tuple[int, list[int] | None]:
        """The count /tokenize answers, and its token ids when asked for and consistent."""
        count, ids, max_model_len = await self.upstream.tokenize(payload, want_tokens)
        if self.max_model_len is None and max_model_len is not None:
            self.max_model_len = max_model_len
        return count, ids

    # -- plumbing -----------------------------------------------------------------------------

    async def _run(self, chars: int, fn: Callable[..., _T], *args: Any) -> _T:
        if chars <= self.offload_threshold_chars:
            return fn(*args)
        slot = await self.slots.acquire(chars)  # CountingBusy: shed
        try:
            work = self._pool().submit(fn, *args)
        except BaseException:
            self.slots.release(slot, seconds=None)
            raise
        loop = asyncio.get_running_loop()
        # The slot is the thread's until it has finished, even if the request goes away (the
        # thread cannot be stopped): release it from the thread's end, on the loop.
        work.add_done_callback(lambda done: _release_soon(loop, self.slots, slot, done))
        return await asyncio.wrap_future(work)

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
            # a thread per slot, and one more so that hashing a long prompt's blocks (and the
            # tokenizer's load) never waits behind the counts
            self._executor = ThreadPoolExecutor(
                max_workers=max(OFFLOAD_WORKERS, self.slots.slots + 1),
                thread_name_prefix="kv-sidecar-tokens",
            )
        return self._executor


def _release_soon(
    loop: asyncio.AbstractEventLoop, slots: CountingSlots, slot: Slot, done: Future[Any]
) -> None:
    """From the worker thread (or the loop, for a count cancelled before it started): give the
    slot back on the loop, learning from the count's wall time if it succeeded."""

    def release() -> None:
        ok = not done.cancelled() and done.exception() is None
        seconds = slots.held_s(slot) if ok else None
        slots.release(slot, seconds=seconds)

    with suppress(RuntimeError):  # the loop has closed: nothing left to release into
        loop.call_soon_threadsafe(release)


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
