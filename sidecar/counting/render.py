"""The mirror of vLLM's rendering rules: a request body as vLLM hands it to the chat template.

Pinned to vLLM 0.32.0; a newer vLLM may render differently, and ``fixtures/tokens/`` (captured
from vLLM by ``tests/fixtures/tokens/capture_vllm.py``) is what tells. It mirrors:

* ``vllm/renderers/chat_utils.py``: ``parse_chat_messages`` and ``_postprocess_messages`` for
  text content (the content parts, tool calls, tool results, the billing-header strip), and
  ``has_non_text_content``;
* ``vllm/renderers/hf.py``: the developer-to-system fold for templates without that role, and
  ``merge_kwargs`` (content-format detection is in :mod:`sidecar.counting.content_format`);
* ``vllm/entrypoints/openai/chat_completion/protocol.py``: how chat tools are dumped
  (``ChatCompletionToolsParam.model_dump()``);
* ``vllm/entrypoints/openai/responses/utils.py``: ``construct_input_messages`` and
  ``construct_tool_dicts``, the Responses input as chat messages.

Pure functions over JSON-like values: no tokenizer, no I/O.

>>> conversation([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "string")
[{'role': 'user', 'content': 'hi'}]
>>> merge_kwargs({"a": 1}, {"a": "auto", "b": 2})
{'a': 1, 'b': 2}
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.counting.content_format import ContentFormat
from sidecar.errors import PromptError, SidecarError


# Both exceptions below are control flow inside ``sidecar.counting``: the counter catches them and
# falls back to a less exact method. They derive from SidecarError so that, should one ever leak,
# it is still one of the sidecar's own errors (never mistaken for a bug in a library).
class NeedsUpstream(SidecarError):
    """The local tokenizer cannot count this request exactly; only vLLM's /tokenize can."""


class UnsupportedItem(SidecarError):
    """A Responses input item this module does not translate: its count is estimated."""


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
MEDIA_PART_KEYS = frozenset(
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


def merge_kwargs(
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
# Tools as vLLM dumps them for the template
# --------------------------------------------------------------------------------------------


def chat_tool(tool: object) -> dict[str, Any]:
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


def has_non_text_content(messages: object) -> bool:
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
                any(key in part for key in MEDIA_PART_KEYS)
                or not isinstance(part_type, str)
                or (part_type not in _TEXT_PART_KEYS and part_type != "tool_reference")
            ):
                return True
    return False


# --------------------------------------------------------------------------------------------
# Responses input as chat messages (vllm/entrypoints/openai/responses/utils.py)
# --------------------------------------------------------------------------------------------


def response_tools(tools: object) -> list[dict[str, Any]] | None:
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


def response_messages(instructions: object, items: object) -> list[dict[str, Any]]:
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
            raise UnsupportedItem(kind)
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
        raise UnsupportedItem(str(kind))
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
                raise UnsupportedItem("assistant message without text")
        if text is not None:
            if prev_assistant is not None and prev_assistant.get("content") is None:
                prev_assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    return dict(item)


def _part_text(part: object) -> str:
    text = part.get("text") if isinstance(part, Mapping) else None
    if not isinstance(text, str):
        raise UnsupportedItem("reasoning item without text")
    return text


#: The message keys vLLM's chat rendering reads; /tokenize gets only these.
_CHAT_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning")


def as_chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
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
        elif any(key in part for key in MEDIA_PART_KEYS):
            raise NeedsUpstream("non-text content")
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
    if isinstance(part_type, str) and part_type in MEDIA_PART_KEYS:
        raise NeedsUpstream("non-text content")
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


def conversation(
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


def fold_developer(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def supports_developer_role(chat_template: str) -> bool:
    return '"developer"' in chat_template or "'developer'" in chat_template
