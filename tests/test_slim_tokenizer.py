"""The slim counting path (``tokenizers`` + jinja2) gives the ids transformers gives.

The reference is transformers itself, as vLLM uses it: ``AutoTokenizer.from_pretrained``, its
``__call__`` for text and ``apply_chat_template(tokenize=False)`` for chats (the preprocessing
before the template, vLLM's, is the sidecar's own mirror and shared by both). Counted through
both: every request shape of ``test_tokens.SHAPES``, every captured conversation of
``fixtures/tokens`` under every fixture template, tokenizer configurations that exercise the
loader (added and special tokens, a missing post-processor, ``split_special_tokens``, named
templates), and a generated held-out-style model with a Qwen2.5-sized vocabulary (151,643 BPE
tokens, ``Qwen2Tokenizer``, a Qwen-style template with tools and reasoning).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from harness.big_vocab import ensure_big_vocab_model, sample
from harness.vllm_cpu import ensure_tokenizer_model
from sidecar.counting import ModelTokenizer
from sidecar.counting.content_format import detect_content_format
from sidecar.counting.plan import ChatPlan, CompletionPlan, PromptTokens, plan_count
from sidecar.counting.render import conversation, fold_developer, supports_developer_role
from sidecar.counting.tokenizer import count_locally
from sidecar.counting.tokenizer_files import MissingTransformers
from tests.support.shapes import CAPTURED, FIXTURES, LONG_TEXT, SHAPES, WEATHER_TOOL

pytestmark = pytest.mark.timeout(600)

FIXTURE_TEMPLATES = sorted(
    p.name for p in (FIXTURES / "templates").glob("*.jinja") if p.name != "broken.jinja"
)
#: Everything the template is handed, dumped: keys, their order, None values, special tokens.
DUMP_TEMPLATE = (
    "{{ messages | tojson }}|{{ tools | tojson }}|{{ documents | tojson }}|"
    "{{ bos_token }}{{ eos_token }}{{ pad_token }}|{{ add_generation_prompt }}|"
    "{{ messages | tojson(indent=2, sort_keys=true) }}"
)
TINY_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")


class TransformersReference:
    """Counting as it was done through transformers: the reference of every comparison."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.hf.model_max_length = 1 << 62

    def text_tokens(self, text: str, *, add_special_tokens: bool) -> PromptTokens:
        return PromptTokens(list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"]))

    def chat_template(self, *, with_tools: bool) -> str | None:
        try:
            template = self.hf.get_chat_template(None, tools=[] if with_tools else None)
        except ValueError:
            return None
        return template if isinstance(template, str) else None

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]
    ) -> str | list[int]:
        call_kwargs = dict(kwargs)
        tools = call_kwargs.pop("tools", None)
        tokenize = bool(call_kwargs.pop("tokenize", False))
        call_kwargs.pop("return_dict", None)
        template = self.chat_template(with_tools=tools is not None)
        assert template is not None
        chat = conversation(messages, detect_content_format(template))
        if any(m["role"] == "developer" for m in chat) and not supports_developer_role(template):
            chat = fold_developer(chat)
        rendered = self.hf.apply_chat_template(
            chat,
            tools=tools,
            chat_template=template,
            tokenize=tokenize,
            return_dict=False,
            **call_kwargs,
        )
        return [int(t) for t in rendered] if tokenize else str(rendered)


def outcome(counter: Any, plan: CompletionPlan | ChatPlan) -> object:
    """The ids of each prompt, or the kind of error counting it raised."""
    try:
        return [list(p.ids) for p in count_locally(counter, plan)]
    except Exception as exc:
        return f"raised {type(exc).__name__}"


def both(path: Path) -> tuple[ModelTokenizer, TransformersReference]:
    slim = ModelTokenizer.load(path)
    assert slim.loaded_by == "tokenizers"
    return slim, TransformersReference(path)


