"""Request planning: what to count for a generation body, decided from the body alone.

A plan says which prompts vLLM will make of the body and how it will tokenize them: for
completions the prompts (text or token ids) and ``add_special_tokens``; for chat and Responses
the messages, tools and template inputs as vLLM hands them to the chat template (see
:mod:`sidecar.counting.render`); or, for shapes only vLLM could count, an estimate and why. Each
plan also carries its :class:`Truncation`, the one place ``truncate_prompt_tokens`` (and
Responses' ``truncation``) is interpreted. Pure: no tokenizer, no I/O.

>>> plan = plan_count("completions", {"prompt": [[1, 2, 3], [4]], "truncate_prompt_tokens": 2})
>>> plan.prompts, plan.truncation.apply_all((3, 1), max_model_len=None)
([[1, 2, 3], [4]], (2, 1))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.counting.estimate import (
    estimate_anything,
    estimate_chat,
    estimate_completion_prompt,
    estimate_text,
)
from sidecar.counting.render import (
    UnsupportedItem,
    as_chat_message,
    chat_tool,
    has_non_text_content,
    merge_kwargs,
    response_messages,
    response_tools,
)
from sidecar.counting.request import CountedEndpoint, check_messages
from sidecar.errors import BadRequest, PromptError


@dataclass(frozen=True, slots=True)
class Truncation:
    """``truncate_prompt_tokens`` as vLLM 0.32 applies it after tokenizing.

    vLLM's rule (``TokenizeParams.get_encode_kwargs`` and ``max_truncation_tokens`` in
    ``vllm/renderers/params.py``): ``None`` keeps the whole prompt; ``n >= 0`` keeps ``n``
    tokens; ``-1`` keeps ``max_model_len - 1`` tokens when the request's output limit is
    non-zero (one token of context held back for output), else ``max_model_len``. The output
    limit is ``max_tokens or 0`` as the request gives it (``max_completion_tokens`` first for
    chat, ``max_output_tokens`` for Responses; completions default to 16, also for a null).
    Completions and chat read ``truncate_prompt_tokens``; Responses truncate with ``-1`` unless
    ``truncation`` is ``"disabled"``; vLLM's Anthropic ``/v1/messages`` never truncates.

    This is the only place the sidecar truncates a prompt count: the counter applies it to
    every count it returns, whichever way it counted.

    >>> Truncation(-1, max_output_tokens=16).apply(2000, max_model_len=1024)
    1023
    >>> Truncation(-1, max_output_tokens=0).apply(2000, max_model_len=1024)
    1024
    """

    keep: int | None = None
    max_output_tokens: int = 0

    def keep_for(self, max_model_len: int | None) -> int | None:
        """How many tokens vLLM keeps at most; None: the whole prompt (no truncation, or ``-1``
        with ``max_model_len`` unknown: vLLM's own check decides)."""
        keep = self.keep
        if keep is None or keep >= 0:
            return keep
        if max_model_len is None:
            return None
        # vLLM holds one token of context back for output when output was asked for.
        return max_model_len if self.max_output_tokens == 0 else max(0, max_model_len - 1)

    def apply(self, count: int, max_model_len: int | None) -> int:
        """The tokens vLLM keeps of a ``count``-token prompt; ``-1`` needs ``max_model_len``
        (unknown: the count is left whole, and vLLM's own check decides)."""
        keep = self.keep_for(max_model_len)
        return count if keep is None else min(count, keep)

    def apply_all(self, counts: Sequence[int], max_model_len: int | None) -> tuple[int, ...]:
        return tuple(self.apply(n, max_model_len) for n in counts)

    def apply_ids(self, tokens: PromptTokens, max_model_len: int | None) -> Sequence[int] | None:
        """The token ids vLLM keeps (and caches) of ``tokens``; None when that is not known.

        A generating vLLM truncates on the left (its tokenizers are loaded with
        ``truncation_side="left"``, ``vllm/tokenizers/registry.py``): it keeps the *last*
        tokens. Text is truncated by the tokenizer itself (``truncation=True, max_length=keep``),
        which keeps the tokens it adds around the text (BOS, EOS) and cuts the text's own
        tokens; token ids are sliced (``TokenizeParams._truncation_slice``).

        >>> t = Truncation(4)
        >>> t.apply_ids(PromptTokens([1, 2, 3, 4, 5, 6]), None)
        [3, 4, 5, 6]
        >>> t.apply_ids(PromptTokens([0, 2, 3, 4, 5, 9], added=(1, 1)), None)
        [0, 4, 5, 9]
        >>> t.apply_ids(PromptTokens([0, 2, 3, 4, 5, 6], added=None), None) is None
        True
        """
        ids = tokens.ids
        keep = self.keep_for(max_model_len)
        if keep is None or keep >= len(ids):
            return ids
        if tokens.added is None:
            return None  # which ids the tokenizer added is unknown
        head, tail = tokens.added
        kept = keep - head - tail
        if kept < 0 or (keep == 0 and head + tail):
            return None  # the tokenizer's own corner cases: not worth mirroring
        end = len(ids) - tail
        return [*ids[:head], *ids[end - kept : end], *ids[end:]]


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """One prompt's token ids as vLLM's tokenizer makes them, before truncation.

    ``added``: how many of them the tokenizer itself added before and after the text (its
    post-processor's BOS, EOS), which truncation keeps; ``(0, 0)`` for token ids given as such
    and for text tokenized without special tokens; None when unknown (vLLM's ``/tokenize``
    with special tokens).
    """

    ids: Sequence[int]
    added: tuple[int, int] | None = (0, 0)


@dataclass(slots=True)
class CompletionPlan:
    """One engine request per prompt: text is tokenized, token ids count as given."""

    prompts: list[str | list[int]]
    add_special_tokens: bool
    truncation: Truncation
    chars: int

    @property
    def token_ids_only(self) -> bool:
        """Every prompt is token ids: counted without a tokenizer."""
        return all(isinstance(p, list) for p in self.prompts)

    def estimate(self) -> tuple[int, ...]:
        return tuple(estimate_completion_prompt(p) for p in self.prompts)


@dataclass(slots=True)
class ChatPlan:
    """One engine request: the chat rendered by the template, then tokenized."""

    messages: Sequence[Mapping[str, Any]]
    #: tools as vLLM dumps them for the template (``ChatCompletionToolsParam.model_dump()``)
    tools: list[dict[str, Any]] | None
    #: ``chat_template_kwargs`` merged with the request's template fields, without the two flags
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    truncation: Truncation
    chars: int
    #: some message content is not text (images, audio, ...)
    multimodal: bool = False
    #: why only vLLM can count this one (non-text content, a request-supplied template)
    upstream_only: str | None = None
    #: a request-supplied chat template, for the upstream call
    chat_template: str | None = None
    #: ``kv_transfer_params.prompt_token_ids``: the prompt vLLM will use as is (untruncated)
    reused_ids: list[int] | None = None
    #: the messages in the shape /tokenize validates, when ``messages`` are not (Responses)
    upstream_messages: Sequence[Mapping[str, Any]] | None = None

    def local_kwargs(self) -> dict[str, Any]:
        """The keyword arguments vLLM hands ``apply_chat_template`` (before ``tools``)."""
        defaults = {"tools": self.tools, "tokenize": False}
        flags = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        return merge_kwargs(defaults, merge_kwargs(self.template_kwargs, flags))

    def upstream_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "messages": self.messages if self.upstream_messages is None else self.upstream_messages,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "add_special_tokens": self.add_special_tokens,
        }
        if self.tools is not None:
            payload["tools"] = self.tools
        if self.template_kwargs:
            payload["chat_template_kwargs"] = self.template_kwargs
        if self.chat_template is not None:
            payload["chat_template"] = self.chat_template
        return payload

    def estimate(self) -> tuple[int, ...]:
        if self.reused_ids is not None:
            return (len(self.reused_ids),)
        return (estimate_chat(self.messages, self.tools, self.template_kwargs),)


