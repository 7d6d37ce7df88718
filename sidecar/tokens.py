"""Prompt token counting: how many tokens vLLM will put in the KV cache for a request's prompt.

This module owns one question, asked once per generation request before admission: *how many
prompt tokens will vLLM count for this body?* The answer must be exact, because the KV
projection and the admission decision rest on it. It mirrors vLLM 0.32's rendering rules
(``vllm/renderers/chat_utils.py``, ``vllm/renderers/hf.py``, ``vllm/renderers/params.py``,
``vllm/entrypoints/openai/*/protocol.py``, ``vllm/entrypoints/openai/responses/utils.py``):

* **completions**: ``prompt`` is a string, a list of strings, a list of token ids or a list of
  lists of token ids; each element is its own engine request. Text is tokenized with
  ``add_special_tokens`` (default true); token ids count as given.
* **chat**: messages are normalised as vLLM does (content as a list of ``{"type": "text"}`` parts
  for templates that loop over content, else the text parts joined by ``"\\n"``; assistant
  ``tool_calls`` arguments parsed from JSON; tool results flattened; ``developer`` folded into
  ``system`` for templates that do not know it), tools dumped the way vLLM's pydantic models dump
  them, the chat template rendered to text (``add_generation_prompt`` default true,
  ``continue_final_message``, ``chat_template_kwargs``, ``documents``, ``reasoning_effort``),
  then the text tokenized with ``add_special_tokens`` (default false).
* **responses**: ``instructions`` becomes a system message and ``input`` items become chat
  messages exactly as vLLM's ``construct_input_messages`` builds them; the text is tokenized with
  ``add_special_tokens`` true (vLLM's default for that endpoint).
* ``truncate_prompt_tokens`` (and ``truncation: "auto"`` for responses) cut the count as vLLM cuts
  the prompt.

Three ways to count, reported in :class:`TokenCount.method`:

1. ``exact_local``: the model's own fast tokenizer and chat template, in this process. Long inputs
   (more than ``offload_threshold_chars``) are tokenized on a small dedicated thread pool so the
   event loop keeps serving; short ones inline, where a thread hop would cost more than the work.
   The first local count of each endpoint is checked against ``/tokenize`` in the background;
   should they differ (vLLM started with its own ``--chat-template``, say), that endpoint is
   counted upstream from then on.
2. ``exact_upstream``: vLLM's ``POST /tokenize`` (one loopback round trip per prompt, concurrent
   for a list of prompts), used when no tokenizer is loaded, for content the tokenizer cannot
   expand (images, audio), for request-supplied chat templates, and whenever the local path fails.
   A 400 from it is vLLM refusing the prompt: :class:`PromptError` with vLLM's message.
3. ``estimate``: neither is available (or, after a failure, /tokenize is left alone for a while).
   The estimate is an upper bound, not a guess at the mean: one token per UTF-8 byte of text (no
   byte-level BPE or byte-fallback tokenizer produces more), plus a fixed allowance for the
   template's markup and for non-text parts. It is several times too high for ordinary prose, so
   callers should not refuse a request as "never fits" on an estimate alone. Shapes nobody can
   count exactly are estimates too: Responses with ``previous_response_id`` (the history lives in
   vLLM), completions with ``suffix``, and gpt-oss chats (vLLM renders Harmony; the template's
   count is reported, flagged). A warning is logged at most once a minute per cause.

What this module cannot see: vLLM's server flags that change rendering (``--chat-template``,
``--chat-template-content-format``, ``--default-chat-template-kwargs``, ``--tokenizer-mode``,
``--exclude-tools-when-tool-choice-none``) and a processor chat template that differs from the
tokenizer's (multimodal models). The self-check catches all of them but
``--exclude-tools-when-tool-choice-none``, which /tokenize does not apply (the count then
includes tools vLLM leaves out: too high, never too low).

Only :class:`PromptError` (a ``ValueError``) leaves :meth:`PromptCounter.count`: the body's
prompt cannot be interpreted and vLLM would answer 400 too (or it is ``prompt_embeds``, which
the sidecar cannot size). Everything else degrades to a less exact method.

>>> counter = PromptCounter(client=client, upstream="http://127.0.0.1:8000",
...                         served_model="tiny", tokenizer_path="/models/tiny")
>>> await counter.wait_ready()
True
>>> (await counter.count("chat", {"messages": [{"role": "user", "content": "hi"}]})).total
9
"""

from __future__ import annotations

import asyncio
import copy
import enum
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

logger = logging.getLogger(__name__)

Endpoint = Literal["completions", "chat", "responses"]
ContentFormat = Literal["string", "openai"]

_T = TypeVar("_T")


class CountMethod(enum.StrEnum):
    """How a prompt was counted; the value is the metric label."""

    LOCAL = "exact_local"
    UPSTREAM = "exact_upstream"
    ESTIMATE = "estimate"


@dataclass(frozen=True, slots=True)
class TokenCount:
    """The prompt tokens of one request body.

    ``prompts`` has one entry per engine request vLLM makes of the body: several for a
    completions ``prompt`` that is a list of prompts, one otherwise.
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


class PromptError(ValueError):
    """The body's prompt cannot be interpreted; vLLM would refuse it with a 400.

    The message is one line, fit for an OpenAI-shaped error body.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split())[:1000])


class _NeedsUpstream(Exception):
    """The local tokenizer cannot count this request exactly (internal)."""


class _UpstreamUnavailable(Exception):
    """vLLM's /tokenize did not answer usefully (internal)."""