def tiny_copy(tmp_path: Path, **config: Any) -> Path:
    """The tiny model's tokenizer files in ``tmp_path``, ``tokenizer_config.json`` updated."""
    source = ensure_tokenizer_model()
    for name in TINY_FILES:
        shutil.copy(source / name, tmp_path / name)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tmp_path


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[ModelTokenizer, TransformersReference]:
    return both(ensure_tokenizer_model())


@pytest.fixture(scope="module")
def big_pair() -> tuple[ModelTokenizer, TransformersReference]:
    return both(ensure_big_vocab_model())


# --------------------------------------------------------------------------------------------
# Chats beyond SHAPES, for the Qwen-style template (tools, tool calls, reasoning, kwargs)
# --------------------------------------------------------------------------------------------

MULTILINGUAL = (
    "Ünïcödé naïve café 🚀🔥 日本語テキスト 中文 한국어 русский Ελληνικά\n\tdef f(x): return 42"
)
BIG_CHATS: list[tuple[str, dict[str, Any]]] = [
    (
        "tools-and-calls",
        {
            "messages": [
                {"role": "system", "content": "You route calls."},
                {"role": "user", "content": "weather in Paris and Tokyo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning": "two cities, two calls",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        },
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "東京"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
                {"role": "tool", "tool_call_id": "c2", "content": "rain, 14 C"},
            ],
            "tools": [WEATHER_TOOL],
        },
    ),
    (
        "thinking-off",
        {
            "messages": [{"role": "user", "content": MULTILINGUAL}],
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ),
    (
        "special-tokens-in-text",
        {
            "messages": [
                {"role": "user", "content": "<|im_start|>user <tool_call> <|endoftext|> hi"}
            ]
        },
    ),
    ("bad-role", {"messages": [{"role": "narrator", "content": "x"}]}),
    (
        "continue-reasoning",
        {
            "messages": [
                {"role": "user", "content": "sum 2+2"},
                {"role": "assistant", "content": "It is "},
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
    ("long", {"messages": [{"role": "user", "content": (MULTILINGUAL + " ") * 400}]}),
]
BIG_TEXTS = [
    MULTILINGUAL,
    sample(3000),
    LONG_TEXT,
    (MULTILINGUAL + "\n") * 300,
    "<|im_start|>system<|im_end|><tool_call>x</tool_call><|fim_prefix|>",
    "   leading and trailing spaces   ",
    "",
]


# --------------------------------------------------------------------------------------------
# The comparisons
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny", "big"])
@pytest.mark.parametrize(("endpoint", "body"), [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_every_request_shape_counts_the_same(
    model: str,
    endpoint: str,
    body: dict[str, Any],
    request: pytest.FixtureRequest,
) -> None:
    slim, reference = request.getfixturevalue(f"{model}_pair")
    plan = plan_count(endpoint, body)  # type: ignore[arg-type]
    # every shape here is tokenized (an estimated one would compare nothing)
    assert isinstance(plan, CompletionPlan | ChatPlan), plan
    expected = outcome(reference, plan)
    assert outcome(slim, plan) == expected
    assert not isinstance(expected, str)  # the shape is counted, not refused


@pytest.mark.parametrize(("name", "body"), BIG_CHATS, ids=[c[0] for c in BIG_CHATS])
def test_the_big_vocabulary_model_chats_count_the_same(
    big_pair: tuple[ModelTokenizer, TransformersReference], name: str, body: dict[str, Any]
) -> None:
    slim, reference = big_pair
    plan = plan_count("chat", body)
    assert isinstance(plan, ChatPlan)
    expected = outcome(reference, plan)
    assert outcome(slim, plan) == expected
    assert isinstance(expected, str) == (name == "bad-role")  # raise_exception, in both


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_big_vocabulary_model_texts_count_the_same(
    big_pair: tuple[ModelTokenizer, TransformersReference], add_special_tokens: bool
) -> None:
    slim, reference = big_pair
    for text in BIG_TEXTS:
        got = slim.encode_text(text, add_special_tokens=add_special_tokens)
        want = reference.text_tokens(text, add_special_tokens=add_special_tokens).ids
        assert got == want, text[:40]


def test_the_big_vocabulary_is_real_sized(
    big_pair: tuple[ModelTokenizer, TransformersReference],
) -> None:
    slim, reference = big_pair
    size = slim._backend.get_vocab_size()
    assert size == len(reference.hf) >= 151_643
    # the corpus's words are single tokens, as in a trained vocabulary
    text = sample(400)
    assert len(slim.encode_text(text, add_special_tokens=False)) <= 401


@pytest.mark.parametrize("template", [*FIXTURE_TEMPLATES, "dump"])
@pytest.mark.parametrize("case", range(len(CAPTURED["conversations"])))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_captured_conversations_render_the_same_under_every_fixture_template(
    tmp_path: Path, template: str, case: int, generation_prompt: bool
) -> None:
    path = tiny_copy(tmp_path)
    if template == "dump":
        (path / "chat_template.jinja").write_text(DUMP_TEMPLATE)
    else:
        shutil.copy(FIXTURES / "templates" / template, path / "chat_template.jinja")
    slim, reference = both(path)
    body = {
        "messages": CAPTURED["conversations"][case]["messages"],
        "add_generation_prompt": generation_prompt,
    }
    plan = plan_count("chat", body)
    assert isinstance(plan, ChatPlan)
    assert outcome(slim, plan) == outcome(reference, plan)


KWARGS_TEMPLATE = DUMP_TEMPLATE + "|{{ special_tokens }}|{{ date_string }}|{{ max_length }}"
TEMPLATE_KWARGS: list[dict[str, Any]] = [
    {"special_tokens": "S", "date_string": "1 Jan 2026"},
    {"documents": [{"title": "t", "text": "the cache block"}]},
    {"documents": ["not a dict"]},
    {"bos_token": "<override>"},
    {"truncation": True, "max_length": 3, "padding": True},
    {"conversation": []},
]


@pytest.mark.parametrize("kwargs", TEMPLATE_KWARGS, ids=lambda k: ",".join(k))
def test_chat_template_kwargs_reach_the_template_as_in_transformers(
    tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    """``chat_template_kwargs`` named like a special token, like one of apply_chat_template's own
    parameters or like the renderer's: each is what transformers makes of it (a variable,
    ignored, or the same error)."""
    path = tiny_copy(tmp_path)
    (path / "chat_template.jinja").write_text(KWARGS_TEMPLATE)
    slim, reference = both(path)
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    plan = plan_count("chat", body)
    assert isinstance(plan, ChatPlan)
    expected = outcome(reference, plan)
    assert outcome(slim, plan) == expected
    assert isinstance(expected, str) == ("conversation" in kwargs or "not a dict" in str(kwargs))


def test_a_broken_template_fails_in_both(tmp_path: Path) -> None:
    path = tiny_copy(tmp_path)
    shutil.copy(FIXTURES / "templates" / "broken.jinja", path / "chat_template.jinja")
    plan = plan_count("chat", {"messages": [{"role": "user", "content": "x"}]})
    assert isinstance(plan, ChatPlan)
    slim, reference = both(path)
    assert outcome(slim, plan) == outcome(reference, plan) == "raised TemplateSyntaxError"


TOOL_USE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ messages[0]['content'] }}"
CONFIGS: list[tuple[str, dict[str, Any], str | None]] = [
    # tokenizer.json's post-processor decides: add_bos_token is ignored beside one
    ("add-bos-ignored", {"add_bos_token": True, "add_eos_token": True}, None),
    ("no-post-processor", {"add_bos_token": True}, "no-post-processor"),
    (
        "added-token-only-in-config",
        {
            "added_tokens_decoder": {
                "600": {"content": "<|new|>", "special": True, "normalized": False},
                "601": {"content": "<|plain|>", "special": False, "lstrip": True},
            }
        },
        None,
    ),
    (
        "model-specific-tokens",
        {"image_token": "<|image|>", "extra_special_tokens": {"audio_token": "<|audio|>"}},
        None,
    ),
    ("additional-special-tokens", {"additional_special_tokens": ["<|x|>", "<|y|>"]}, None),
    ("split-special-tokens", {"split_special_tokens": True}, None),
    (
        "named-templates",
        {
            "chat_template": [
                {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
                {"name": "tool_use", "template": TOOL_USE},
            ]
        },
        "no-template-file",
    ),
    ("template-dir", {}, "template-dir"),
]
PROBES = [
    "hello <|bos|> world <|eos|>",
    "<|new|> and <|plain|>  <|image|><|audio|><|x|><|y|> <|system|>",
    LONG_TEXT,
]


@pytest.mark.parametrize(("name", "config", "files"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_tokenizer_configurations_load_the_same(
    tmp_path: Path, name: str, config: dict[str, Any], files: str | None
) -> None:
    path = tiny_copy(tmp_path, **config)
    if files == "no-post-processor":
        spec = json.loads((path / "tokenizer.json").read_text())
        spec["post_processor"] = None
        (path / "tokenizer.json").write_text(json.dumps(spec))
    if files in ("no-template-file", "template-dir"):
        (path / "chat_template.jinja").unlink()
    if files == "template-dir":
        (path / "additional_chat_templates").mkdir()
        (path / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
        (path / "chat_template.jinja").write_text("{{ eos_token }}{{ messages[0]['content'] }}")
    slim, reference = both(path)
    assert slim._special_tokens == reference.hf.special_tokens_map
    for with_tools in (False, True):
        assert slim.chat_template(with_tools=with_tools) == reference.chat_template(
            with_tools=with_tools
        )
    for probe in PROBES:
        for flag in (True, False):
            want = reference.text_tokens(probe, add_special_tokens=flag).ids
            assert slim.encode_text(probe, add_special_tokens=flag) == want, (probe[:30], flag)
    for tools in (None, [WEATHER_TOOL]):
        plan = plan_count("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": tools})
        assert isinstance(plan, ChatPlan)
        assert outcome(slim, plan) == outcome(reference, plan)


def gpt2_style_files(tmp_path: Path) -> Path:
    """A tokenizer with vocab.json and merges.txt and no tokenizer.json: only transformers can
    build it."""
    tok = ModelTokenizer.load(ensure_tokenizer_model())._backend
    spec = json.loads(tok.to_str())
    (tmp_path / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|eos|>", "bos_token": "<|bos|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_without_a_tokenizer_json_transformers_builds_the_tokenizer(tmp_path: Path) -> None:
    path = gpt2_style_files(tmp_path)
    tokenizer = ModelTokenizer.load(path)
    assert tokenizer.loaded_by == "transformers"
    reference = TransformersReference(path)
    for probe in PROBES:
        want = reference.text_tokens(probe, add_special_tokens=True).ids
        assert tokenizer.encode_text(probe, add_special_tokens=True) == want


def test_without_transformers_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = gpt2_style_files(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(MissingTransformers, match=r"vllm-kv-sidecar\[transformers\]"):
        ModelTokenizer.load(path)
    # a tokenizer.json needs no transformers at all
    assert ModelTokenizer.load(ensure_tokenizer_model()).count_text("hi", add_special_tokens=True)


def test_counting_a_tokenizer_json_never_imports_transformers() -> None:
    """The sidecar's app and a chat counted with the tiny model's tokenizer, in a fresh
    interpreter: transformers is never imported (the image does not hold it)."""
    script = (
        "import sys, sidecar.app, sidecar.cli\n"
        "from sidecar.counting import ModelTokenizer\n"
        "from sidecar.counting.plan import plan_count\n"
        "from sidecar.counting.tokenizer import count_locally\n"
        f"tok = ModelTokenizer.load({str(ensure_tokenizer_model())!r})\n"
        "plan = plan_count('chat', {'messages': [{'role': 'user', 'content': 'hi'}]})\n"
        "assert count_locally(tok, plan)[0].ids\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