@dataclass(slots=True)
class EstimatePlan:
    """Neither the tokenizer nor /tokenize can count this body exactly."""

    reason: str
    prompts: tuple[int, ...]
    truncation: Truncation = field(default_factory=Truncation)

    def estimate(self) -> tuple[int, ...]:
        return self.prompts


Plan = CompletionPlan | ChatPlan | EstimatePlan


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _check_ids(ids: list[int]) -> list[int]:
    if any(t < 0 for t in ids):
        raise PromptError("Token ids in prompt must be non-negative integers.")
    return ids


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PromptError(f"`{key}` must be an integer.")
    return value


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PromptError(f"`{key}` must be a boolean.")
    return value


def _truncation(body: Mapping[str, Any], max_output_tokens: int) -> Truncation:
    keep = _optional_int(body, "truncate_prompt_tokens")
    if keep is not None and keep < -1:
        raise PromptError("`truncate_prompt_tokens` must be -1 or a non-negative integer.")
    return Truncation(keep, max_output_tokens)


def _plan_completions(body: Mapping[str, Any]) -> Plan:
    if body.get("prompt_embeds") not in (None, []):
        raise PromptError("prompt_embeds is not supported by the sidecar's admission control.")
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        raise PromptError("Either prompt or prompt_embeds must be provided and non-empty.")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list):
        if not prompt:
            raise PromptError("You must pass at least one prompt")
        if _is_token_ids(prompt):
            prompts = [_check_ids(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif all(isinstance(p, list) and (not p or _is_token_ids(p)) for p in prompt):
            prompts = [_check_ids(p) for p in prompt]
        else:
            raise PromptError(
                "`prompt` must be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids."
            )
    else:
        raise PromptError(
            "`prompt` must be a string, a list of strings, a list of token ids "
            "or a list of lists of token ids."
        )
    # vLLM's completions default max_tokens (16) also replaces an explicit null.
    max_tokens = _optional_int(body, "max_tokens")
    truncation = _truncation(body, 16 if max_tokens is None else max_tokens)
    if body.get("suffix") is not None:
        # Fill-in-the-middle is rendered by a few model-specific renderers only; a plain HF
        # model refuses it. Neither the tokenizer nor /tokenize can tell what vLLM will do.
        return EstimatePlan(
            "suffix (fill-in-the-middle) requests",
            tuple(
                estimate_completion_prompt(p) + estimate_text(str(body["suffix"])) for p in prompts
            ),
            truncation,
        )
    return CompletionPlan(
        prompts=prompts,
        add_special_tokens=_flag(body, "add_special_tokens", True),
        truncation=truncation,
        chars=sum(len(p) for p in prompts if isinstance(p, str)),
    )


def _template_kwargs(body: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    user = body.get("chat_template_kwargs")
    if user is not None and not isinstance(user, Mapping):
        raise PromptError("`chat_template_kwargs` must be an object.")
    merged = dict(extra)
    reasoning_effort = merged.get("reasoning_effort")
    if reasoning_effort is not None and "enable_thinking" not in (user or {}):
        # vLLM turns thinking on for templates that need an explicit opt-in.
        merged["enable_thinking"] = reasoning_effort != "none"
    return merge_kwargs(user, merged)


def _reused_ids(body: Mapping[str, Any], messages: object) -> list[int] | None:
    """Disaggregated decode: vLLM takes forwarded prompt ids instead of rendering the chat.

    It feeds them to the engine as they are (``preprocess_chat`` in
    ``vllm/renderers/online_renderer.py``): no template, no tokenizer, no truncation.
    """
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, Mapping):
        return None
    ids = kv.get("prompt_token_ids")
    if ids is None or body.get("echo") or has_non_text_content(messages):
        return None
    if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
        raise PromptError(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list "
            "of non-negative integers."
        )
    return ids


def _plan_chat(body: Mapping[str, Any]) -> Plan:
    try:
        messages = check_messages(body.get("messages"))
    except BadRequest as exc:
        raise PromptError(exc.message) from None
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final_message = _flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise PromptError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    raw_tools = body.get("tools")
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise PromptError("`tools` must be a list.")
    tools = None if raw_tools is None else [chat_tool(t) for t in raw_tools]
    documents = body.get("documents")
    reasoning_effort = body.get("reasoning_effort")
    template_kwargs = _template_kwargs(
        body, {"documents": documents, "reasoning_effort": reasoning_effort}
    )
    max_completion = _optional_int(body, "max_completion_tokens")
    max_output = max_completion if max_completion is not None else _optional_int(body, "max_tokens")
    chat_template = body.get("chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise PromptError("`chat_template` must be a string.")
    multimodal = has_non_text_content(messages)
    truncation = _truncation(body, max_output or 0)
    reused = _reused_ids(body, messages)
    if reused is not None:
        truncation = Truncation()  # forwarded ids reach the engine untruncated
    upstream_only = None
    if chat_template is not None or template_kwargs.get("chat_template") is not None:
        upstream_only = "a request-supplied chat template"
    elif multimodal:
        upstream_only = "non-text content"
    return ChatPlan(
        messages=messages,
        tools=tools,
        template_kwargs=template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=_flag(body, "add_special_tokens", False),
        truncation=truncation,
        chars=chars_in(messages) + chars_in(tools) + chars_in(documents),
        multimodal=multimodal,
        upstream_only=upstream_only,
        chat_template=chat_template,
        reused_ids=reused,
    )


def _plan_responses(body: Mapping[str, Any]) -> Plan:
    items = body.get("input")
    max_output = _optional_int(body, "max_output_tokens") or 0
    # vLLM: ``-1 if request.truncation != "disabled" else None``; a null truncates too.
    truncate = -1 if body.get("truncation", "disabled") != "disabled" else None
    truncation = Truncation(truncate, max_output)
    if body.get("previous_response_id") is not None:
        # The history lives in vLLM's response store; only vLLM knows how long it is.
        return EstimatePlan("previous_response_id", (estimate_anything(body),), truncation)
    try:
        messages = response_messages(body.get("instructions"), items)
    except UnsupportedItem as exc:
        reason = f"Responses input items of type {exc}"
        return EstimatePlan(reason, (estimate_anything(body),), truncation)
    last = items[-1] if isinstance(items, list) and items else None
    continue_final = (
        isinstance(last, Mapping)
        and last.get("type", "message") in ("message", "reasoning")
        and last.get("status") in ("in_progress", "incomplete")
    )
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    tools = response_tools(body.get("tools"))
    multimodal = has_non_text_content(messages)
    reused = _reused_ids(body, messages)
    if reused is not None:
        truncation = Truncation()  # forwarded ids reach the engine untruncated
    return ChatPlan(
        messages=messages,
        tools=tools,
        template_kwargs=_template_kwargs(body, {"reasoning_effort": effort}),
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        # The Responses endpoint tokenizes the rendered chat with vLLM's default, true.
        add_special_tokens=True,
        truncation=truncation,
        chars=chars_in(messages) + chars_in(tools),
        multimodal=multimodal,
        upstream_only="non-text content" if multimodal else None,
        reused_ids=reused,
        upstream_messages=[as_chat_message(m) for m in messages],
    )


def plan_count(endpoint: CountedEndpoint, body: Mapping[str, Any]) -> Plan:
    """What to count for ``body`` sent to ``endpoint``; :class:`PromptError` if vLLM would refuse
    to interpret its prompt."""
    if not isinstance(body, Mapping):
        raise PromptError("The request body must be a JSON object.")
    if endpoint == "completions":
        return _plan_completions(body)
    if endpoint == "chat":
        return _plan_chat(body)
    if endpoint == "responses":
        return _plan_responses(body)
    raise PromptError(f"Token counting is not supported for endpoint {endpoint!r}.")


def chars_in(value: object) -> int:
    """Characters of every string in a JSON-like value: the size that predicts tokenizing time."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(chars_in(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(chars_in(v) for v in value)
    return 0
