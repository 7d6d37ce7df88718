"""A Hugging Face tokenizer directory read as transformers loads it, with ``tokenizers`` alone.

What ``AutoTokenizer.from_pretrained`` (transformers 5.16-5.19, the range vLLM 0.32 requires)
does to a directory with a ``tokenizer.json``, for the generic ``TokenizersBackend`` (also named
``PreTrainedTokenizerFast``) that loads that file as it is:

* ``tokenizer.json`` is the Rust tokenizer; its truncation and padding are dropped here (vLLM's
  tokenizer call sets both per call, off unless asked);
* ``add_bos_token`` and ``add_eos_token`` in ``tokenizer_config.json`` are ignored when there is
  a ``tokenizer.json`` (its post-processor decides what a text is wrapped in); a
  ``tokenizer.json`` without a post-processor gets a plain ``$A`` template;
* the special tokens named in ``tokenizer_config.json`` (``bos_token`` ... ``mask_token``,
  ``extra_special_tokens`` or the older ``additional_special_tokens``, model-specific
  ``*_token`` keys) and its ``added_tokens_decoder`` are added to the Rust tokenizer when it
  lacks them, and the named ones are what chat templates see (``bos_token``, ``eos_token``);
* ``split_special_tokens`` becomes the Rust tokenizer's ``encode_special_tokens``;
* the chat templates: ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``, else
  ``tokenizer_config.json``'s ``chat_template`` (one string, or a list of named ones).

A ``tokenizer_config.json`` naming a model-specific class with its own constructor (transformers
v5's ``Qwen2Tokenizer``, ``LlamaTokenizer``, ...) makes transformers rebuild the pipeline from the
class's definition and ``tokenizer.json``'s vocabulary and merges; for the published models the
two agree (``tests/test_slim_tokenizer.py`` proves it for a Qwen2-style 150k vocabulary), and the
counter's self-check against vLLM's ``/tokenize`` reports a count where they would not.

Without a ``tokenizer.json`` (a sentencepiece ``tokenizer.model``, a ``vocab.json`` with
``merges.txt``) only transformers can build the tokenizer: :func:`load_files` uses it when it is
installed (``pip install 'vllm-kv-sidecar[transformers]'``) and says so when it is not.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

#: ``PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES``: the named special tokens.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TRANSFORMERS_EXTRA = "pip install 'vllm-kv-sidecar[transformers]'"
_TEMPLATE_DIR = "additional_chat_templates"

ChatTemplates = str | dict[str, str] | None


class MissingTransformers(ImportError):
    """The directory has no ``tokenizer.json`` and transformers is not installed."""


@dataclass
class TokenizerFiles:
    """What counting needs of a tokenizer: the Rust tokenizer, the named special tokens the chat
    template sees, and the chat template(s)."""

    backend: Tokenizer
    #: ``tokenizer.special_tokens_map``: {"bos_token": "<s>", ...}, the named tokens only
    special_tokens: dict[str, str] = field(default_factory=dict)
    #: one template, several by name (``default``, ``tool_use``, ...), or none
    chat_template: ChatTemplates = None
    #: ``tokenizers`` (read here) or ``transformers`` (built by AutoTokenizer)
    loaded_by: str = "tokenizers"

    def get_chat_template(self, *, with_tools: bool) -> str | None:
        """``get_chat_template(None, tools)``: the template for a request with or without tools,
        or None where transformers would raise."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if with_tools and "tool_use" in templates:
                return templates["tool_use"]
            return templates.get("default")
        return templates


def load_files(directory: Path) -> TokenizerFiles:
    """The tokenizer in ``directory``: from ``tokenizer.json`` with ``tokenizers``, else through
    transformers (:class:`MissingTransformers` when it is not installed)."""
    config = _read_json(directory / "tokenizer_config.json")
    tokenizer_file = directory / "tokenizer.json"
    # versioned tokenizer files (``fast_tokenizer_files``) are picked by transformers alone
    if tokenizer_file.is_file() and "fast_tokenizer_files" not in config:
        return _from_tokenizer_json(tokenizer_file, config, directory)
    return _through_transformers(directory)


def from_transformers(hf_tokenizer: Any) -> TokenizerFiles:
    """The pieces of a loaded transformers fast tokenizer (its Rust tokenizer copied)."""
    templates = hf_tokenizer.chat_template
    return TokenizerFiles(
        backend=copy.deepcopy(hf_tokenizer.backend_tokenizer),
        special_tokens=dict(hf_tokenizer.special_tokens_map),
        chat_template=dict(templates) if isinstance(templates, dict) else templates,
        loaded_by="transformers",
    )


