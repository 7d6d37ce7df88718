"""Generation requests: which paths generate, and parsing and validating their JSON bodies.

The proxy forwards the client's original bytes; this module only reads them to learn what the
request will cost (prompt, ``max_tokens``, ``n``) and to refuse, with an OpenAI-shaped 4xx, a
body vLLM would refuse anyway or that the sidecar cannot account for. Unknown fields are ignored
here and pass through untouched.

``max_tokens`` is kept as the client sent it; :attr:`GenerationRequest.requested_max_tokens` is
what vLLM's request object holds once validated. For ``/v1/completions`` an absent or null
``max_tokens`` is 16 (vLLM 0.32: ``CompletionRequest.max_tokens: int | None = 16`` and its
``normalize_null_max_tokens`` validator, which turns an explicit null into the same 16); for
chat, responses and messages it stays None, and the server's generation config decides
(``sidecar.kv.projection.project_counts``).

>>> r = parse_generation("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}],'
...                      b' "max_tokens": 8, "stream": true}')
>>> (r.endpoint, r.max_tokens, r.stream, r.n)
('chat', 8, True, 1)
>>> r = parse_generation("completions", b'{"prompt": "hi"}')
>>> (r.max_tokens, r.requested_max_tokens)
(None, 16)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sidecar.errors import BadRequest

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "GENERATION_PATHS",
    "CountedEndpoint",
    "Endpoint",
    "GenerationRequest",
    "check_messages",
    "counting_view",
    "parse_generation",
]

Endpoint = Literal["completions", "chat", "responses", "messages"]
#: The endpoints whose prompts are counted: ``messages`` is counted as the chat vLLM makes of it.
CountedEndpoint = Literal["completions", "chat", "responses"]

#: Paths of vLLM's OpenAI-compatible server that generate, and how their bodies read.
GENERATION_PATHS: dict[str, Endpoint] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",  # vLLM's Anthropic-compatible endpoint
}

MAX_JSON_DEPTH = 64
MAX_PROMPTS = 1024
MAX_N = 128
#: vLLM 0.32's ``CompletionRequest.max_tokens`` default (entrypoints/openai/completion/protocol.py),
#: also what its ``normalize_null_max_tokens`` validator makes of an explicit ``null``.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What the sidecar needs to know about one generation request."""

    endpoint: Endpoint
    body: dict[str, Any]
    stream: bool
    max_tokens: int | None  # as the client sent it (None: absent or null)
    max_tokens_param: str
    n: int
    #: ``ignore_eos: true`` (vLLM's extra sampling parameter, as benchmark clients send it):
    #: the answer runs to its max_tokens
    ignore_eos: bool = False
    #: ``min_tokens`` (vLLM's extra sampling parameter): the answer is at least this long
    min_tokens: int = 0

    @property
    def requested_max_tokens(self) -> int | None:
        """The ``max_tokens`` vLLM's request object holds once validated; None: none, and the
        server's generation config default (else the rest of the context) applies.

        ``/v1/completions``: absent or null is 16; ``echo`` with ``max_tokens: 0`` generates one
        token (vLLM's ``echo_without_generation`` runs with ``max_tokens=1``).
        """
        if self.endpoint == "completions":
            if self.max_tokens is None:
                return COMPLETIONS_DEFAULT_MAX_TOKENS
            if self.max_tokens == 0:
                return 1  # only parsed with echo: true
        return self.max_tokens


_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})


def _lax_bool(value: Any) -> bool:
    """Whether ``value`` is true as vLLM's request models read a boolean field (pydantic's lax
    mode: ``true``, ``1``, and strings such as ``"true"`` or ``"yes"``); anything else is false
    here, and vLLM answers a value it cannot read as a boolean itself.

    >>> [_lax_bool(v) for v in (True, 1, "Yes", "on", False, 0, "no", None, 2, [])]
    [True, True, True, True, False, False, False, False, False, False]
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.lower() in _TRUE_STRINGS


def _min_tokens(value: Any) -> int:
    """``min_tokens`` as the projection takes it: a non-negative integer, else 0 (vLLM answers a
    value it refuses itself).

    >>> [_min_tokens(v) for v in (50, 0, -3, None, "7", 2.0, True)]
    [50, 0, 0, 0, 0, 0, 0]
    """
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(0, value)


def _depth_ok(value: Any, limit: int) -> bool:
    """Iteratively check nesting depth (recursion could be driven by the client)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