# --------------------------------------------------------------------------------------------
# vLLM's constants (vllm/renderers/chat_utils.py, vllm/tool_parsers/utils.py)
# --------------------------------------------------------------------------------------------

#: Content part types vLLM treats as text, and the key holding their text.
_TEXT_PART_KEYS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
#: Text part types whose part is skipped (not failed) when the text is missing.
_SKIP_NONE_PART_TYPES = frozenset({"text", "refusal"})
#: Part keys that make a part multimodal whatever its ``type`` (``_MEDIA_CONTENT_PART_KEYS``).
_MEDIA_PART_KEYS = frozenset(
    "input_image image_url image_embeds audio_embeds video_embeds prompt_embeds image_pil "
    "audio_url input_audio video_url".split()
)
#: Every field of vLLM's content part TypedDicts; other keys of a text part reach the template.
_KNOWN_PART_FIELDS = frozenset(
    "audio_embeds audio_url closed data file image_embeds image_pil image_url input_audio name "
    "prompt_cache_breakpoint refusal text thinking type uuid video_embeds video_url".split()
)
_BILLING_HEADER = "x-anthropic-billing-header"
_NAMESPACE_SEPARATOR = "__"
_CUSTOM_TOOL_INPUT_KEY = "input"
#: Model types whose chat prompts vLLM renders without the HF chat template (Harmony).
_HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})

# Estimator allowances (tokens). Generous on purpose: the estimate must not undercount.
_EST_PER_PROMPT = 4
_EST_PER_CHAT = 32
_EST_PER_MESSAGE = 8
_EST_PER_TOOL = 16
_EST_PER_NON_TEXT_PART = 2048

_UPSTREAM_TIMEOUT_S = 10.0
#: After /tokenize fails, requests are estimated without asking it again for this long.
_RETRY_AFTER_ERROR_S = 1.0
_RETRY_AFTER_MISSING_S = 30.0
_NO_LENGTH_LIMIT = 1 << 62
_OFFLOAD_WORKERS = 2
_WARN_EVERY_S = 60.0