def _through_transformers(directory: Path) -> TokenizerFiles:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise MissingTransformers(
            f"{directory} has no tokenizer.json; its tokenizer needs transformers to be built: "
            f"{TRANSFORMERS_EXTRA}"
        ) from exc
    # Local files only: the sidecar never reaches out to a model hub.
    hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"{directory} has no fast tokenizer")
    return from_transformers(hf)


def _from_tokenizer_json(path: Path, config: dict[str, Any], directory: Path) -> TokenizerFiles:
    backend = Tokenizer.from_file(str(path))
    backend.no_truncation()
    backend.no_padding()
    added = _config_added_tokens(config)
    by_content = {t.content: t for t in added.values()}
    named = _named_special_tokens(config, by_content)
    extra = _extra_special_tokens(config)
    _add_missing_tokens(backend, added, named, extra)
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    if backend.post_processor is None:
        # TokenizersBackend.update_post_processor with add_bos_token and add_eos_token off
        backend.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
    return TokenizerFiles(
        backend=backend,
        special_tokens={name: str(token.content) for name, token in named.items()},
        chat_template=_chat_templates(directory, config),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def _added_token(value: object) -> AddedToken | None:
    """A token as ``tokenizer_config.json`` writes it: a string, or an ``AddedToken`` dict."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        fields = {
            k: bool(value[k])
            for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
            if k in value
        }
        return AddedToken(value["content"], **fields)
    return None


def _config_added_tokens(config: Mapping[str, Any]) -> dict[int, AddedToken]:
    decoder = config.get("added_tokens_decoder")
    out: dict[int, AddedToken] = {}
    if isinstance(decoder, Mapping):
        for index, value in decoder.items():
            token = _added_token(value)
            if token is not None:
                out[int(index)] = token
    return out


def _named_special_tokens(
    config: Mapping[str, Any], by_content: Mapping[str, AddedToken]
) -> dict[str, AddedToken]:
    """The named special tokens: the standard ones, then model-specific ``*_token`` keys and an
    ``extra_special_tokens`` dict (both named too in transformers v5)."""
    named: dict[str, AddedToken] = {}
    for key, value in config.items():
        standard = key in SPECIAL_TOKEN_NAMES
        if not standard and not (key.endswith("_token") and isinstance(value, (str, Mapping))):
            continue
        if not standard and isinstance(value, Mapping) and value.get("__type") != "AddedToken":
            continue
        token = _added_token(value)
        if token is not None:
            named[key] = by_content.get(token.content, token)
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            token = _added_token(value)
            if token is not None:
                named[key] = token
    ordered = {k: named[k] for k in SPECIAL_TOKEN_NAMES if k in named}
    ordered.update((k, v) for k, v in named.items() if k not in ordered)
    return ordered


def _extra_special_tokens(config: Mapping[str, Any]) -> list[AddedToken]:
    extra = config.get("extra_special_tokens")
    if not extra:
        extra = config.get("additional_special_tokens")
    if not isinstance(extra, list):
        return []
    return [t for t in (_added_token(v) for v in extra) if t is not None]


def _token_key(token: AddedToken) -> tuple[object, ...]:
    return (
        token.content,
        token.single_word,
        token.lstrip,
        token.rstrip,
        token.normalized,
        token.special,
    )


def _add_missing_tokens(
    backend: Tokenizer,
    added: Mapping[int, AddedToken],
    named: Mapping[str, AddedToken],
    extra: list[AddedToken],
) -> None:
    """``TokenizersBackend.__init__``: the config's added tokens the Rust tokenizer lacks (as
    written), then the special tokens it has under no form."""
    present = backend.get_added_tokens_decoder()
    present_keys = {_token_key(t) for t in present.values()}
    to_add = [t for _, t in sorted(added.items()) if _token_key(t) not in present_keys]
    known = {t.content for t in present.values()} | {t.content for t in to_add}
    for token in [*named.values(), *extra]:
        if token.content not in known:
            to_add.append(token)
            known.add(token.content)
    if not to_add:
        return
    named_contents = {t.content for t in named.values()}
    tokens = []
    for token in to_add:
        if not token.special and token.content in named_contents:
            token = AddedToken(
                token.content,
                single_word=token.single_word,
                lstrip=token.lstrip,
                rstrip=token.rstrip,
                normalized=token.normalized,
                special=True,
            )
        tokens.append(token)
    backend.add_tokens(tokens)


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> ChatTemplates:
    templates: dict[str, str] = {}
    default = directory / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra_dir = directory / _TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, Mapping)}
    return None