def _int_field(
    body: dict[str, Any], key: str, *, minimum: int, maximum: int | None = None
) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise BadRequest(f"'{key}' must be an integer, got {json.dumps(value)[:40]}", param=key)
    if value < minimum:
        raise BadRequest(f"'{key}' must be at least {minimum}, got {value}", param=key)
    if maximum is not None and value > maximum:
        raise BadRequest(f"'{key}' must be at most {maximum}, got {value}", param=key)
    return value


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest(
            "'prompt' must be a string, a list of strings, or token ids", param="prompt"
        )
    first = prompt[0]
    # A flat list of token ids is one prompt, however long.
    if len(prompt) > MAX_PROMPTS and not (isinstance(first, int) and not isinstance(first, bool)):
        raise BadRequest(f"'prompt' lists more than {MAX_PROMPTS} prompts", param="prompt")
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise BadRequest("'prompt' mixes strings and other values", param="prompt")
    elif isinstance(first, int) and not isinstance(first, bool):
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise BadRequest("'prompt' token ids must be non-negative integers", param="prompt")
    elif isinstance(first, list):
        for ids in prompt:
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise BadRequest(
                    "'prompt' token id lists must be non-empty lists of non-negative integers",
                    param="prompt",
                )
    else:
        raise BadRequest(
            "'prompt' must be a string, a list of strings, or token ids", param="prompt"
        )


def check_messages(messages: object) -> list[Mapping[str, Any]]:
    """``messages`` as a list of message objects, or :class:`BadRequest` saying what is wrong.

    The one check of a chat body's messages: :func:`parse_generation` runs it on every chat and
    messages body, and the prompt counter on every body it is asked to count.

    >>> check_messages([{"role": "user", "content": "hi"}])
    [{'role': 'user', 'content': 'hi'}]
    >>> check_messages([{"content": "hi"}])
    Traceback (most recent call last):
    ...
    sidecar.errors.BadRequest: 'messages[0].role' must be a string
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise BadRequest(f"'messages[{i}]' must be an object", param="messages")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}].role' must be a string", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"'messages[{i}].content' must be a string or a list", param="messages"
            )
    return messages


def parse_generation(endpoint: Endpoint, raw: bytes) -> GenerationRequest:
    """Parse and validate a generation request body, or raise :class:`BadRequest`."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    if not _depth_ok(body, MAX_JSON_DEPTH):
        raise BadRequest(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")

    if endpoint == "completions":
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        _check_prompt(body["prompt"])
    elif endpoint in ("chat", "messages"):
        check_messages(body.get("messages"))
    else:  # responses
        inp = body.get("input")
        if isinstance(inp, list):
            if not inp:
                raise BadRequest("'input' must not be empty", param="input")
        elif not isinstance(inp, str):
            raise BadRequest("'input' must be a string or a list of items", param="input")

    if endpoint == "responses":
        param = "max_output_tokens"
        max_tokens = _int_field(body, param, minimum=1)
    elif endpoint == "chat" and body.get("max_completion_tokens") is not None:
        param = "max_completion_tokens"
        max_tokens = _int_field(body, param, minimum=1)
    else:
        param = "max_tokens"
        # vLLM scores an echoed prompt without generating (max_tokens 0, e.g. lm-eval's
        # loglikelihood requests); elsewhere SamplingParams wants at least 1
        echo_only = endpoint == "completions" and body.get("echo") is True
        max_tokens = _int_field(body, param, minimum=0 if echo_only else 1)
    if endpoint == "messages" and max_tokens is None:
        raise BadRequest("'max_tokens' is required", param="max_tokens")

    n = _int_field(body, "n", minimum=1, maximum=MAX_N) or 1
    if endpoint in ("completions", "chat"):
        # validated here; the prompt counter applies it (vLLM reads it for these two only)
        _int_field(body, "truncate_prompt_tokens", minimum=-1)
    return GenerationRequest(
        endpoint=endpoint,
        body=body,
        stream=stream,
        max_tokens=max_tokens,
        max_tokens_param=param,
        n=n,
        ignore_eos=_lax_bool(body.get("ignore_eos")),
        min_tokens=_min_tokens(body.get("min_tokens")),
    )


def counting_view(request: GenerationRequest) -> tuple[CountedEndpoint, dict[str, Any]]:
    """The endpoint and body to count prompt tokens with.

    vLLM serves ``/v1/messages`` (Anthropic's shape) by converting it to a chat completion: the
    top-level ``system`` becomes the first message and tools take OpenAI's function shape.
    """
    if request.endpoint != "messages":
        return request.endpoint, request.body
    body = request.body
    messages: list[Any] = []
    system = body.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    elif isinstance(system, list):
        messages.append(
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": b.get("text", "")}
                    for b in system
                    if isinstance(b, dict)
                ],
            }
        )
    messages.extend(body.get("messages") or [])
    view: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        view["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                },
            }
            for t in tools
            if isinstance(t, dict)
        ]
    return "chat", view