def _merge_kwargs(
    defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: overrides win unless they are None or "auto"."""
    merged = dict(defaults or {})
    for key, value in (overrides or {}).items():
        if value is not None and not (isinstance(value, str) and value == "auto"):
            merged[key] = value
    return merged


def _reordered(item: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """Known fields first in declaration order, then the rest, as pydantic TypedDicts emit."""
    out = {k: item[k] for k in fields if k in item}
    out.update((k, v) for k, v in item.items() if k not in out)
    return out


# --------------------------------------------------------------------------------------------
# Plans: what to count, decided from the body alone (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Truncation:
    """``truncate_prompt_tokens`` as vLLM applies it after tokenizing (``TokenizeParams``)."""

    keep: int | None = None
    max_output_tokens: int = 0

    def apply(self, count: int, max_model_len: int | None) -> int:
        if self.keep is None:
            return count
        keep = self.keep
        if keep < 0:
            if max_model_len is None:
                return count
            # vLLM holds one token of context back for output when output was asked for.
            keep = max_model_len if self.max_output_tokens == 0 else max(0, max_model_len - 1)
        return min(count, keep)


@dataclass(slots=True)
class _CompletionPlan:
    prompts: list[str | list[int]]
    add_special_tokens: bool
    truncation: _Truncation
    chars: int


@dataclass(slots=True)
class _ChatPlan:
    messages: Sequence[Mapping[str, Any]]
    #: tools as vLLM dumps them for the template (``ChatCompletionToolsParam.model_dump()``)
    tools: list[dict[str, Any]] | None
    #: ``chat_template_kwargs`` merged with the request's template fields, without the two flags
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    truncation: _Truncation
    chars: int
    #: why only vLLM can count this one (non-text content, a request-supplied template)
    upstream_only: str | None = None
    #: a request-supplied chat template, for the upstream call
    chat_template: str | None = None
    #: ``kv_transfer_params.prompt_token_ids``: the prompt vLLM will use as is
    reused_ids: int | None = None
    #: the messages in the shape /tokenize validates, when ``messages`` are not (Responses)
    upstream_messages: Sequence[Mapping[str, Any]] | None = None

    def local_kwargs(self) -> dict[str, Any]:
        """The keyword arguments vLLM hands ``apply_chat_template`` (before ``tools``)."""
        defaults = {"tools": self.tools, "tokenize": False}
        flags = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        return _merge_kwargs(defaults, _merge_kwargs(self.template_kwargs, flags))

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


@dataclass(slots=True)
class _EstimatePlan:
    """Neither the tokenizer nor /tokenize can count this body exactly."""

    reason: str
    prompts: tuple[int, ...]


_Plan = _CompletionPlan | _ChatPlan | _EstimatePlan


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


def _truncation(body: Mapping[str, Any], max_output_tokens: int) -> _Truncation:
    keep = _optional_int(body, "truncate_prompt_tokens")
    if keep is not None and keep < -1:
        raise PromptError("`truncate_prompt_tokens` must be -1 or a non-negative integer.")
    return _Truncation(keep, max_output_tokens)


def _plan_completions(body: Mapping[str, Any]) -> _Plan:
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
    max_output = 16 if max_tokens is None else max_tokens
    if body.get("suffix") is not None:
        # Fill-in-the-middle is rendered by a few model-specific renderers only; a plain HF
        # model refuses it. Neither the tokenizer nor /tokenize can tell what vLLM will do.
        return _EstimatePlan(
            "suffix (fill-in-the-middle) requests",
            tuple(
                _estimate_completion_prompt(p) + _estimate_text(str(body["suffix"]))
                for p in prompts
            ),
        )
    return _CompletionPlan(
        prompts=prompts,
        add_special_tokens=_flag(body, "add_special_tokens", True),
        truncation=_truncation(body, max_output),
        chars=sum(len(p) for p in prompts if isinstance(p, str)),
    )


def _chat_tool(tool: object) -> dict[str, Any]:
    """One chat tool as ``ChatCompletionToolsParam.model_dump()`` gives it to the template."""
    if not isinstance(tool, Mapping):
        raise PromptError("Each entry of `tools` must be an object.")
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
        raise PromptError("Each entry of `tools` must be a function tool with a `function` object.")
    top_defer = tool.get("defer_loading")
    dumped = _function_definition(function, defer_fallback=top_defer)
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if top_defer is not None:
        out["defer_loading"] = top_defer
    return out


def _function_definition(
    function: Mapping[str, Any], *, defer_fallback: object = None
) -> dict[str, Any]:
    """``FunctionDefinition.model_dump()``: fixed keys, ``strict``/``defer_loading`` if set."""
    name = function.get("name")
    if not isinstance(name, str):
        raise PromptError("Each tool function must have a string `name`.")
    description = function.get("description")
    parameters = function.get("parameters")
    if description is not None and not isinstance(description, str):
        raise PromptError("A tool function's `description` must be a string.")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise PromptError("A tool function's `parameters` must be an object.")
    out: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    defer = function.get("defer_loading")
    if defer is None:
        defer = defer_fallback
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _template_kwargs(body: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    user = body.get("chat_template_kwargs")
    if user is not None and not isinstance(user, Mapping):
        raise PromptError("`chat_template_kwargs` must be an object.")
    merged = dict(extra)
    reasoning_effort = merged.get("reasoning_effort")
    if reasoning_effort is not None and "enable_thinking" not in (user or {}):
        # vLLM turns thinking on for templates that need an explicit opt-in.
        merged["enable_thinking"] = reasoning_effort != "none"
    return _merge_kwargs(user, merged)


def _reused_ids(body: Mapping[str, Any], messages: object) -> int | None:
    """Disaggregated decode: vLLM takes forwarded prompt ids instead of rendering the chat."""
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, Mapping):
        return None
    ids = kv.get("prompt_token_ids")
    if ids is None or body.get("echo") or _has_non_text_content(messages):
        return None
    if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
        raise PromptError(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list "
            "of non-negative integers."
        )
    return len(ids)


def _has_non_text_content(messages: object) -> bool:
    """vLLM's ``has_non_text_content``: any list content part that is not text."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            part_type = part.get("type", "text")
            if (
                any(key in part for key in _MEDIA_PART_KEYS)
                or not isinstance(part_type, str)
                or (part_type not in _TEXT_PART_KEYS and part_type != "tool_reference")
            ):
                return True
    return False


def _check_messages(messages: object, what: str = "messages") -> list[Mapping[str, Any]]:
    if not isinstance(messages, list):
        raise PromptError(f"`{what}` must be a list of message objects.")
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise PromptError(f"Each entry of `{what}` must be an object with a string `role`.")
    return messages


def _plan_chat(body: Mapping[str, Any]) -> _Plan:
    messages = _check_messages(body.get("messages"))
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final_message = _flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise PromptError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    raw_tools = body.get("tools")
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise PromptError("`tools` must be a list.")
    tools = None if raw_tools is None else [_chat_tool(t) for t in raw_tools]
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
    upstream_only = None
    if chat_template is not None or template_kwargs.get("chat_template") is not None:
        upstream_only = "a request-supplied chat template"
    elif _has_non_text_content(messages):
        upstream_only = "non-text content"
    return _ChatPlan(
        messages=messages,
        tools=tools,
        template_kwargs=template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=_flag(body, "add_special_tokens", False),
        truncation=_truncation(body, max_output or 0),
        chars=_chars(messages) + _chars(tools) + _chars(documents),
        upstream_only=upstream_only,
        chat_template=chat_template,
        reused_ids=_reused_ids(body, messages),
    )


class _UnsupportedItem(Exception):
    """A Responses input item this module does not translate (internal)."""


def _response_tools(tools: object) -> list[dict[str, Any]] | None:
    """Responses tools as vLLM shows them to the template (``construct_tool_dicts``)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PromptError("`tools` must be a list.")
    functions: list[Mapping[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise PromptError("Each entry of `tools` must be an object.")
        kind = tool.get("type")
        if kind == "function":
            functions.append(tool)
        elif kind == "namespace":
            for sub in tool.get("tools") or []:
                if isinstance(sub, Mapping) and sub.get("type") == "function":
                    flat = f"{tool.get('name')}{_NAMESPACE_SEPARATOR}{sub.get('name')}"
                    functions.append({**sub, "name": flat})
        elif kind == "custom":
            functions.append(
                {
                    "type": "function",
                    "name": tool.get("name"),
                    "description": tool.get("description"),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            _CUSTOM_TOOL_INPUT_KEY: {
                                "type": "string",
                                "description": "The freeform text payload for this tool.",
                            }
                        },
                        "required": [_CUSTOM_TOOL_INPUT_KEY],
                        "additionalProperties": False,
                    },
                }
            )
        # Built-in tools (web search, MCP, ...) are never rendered for the model.
    if not functions:
        return None
    return [{"type": "function", "function": _function_definition(f)} for f in functions]


def _response_messages(instructions: object, items: object) -> list[dict[str, Any]]:
    """vLLM's ``construct_input_messages`` for a request without stored history."""
    messages: list[dict[str, Any]] = []
    if instructions:
        if not isinstance(instructions, str):
            raise PromptError("`instructions` must be a string.")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list):
        raise PromptError("`input` must be a string or a list of input items.")
    for item in items:
        if not isinstance(item, Mapping):
            raise PromptError("Each entry of `input` must be an object.")
        message = _response_item_message(item, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    return messages


def _response_item_message(
    item: Mapping[str, Any], prev: dict[str, Any] | None
) -> dict[str, Any] | None:
    """One input item as a chat message, or None when it merged into ``prev``."""
    prev_assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        name = item.get("name")
        if kind == "function_call":
            arguments = item.get("arguments")
            if item.get("namespace"):
                name = f"{item['namespace']}{_NAMESPACE_SEPARATOR}{name}"
        else:
            arguments = json.dumps(
                {_CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False
            )
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise _UnsupportedItem(kind)
        call = {
            "id": item.get("call_id"),
            "function": {"name": name, "arguments": arguments},
            "type": "function",
        }
        if prev_assistant is not None:
            calls = prev_assistant.get("tool_calls")
            if calls is None:
                prev_assistant["tool_calls"] = [call]
                return None
            if isinstance(calls, list):
                calls.append(call)
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise PromptError("Encrypted content is not supported.")
        reasoning = ""
        content, summary = item.get("content"), item.get("summary")
        if isinstance(content, list) and content:
            reasoning = _part_text(content[0])
        elif isinstance(summary, list) and summary:
            reasoning = _part_text(summary[0])
        if prev_assistant is not None and prev_assistant.get("reasoning") is None:
            prev_assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if kind not in (None, "message") or not isinstance(role, str):
        raise _UnsupportedItem(str(kind))
    if role == "assistant":
        # vLLM keeps the first part's text only, and fills an assistant turn opened by a tool
        # call or reasoning item.
        content = item.get("content")
        text: str | None = None
        if isinstance(content, str):
            text = content
        elif isinstance(content, list) and content:
            first = content[0]
            text = first.get("text") if isinstance(first, Mapping) else None
            if not isinstance(text, str):
                raise _UnsupportedItem("assistant message without text")
        if text is not None:
            if prev_assistant is not None and prev_assistant.get("content") is None:
                prev_assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    return dict(item)


def _part_text(part: object) -> str:
    text = part.get("text") if isinstance(part, Mapping) else None
    if not isinstance(text, str):
        raise _UnsupportedItem("reasoning item without text")
    return text


def _plan_responses(body: Mapping[str, Any]) -> _Plan:
    items = body.get("input")
    if body.get("previous_response_id") is not None:
        # The history lives in vLLM's response store; only vLLM knows how long it is.
        return _EstimatePlan("previous_response_id", (_estimate_anything(body),))
    try:
        messages = _response_messages(body.get("instructions"), items)
    except _UnsupportedItem as exc:
        return _EstimatePlan(f"Responses input items of type {exc}", (_estimate_anything(body),))
    last = items[-1] if isinstance(items, list) and items else None
    continue_final = (
        isinstance(last, Mapping)
        and last.get("type", "message") in ("message", "reasoning")
        and last.get("status") in ("in_progress", "incomplete")
    )
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    tools = _response_tools(body.get("tools"))
    max_output = _optional_int(body, "max_output_tokens") or 0
    truncate = -1 if body.get("truncation", "disabled") not in (None, "disabled") else None
    return _ChatPlan(
        messages=messages,
        tools=tools,
        template_kwargs=_template_kwargs(body, {"reasoning_effort": effort}),
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        # The Responses endpoint tokenizes the rendered chat with vLLM's default, true.
        add_special_tokens=True,
        truncation=_Truncation(truncate, max_output),
        chars=_chars(messages) + _chars(tools),
        upstream_only="non-text content" if _has_non_text_content(messages) else None,
        reused_ids=_reused_ids(body, messages),
        upstream_messages=[_as_chat_message(m) for m in messages],
    )


#: The message keys vLLM's chat rendering reads; /tokenize gets only these.
_CHAT_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning")


def _as_chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message built from Responses items, in the shape the chat endpoints validate.

    vLLM renders Responses parts (``input_text``, ``input_image``) directly, but /tokenize
    validates chat parts; the chat equivalents render the same.
    """
    out = {k: message[k] for k in _CHAT_MESSAGE_KEYS if k in message}
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [_as_chat_part(part) for part in content]
    return out


def _as_chat_part(part: object) -> object:
    if not isinstance(part, Mapping):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {**part, "type": "text"}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    return part


def _plan(endpoint: str, body: Mapping[str, Any]) -> _Plan:
    if not isinstance(body, Mapping):
        raise PromptError("The request body must be a JSON object.")
    if endpoint == "completions":
        return _plan_completions(body)
    if endpoint == "chat":
        return _plan_chat(body)
    if endpoint == "responses":
        return _plan_responses(body)
    raise PromptError(f"Token counting is not supported for endpoint {endpoint!r}.")


def _chars(value: object) -> int:
    """Characters of every string in a JSON-like value: the size that predicts tokenizing time."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_chars(v) for v in value)
    return 0


# --------------------------------------------------------------------------------------------
# Chat messages as vLLM hands them to the template (parse_chat_messages, text-only)
# --------------------------------------------------------------------------------------------


def _text_part(part: object, wrap: bool) -> Any:
    """One content part: a text dict (``openai`` format), a string, or None to skip it."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, Mapping):
        raise PromptError("Each content part must be an object or a string.")
    part_type = part.get("type")
    if part_type is None or part.get("uuid") is not None:
        if "tool_reference" in part:
            part_type = "tool_reference"
        elif any(key in part for key in _MEDIA_PART_KEYS):
            raise _NeedsUpstream("non-text content")
        else:
            raise PromptError("Missing 'type' field in multimodal part.")
    if part_type == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if wrap else name
    if part_type in _TEXT_PART_KEYS:
        text = part.get(_TEXT_PART_KEYS[part_type])
        if text is None and part_type in _SKIP_NONE_PART_TYPES:
            return None
        if not isinstance(text, str):
            raise PromptError(f"Content part of type {part_type!r} must carry a string.")
        if not wrap:
            return text
        out: dict[str, Any] = {"type": "text", "text": text}
        out.update((k, v) for k, v in part.items() if k not in _KNOWN_PART_FIELDS)
        return out
    if isinstance(part_type, str) and part_type in _MEDIA_PART_KEYS:
        raise _NeedsUpstream("non-text content")
    raise PromptError(f"Unsupported chat content part type: {part_type!r}.")


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    # vLLM drops Claude Code's per-request attribution line from system text.
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: object = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Assistant tool calls as vLLM passes them: validated order, arguments parsed to a dict."""
    out: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, Mapping):
            raise PromptError("assistant tool_calls entries must be objects.")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise PromptError(
                "chat completions only support assistant tool_calls of type 'function'."
            )
        arguments = function.get("arguments")
        parsed: object = {}
        if arguments:
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    # vLLM coerces bad JSON to {} so that the conversation stays usable.
                    parsed = {}
            else:
                parsed = arguments
            if not isinstance(parsed, dict):
                parsed = {}
        new_function = _reordered(function, ("arguments", "name"))
        new_function["arguments"] = parsed
        new_call = _reordered(call, ("id", "function", "type"))
        new_call["function"] = new_function
        out.append(new_call)
    return out


def _conversation(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat
) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` + ``_postprocess_messages`` for text-only content."""
    wrap = content_format == "openai"
    conversation: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        content = message.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = list(content)
        else:
            raise PromptError("Message `content` must be a string, a list of parts or null.")
        if role == "system":
            parts = _strip_billing_header(parts)
        parsed = [p for p in (_text_part(part, wrap) for part in parts) if p is not None]
        result: dict[str, Any] = {"role": role, "content": parsed if wrap else "\n".join(parsed)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise PromptError("assistant `tool_calls` must be a list.")
                if calls:
                    result["tool_calls"] = _tool_calls(calls)
            reasoning = message.get("reasoning")
            if reasoning is not None:
                result["reasoning"] = reasoning
                result["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                result["tool_call_id"] = message["tool_call_id"]
            flat = result["content"]
            if isinstance(flat, list) and all(
                isinstance(p, Mapping) and p.get("type") == "text" for p in flat
            ):
                result["content"] = "\n".join(p.get("text", "") for p in flat)
        if isinstance(message.get("name"), str):
            result["name"] = message["name"]
        if isinstance(message.get("task"), str):
            result["task"] = message["task"]
        if role == "developer":
            result["tools"] = _developer_tools(message.get("tools"))
        conversation.append(result)
    return conversation


def _developer_tools(tools: object) -> object:
    """A developer message's tools in the field order vLLM's validation leaves them."""
    if not isinstance(tools, list):
        return tools
    out: list[object] = []
    for tool in tools:
        if isinstance(tool, Mapping):
            tool = _reordered(tool, ("function", "type"))
            if isinstance(tool.get("function"), Mapping):
                tool["function"] = _reordered(
                    tool["function"], ("name", "description", "parameters", "strict")
                )
        out.append(tool)
    return out


def _fold_developer(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's developer-to-system conversion and system consolidation, for templates that lack
    the developer role."""
    converted: list[dict[str, Any]] = []
    for message in conversation:
        if message["role"] == "developer":
            message = {**message, "role": "system"}
            message.pop("tools", None)
        converted.append(message)
    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    consolidate = False
    for index, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        if index > 0 or system_texts:
            consolidate = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, Mapping) else p
                for p in content
                if (isinstance(p, Mapping) and "text" in p) or isinstance(p, str)
            )
        if content:
            system_texts.append(content)
    if not consolidate:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


# --------------------------------------------------------------------------------------------
# Content-format detection: vLLM's AST walk over the chat template (renderers/hf.py)
# --------------------------------------------------------------------------------------------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (or its elements), transitively."""
    found = [name]
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                if not isinstance(assign.target, jinja2.nodes.Name):
                    raise ValueError("unsupported assignment target")
                target = assign.target.name
                if target not in found:
                    found.append(target)
                    pending.append(target)
    return found


def _message_loop_vars(root: jinja2.nodes.Template) -> list[str]:
    names = _aliases(root, "messages")
    out: list[str] = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, name) for name in names):
            if not isinstance(loop.target, jinja2.nodes.Name):
                raise ValueError("unsupported loop target")
            out.append(loop.target.name)
    return out


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """Whether some loop iterates over a message's content (vLLM's "openai" format)."""
    message_vars = _message_loop_vars(root)
    macro_params: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        arg_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(
                    _is_var_or_elems(arg, v, "content") for v in message_vars
                ):
                    content_params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if kwarg.key in arg_names and any(
                    _is_var_or_elems(kwarg.value, v, "content") for v in message_vars
                ):
                    content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_params[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, v, "content") for v in message_vars):
            return True
        params = macro_params.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name):
            if params is not None and loop.iter.name in params:
                return True
            if id(loop) not in loops_in_macros and loop.iter.name == "content":
                return True
    return False


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}`` blocks so that templates using them parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


_PARSE_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[_GenerationTag, jinja2.ext.loopcontrols],
)


@lru_cache(maxsize=32)
def detect_content_format(chat_template: str) -> ContentFormat:
    """How vLLM passes message content to this template: ``"openai"`` (a list of parts) when the
    template loops over a message's content, else ``"string"`` (text parts joined by newlines).
    A template that cannot be parsed is ``"string"``, as in vLLM."""
    try:
        root = _PARSE_ENV.parse(chat_template)
        return "openai" if _loops_over_content(root) else "string"
    except Exception:
        return "string"


def _supports_developer_role(chat_template: str) -> bool:
    return '"developer"' in chat_template or "'developer'" in chat_template


# --------------------------------------------------------------------------------------------
# The model's own tokenizer (transformers, untyped behind this wrapper)
# --------------------------------------------------------------------------------------------


class ModelTokenizer:
    """The model's fast tokenizer and chat template, safe to use from several threads.

    Fast tokenizers are not safe to share between threads, so, like vLLM, each call borrows
    its own copy from a small pool.

    >>> tok = ModelTokenizer.load("/models/tiny")
    >>> tok.count_text("hello world", add_special_tokens=True)
    3
    """

    def __init__(self, hf_tokenizer: Any, *, path: Path, harmony: bool = False) -> None:
        self.path = path
        #: the model renders chat with Harmony, not its HF chat template (gpt-oss)
        self.harmony = harmony
        self._pristine = copy.deepcopy(hf_tokenizer)
        self._pool: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pool.put(hf_tokenizer)
        for _ in range(_OFFLOAD_WORKERS):
            self._pool.put(copy.deepcopy(hf_tokenizer))
        self._lock = threading.Lock()
        self._templates = {tools: _chat_template(hf_tokenizer, tools) for tools in (False, True)}

    @classmethod
    def load(cls, path: str | Path) -> ModelTokenizer:
        """Load the tokenizer in ``path`` (a model or tokenizer directory). Slow: seconds."""
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory} is not a directory")
        if _is_mistral_repo(directory):
            # vLLM uses mistral-common for these, not the HF tokenizer.
            raise ValueError(f"{directory} is a Mistral-format repository")
        from transformers import AutoTokenizer

        # Local files only: the sidecar never reaches out to a model hub.
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{directory} has no fast tokenizer")
        # Counting a prompt longer than the context is expected here (the caller refuses it);
        # without this, transformers logs a warning about it.
        hf.model_max_length = _NO_LENGTH_LIMIT
        return cls(hf, path=directory, harmony=_model_type(directory) in _HARMONY_MODEL_TYPES)

    @contextmanager
    def _borrow(self) -> Iterator[Any]:
        try:
            tok = self._pool.get_nowait()
        except queue.Empty:
            with self._lock:
                tok = copy.deepcopy(self._pristine)
        try:
            yield tok
        finally:
            self._pool.put(tok)

    def count_text(self, text: str, *, add_special_tokens: bool) -> int:
        with self._borrow() as tok:
            # the Rust tokenizer itself: what transformers' __call__ runs for a fast tokenizer,
            # without its per-call Python (measured at ~40% of a short prompt's count)
            encoding = tok.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return len(encoding.ids)

    def chat_template(self, *, with_tools: bool) -> str | None:
        """The template vLLM picks (a ``tool_use`` variant when tools are given), or None."""
        return self._templates[with_tools]

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]
    ) -> str | list[int]:
        """The chat prompt vLLM renders: text, or token ids when the kwargs ask it to tokenize.

        Raises :class:`_NeedsUpstream` for content it cannot expand, anything else on a
        template error.
        """
        call_kwargs = dict(kwargs)
        tools = call_kwargs.pop("tools", None)
        tokenize = bool(call_kwargs.pop("tokenize", False))
        call_kwargs.pop("return_dict", None)
        template = self.chat_template(with_tools=tools is not None)
        if template is None:
            raise _NeedsUpstream("no chat template in the tokenizer")
        conversation = _conversation(messages, detect_content_format(template))
        if any(m["role"] == "developer" for m in conversation) and not _supports_developer_role(
            template
        ):
            conversation = _fold_developer(conversation)
        with self._borrow() as tok:
            rendered = tok.apply_chat_template(
                conversation,
                tools=tools,
                chat_template=template,
                tokenize=tokenize,
                return_dict=False,
                **call_kwargs,
            )
        if tokenize:
            return [int(t) for t in rendered]
        return str(rendered)


def _chat_template(hf_tokenizer: Any, with_tools: bool) -> str | None:
    try:
        template = hf_tokenizer.get_chat_template(None, tools=[] if with_tools else None)
    except Exception:  # no template at all
        return None
    return template if isinstance(template, str) else None


def _is_mistral_repo(directory: Path) -> bool:
    if not directory.is_dir() or not any(directory.glob("consolidated*.safetensors")):
        return False
    return (directory / "tekken.json").exists() or any(directory.glob("tokenizer.model.v*"))


def _model_type(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("model_type") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------------------------
# The estimator
# --------------------------------------------------------------------------------------------


def _estimate_text(text: str) -> int:
    # One token per UTF-8 byte bounds every byte-level BPE and byte-fallback tokenizer.
    return len(text.encode("utf-8", errors="replace"))


def _estimate_completion_prompt(prompt: str | list[int]) -> int:
    if isinstance(prompt, list):
        return len(prompt)
    return _estimate_text(prompt) + _EST_PER_PROMPT


def _estimate_anything(value: object) -> int:
    """Every string leaf, every non-text part, some markup per object."""
    if isinstance(value, str):
        return _estimate_text(value)
    if isinstance(value, Mapping):
        media = _EST_PER_NON_TEXT_PART if any(k in value for k in _MEDIA_PART_KEYS) else 0
        return media + _EST_PER_MESSAGE + sum(_estimate_anything(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_estimate_anything(v) for v in value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return len(str(value))
    return 0


def _estimate_chat(plan: _ChatPlan) -> int:
    total = _EST_PER_CHAT
    for message in plan.messages:
        total += _estimate_anything(message)
    for tool in plan.tools or []:
        total += _EST_PER_TOOL + _estimate_text(json.dumps(tool, ensure_ascii=False))
    if plan.template_kwargs:
        # Documents, tools given as kwargs, anything else the template may print.
        total += _estimate_text(json.dumps(plan.template_kwargs, ensure_ascii=False, default=str))
    return total


def _estimate_plan(plan: _Plan) -> tuple[int, ...]:
    if isinstance(plan, _EstimatePlan):
        return plan.prompts
    if isinstance(plan, _CompletionPlan):
        return tuple(_estimate_completion_prompt(p) for p in plan.prompts)
    if plan.reused_ids is not None:
        return (plan.reused_ids,)
    return (_estimate_chat(plan),)


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


# --------------------------------------------------------------------------------------------
# The counter
# --------------------------------------------------------------------------------------------


class PromptCounter:
    """Counts the prompt tokens of generation request bodies, as vLLM will.

    ``tokenizer_path`` is loaded in the background (it takes seconds); until it is ready, and
    when it fails to load, counts go to vLLM's ``/tokenize``. Pass ``tokenizer=`` to share one
    already loaded. ``max_model_len`` resolves ``truncate_prompt_tokens: -1``; it is also learnt
    from ``/tokenize`` answers.

    >>> counter = PromptCounter(client=client, upstream="http://127.0.0.1:8000",
    ...                         served_model="tiny", tokenizer_path="/models/tiny")
    >>> count = await counter.count("completions", {"prompt": ["a b", "c"]})
    >>> count.prompts, count.method
    ((2, 1), <CountMethod.LOCAL: 'exact_local'>)
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
    ) -> None:
        self._client = client
        self._tokenize_url = None if upstream is None else str(upstream).rstrip("/") + "/tokenize"
        self.served_model = served_model
        self.offload_threshold_chars = offload_threshold_chars
        self.max_model_len = max_model_len
        self._timeout = httpx.Timeout(upstream_timeout_s)
        self._executor: ThreadPoolExecutor | None = None
        self._local: ModelTokenizer | None = tokenizer
        self._loading: Future[ModelTokenizer | None] | None = None
        self._warnings = _RateLimitedWarning()
        self._upstream_retry_at = 0.0
        self._upstream_failure = ""
        # Self-check: the first local count of each endpoint is compared with /tokenize in the
        # background; a mismatch (a server-side --chat-template, another content format,
        # default template kwargs, a different transformers) moves that endpoint upstream.
        self._verified: set[str] = set()
        self._mismatched: set[str] = set()
        self._verifying: set[str] = set()
        self._checks: set[asyncio.Task[None]] = set()
        if tokenizer is None and tokenizer_path is not None:
            self._loading = self._pool().submit(self.load_tokenizer, Path(tokenizer_path))

    @classmethod
    def load_tokenizer(cls, path: str | Path) -> ModelTokenizer | None:
        """Load the model's tokenizer; None (and a warning) when it cannot be used locally."""
        try:
            tokenizer = ModelTokenizer.load(path)
        except Exception as exc:
            logger.warning(
                "cannot load the tokenizer in %s (%s: %s); prompts will be counted by vLLM's "
                "/tokenize",
                path,
                type(exc).__name__,
                exc,
            )
            return None
        logger.info("loaded the tokenizer in %s for exact local prompt counts", path)
        return tokenizer

    @property
    def local_available(self) -> bool:
        return self._tokenizer() is not None

    @property
    def tokenizer(self) -> ModelTokenizer | None:
        return self._tokenizer()

    async def wait_ready(self) -> bool:
        """Wait for a background tokenizer load; return whether local counting is available."""
        loading = self._loading
        if loading is not None and not loading.cancelled():
            # asyncio.wait, unlike awaiting the future, cannot raise into the caller.
            await asyncio.wait([asyncio.wrap_future(loading)])
        return self.local_available

    @property
    def verified_endpoints(self) -> frozenset[str]:
        """Endpoints whose local counts were checked against vLLM's /tokenize and agreed."""
        return frozenset(self._verified - self._mismatched)

    @property
    def mismatched_endpoints(self) -> frozenset[str]:
        """Endpoints counted upstream because a local count disagreed with /tokenize."""
        return frozenset(self._mismatched)

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

    async def count(self, endpoint: Endpoint, body: Mapping[str, Any]) -> TokenCount:
        """Count the prompt tokens of ``body`` sent to ``endpoint``.

        Raises :class:`PromptError` for a prompt vLLM would refuse to interpret; never anything
        else but cancellation.
        """
        started = time.perf_counter()
        plan: _Plan | None = None
        try:
            plan = _plan(endpoint, body)
            prompts, method = await self._count(endpoint, plan)
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
            prompts = _estimate_plan(plan) if plan is not None else (_estimate_anything(body),)
            method = CountMethod.ESTIMATE
        return TokenCount(tuple(prompts), method, time.perf_counter() - started)

    # -- the three ways ----------------------------------------------------------------------

    async def _count(self, endpoint: str, plan: _Plan) -> tuple[tuple[int, ...], CountMethod]:
        if isinstance(plan, _EstimatePlan):
            self._warnings.warn(
                f"unsupported:{plan.reason}",
                "cannot count %s exactly; using an upper-bound estimate",
                plan.reason,
            )
            return plan.prompts, CountMethod.ESTIMATE
        if isinstance(plan, _ChatPlan) and plan.reused_ids is not None:
            return (plan.truncation.apply(plan.reused_ids, self.max_model_len),), CountMethod.LOCAL
        if isinstance(plan, _CompletionPlan) and all(isinstance(p, list) for p in plan.prompts):
            # Token ids need no tokenizer.
            return self._truncate(plan, [len(p) for p in plan.prompts]), CountMethod.LOCAL
        local = self._tokenizer()
        usable = not (isinstance(plan, _ChatPlan) and plan.upstream_only)
        if local is not None and usable and endpoint not in self._mismatched:
            try:
                counts = await self._run(plan.chars, _count_locally, local, plan)
            except _NeedsUpstream as exc:
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
                if local.harmony and isinstance(plan, _ChatPlan):
                    # vLLM renders gpt-oss chats with Harmony, not with this template.
                    self._warnings.warn(
                        "harmony",
                        "%s renders chats with Harmony; its chat template only approximates "
                        "vLLM's count",
                        local.path,
                    )
                    return self._truncate(plan, counts), CountMethod.ESTIMATE
                self._self_check(endpoint, plan, counts)
                return self._truncate(plan, counts), CountMethod.LOCAL
        try:
            counts = await self._count_upstream(plan)
            return self._truncate(plan, counts), CountMethod.UPSTREAM
        except _UpstreamUnavailable as exc:
            self._warnings.warn(
                "upstream",
                "vLLM's /tokenize is unavailable (%s); prompt counts are upper-bound estimates",
                exc,
            )
        return _estimate_plan(plan), CountMethod.ESTIMATE

    def _self_check(
        self, endpoint: str, plan: _CompletionPlan | _ChatPlan, counts: Sequence[int]
    ) -> None:
        if endpoint in self._verified or endpoint in self._verifying:
            return
        if self._client is None or self._tokenize_url is None:
            return
        self._verifying.add(endpoint)
        task = asyncio.get_running_loop().create_task(self._check(endpoint, plan, list(counts)))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check(
        self, endpoint: str, plan: _CompletionPlan | _ChatPlan, local_counts: list[int]
    ) -> None:
        try:
            upstream_counts = await self._count_upstream(plan)
        except Exception as exc:
            # Not verifiable now (vLLM down, or it refuses the prompt): try on a later request.
            logger.debug("self-check of %s counts postponed: %s", endpoint, exc)
            return
        finally:
            self._verifying.discard(endpoint)
        self._verified.add(endpoint)
        if upstream_counts == local_counts:
            logger.info("local %s prompt counts agree with vLLM's /tokenize", endpoint)
            return
        self._mismatched.add(endpoint)
        logger.error(
            "local %s prompt count %s differs from vLLM's /tokenize %s; counting %s prompts "
            "with /tokenize from now on (is vLLM started with its own --chat-template, "
            "--chat-template-content-format or --default-chat-template-kwargs, or another "
            "tokenizer?)",
            endpoint,
            local_counts,
            upstream_counts,
            endpoint,
        )

    def _truncate(
        self, plan: _CompletionPlan | _ChatPlan, counts: Sequence[int]
    ) -> tuple[int, ...]:
        return tuple(plan.truncation.apply(n, self.max_model_len) for n in counts)

    async def _run(self, chars: int, fn: Callable[..., _T], *args: Any) -> _T:
        if chars <= self.offload_threshold_chars:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool(), fn, *args)

    async def _count_upstream(self, plan: _CompletionPlan | _ChatPlan) -> list[int]:
        if self._client is None or self._tokenize_url is None:
            raise _UpstreamUnavailable("no upstream configured")
        if time.monotonic() < self._upstream_retry_at:
            # Recently failed: estimate now rather than make every request wait for a timeout.
            raise _UpstreamUnavailable(self._upstream_failure)
        if isinstance(plan, _ChatPlan):
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
        if self.served_model is not None:
            payload = {"model": self.served_model, **payload}
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
                max_workers=_OFFLOAD_WORKERS, thread_name_prefix="kv-sidecar-tokens"
            )
        return self._executor


def _count_locally(tokenizer: ModelTokenizer, plan: _CompletionPlan | _ChatPlan) -> list[int]:
    """The exact local count (blocking; may run on a worker thread)."""
    if isinstance(plan, _CompletionPlan):
        return [
            len(p)
            if isinstance(p, list)
            else tokenizer.count_text(p, add_special_tokens=plan.add_special_tokens)
            for p in plan.prompts
        ]
    if plan.upstream_only:
        raise _NeedsUpstream(plan.upstream_only)
    kwargs = plan.local_kwargs()
    if kwargs.get("chat_template") is not None:
        raise _NeedsUpstream("a request-supplied chat template")
    rendered = tokenizer.render_chat(plan.messages, kwargs)
    if isinstance(rendered, list):
        return [len(rendered)]
    return [tokenizer.count_text(rendered, add_special_tokens=plan.add_special_tokens)]


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, Mapping) else None
    except (ValueError, AttributeError):
        message = None
    return str(message or f"vLLM refused the prompt (HTTP {response.status_code})")
