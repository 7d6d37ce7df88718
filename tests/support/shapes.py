"""The request shapes whose prompt counts are checked: against the real vLLM
(``tests/test_tokens.py``) and through both counting paths (``tests/test_slim_tokenizer.py``),
and the fixtures captured from vLLM's own normalisation functions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tokens"
CAPTURED = json.loads((FIXTURES / "vllm-0.32.0.json").read_text())

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
#: ~2,400 characters: above the default offload threshold, ~460 tokens (under max_model_len).
LONG_TEXT = "the cache block " * 150
#: ~1,200 tokens: more than max_model_len (1024), for truncation to the context.
OVERLONG_TEXT = "the cache block " * 400

SHAPES: list[tuple[str, str, dict[str, Any]]] = [
    ("cmpl-string", "completions", {"prompt": "hello world"}),
    ("cmpl-list-of-strings", "completions", {"prompt": ["hello world", "the cache block"]}),
    ("cmpl-token-ids", "completions", {"prompt": [5, 6, 7, 8]}),
    ("cmpl-list-of-id-lists", "completions", {"prompt": [[5, 6, 7], [8, 9]]}),
    ("cmpl-unicode-emoji", "completions", {"prompt": "Ünïcödé 🚀🔥 日本語テキスト"}),
    ("cmpl-single-space", "completions", {"prompt": " "}),
    ("cmpl-no-special-tokens", "completions", {"prompt": "hello", "add_special_tokens": False}),
    ("cmpl-truncated", "completions", {"prompt": LONG_TEXT, "truncate_prompt_tokens": 10}),
    ("cmpl-long", "completions", {"prompt": LONG_TEXT}),
    (
        "cmpl-truncated-to-context",
        "completions",
        {"prompt": OVERLONG_TEXT, "truncate_prompt_tokens": -1},
    ),
    ("chat-user", "chat", {"messages": [{"role": "user", "content": "hello"}]}),
    (
        "chat-system-user",
        "chat",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello"},
            ]
        },
    ),
    (
        "chat-multi-turn",
        "chat",
        {
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "two"},
                {"role": "user", "content": "three"},
            ]
        },
    ),
    (
        "chat-text-part",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "only part"}]}]},
    ),
    (
        "chat-several-text-parts",
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first"},
                        {"type": "text", "text": "second"},
                    ],
                }
            ]
        },
    ),
    (
        "chat-tools",
        "chat",
        {"messages": TOOL_TURNS[:1], "tools": [WEATHER_TOOL], "tool_choice": "none"},
    ),
    ("chat-tool-calls-and-result", "chat", {"messages": TOOL_TURNS}),
    (
        "chat-tools-and-tool-calls",
        "chat",
        {"messages": TOOL_TURNS, "tools": [WEATHER_TOOL], "tool_choice": "none"},
    ),
    (
        "chat-no-generation-prompt",
        "chat",
        {"messages": [{"role": "user", "content": "hello"}], "add_generation_prompt": False},
    ),
    (
        "chat-continue-final-message",
        "chat",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "The answer is "},
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
    (
        "chat-developer-and-system",
        "chat",
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "developer", "content": "d"},
                {"role": "user", "content": "u"},
            ]
        },
    ),
    (
        "chat-tool-result-parts",
        "chat",
        {
            "messages": [
                {
                    "role": "tool",
                    "tool_call_id": "c",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        },
    ),
    (
        "chat-template-kwargs-tools",
        "chat",
        {
            "messages": [{"role": "user", "content": "hello"}],
            "chat_template_kwargs": {"tools": [WEATHER_TOOL]},
        },
    ),
    (
        "chat-bad-tool-arguments",
        "chat",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": "x",
                    "tool_calls": [
                        {
                            "id": "1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "not json"},
                        }
                    ],
                }
            ]
        },
    ),
    (
        "chat-truncated",
        "chat",
        {"messages": [{"role": "user", "content": "hi there"}], "truncate_prompt_tokens": 4},
    ),
    ("chat-long", "chat", {"messages": [{"role": "user", "content": LONG_TEXT}]}),
    ("resp-string", "responses", {"input": "hello", "instructions": "be brief"}),
    (
        "resp-items",
        "responses",
        {
            "input": [
                {"type": "message", "role": "user", "content": "hello"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "hi!"}],
                },
                {"role": "user", "content": [{"type": "input_text", "text": "bye"}]},
            ]
        },
    ),
    (
        "resp-function-call",
        "responses",
        {
            "input": [
                {"role": "user", "content": "weather?"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city":"Paris"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "get_weather",
                    "description": "d",
                    "parameters": {"type": "object", "properties": {}},
                }
            ],
        },
    ),
    ("resp-truncation-auto", "responses", {"input": OVERLONG_TEXT, "truncation": "auto"}),
    (
        "resp-partial-assistant",
        "responses",
        {
            "input": [
                {"role": "user", "content": "hello"},
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "incomplete",
                    "content": [{"type": "output_text", "text": "The answer"}],
                },
            ]
        },
    ),
]
