"""The model's own tokenizer and chat template, in this process: exact local prompt counts.

:class:`ModelTokenizer` holds the model's Rust tokenizer (the ``tokenizers`` library), one for
every thread: a long prompt is counted on a worker thread while the event loop keeps serving,
and renders the chat template with jinja2 as transformers does
(:mod:`sidecar.counting.chat_template`); :func:`count_locally` tokenizes a plan with it, giving
the token ids themselves (the counts are their lengths; the ids key the prefix cache's blocks).
The directory is read as transformers reads it (:mod:`sidecar.counting.tokenizer_files`);
transformers itself is needed only for a tokenizer without a ``tokenizer.json`` (the
``[transformers]`` extra). What vLLM does to the messages before the template sees them is in
:mod:`sidecar.counting.render`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from sidecar.counting.chat_template import TOKENIZE_OPTIONS, render
from sidecar.counting.content_format import detect_content_format
from sidecar.counting.plan import ChatPlan, CompletionPlan, PromptTokens
from sidecar.counting.render import (
    NeedsUpstream,
    conversation,
    fold_developer,
    supports_developer_role,
)
from sidecar.counting.tokenizer_files import TokenizerFiles, from_transformers, load_files

#: Model types whose chat prompts vLLM renders without the HF chat template (Harmony).
_HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})
#: The counter's worker threads at least (the tokenizer's load, the long counts).
OFFLOAD_WORKERS = 2
#: Texts longer than this are tokenized with the GIL released (``encode_batch``); shorter ones
#: with ``encode``, which holds it (about 1 us cheaper, and they are counted on the event loop
#: anyway: see ``PromptCounter.offload_threshold_chars``).
GIL_FREE_CHARS = 2000


class ModelTokenizer:
    """The model's Rust tokenizer and chat template, shared by every thread.

    One Rust tokenizer serves every thread: ``encode`` and ``encode_batch`` borrow it
    immutably, so threads encode with it at once (``tests/test_counting_load.py``). What made
    transformers' tokenizers unsafe to share, and vLLM keep a pool of copies, is its
    ``__call__`` setting truncation and padding on the shared Rust object (a mutable borrow:
    "Already borrowed"); nothing here changes the Rust tokenizer after loading. A copy of a
    151,665-token vocabulary holds some 40 MiB (BENCHMARKS.md, sidecar memory).

    Usage (loading takes a second or so)::

        tok = ModelTokenizer.load("/models/tiny")
        tok.count_text("hello world", add_special_tokens=True)  # 3
        tok.encode_text("hello world", add_special_tokens=True)  # [280, 378, 503]
    """

    def __init__(self, files: TokenizerFiles, *, path: Path, harmony: bool = False) -> None:
        # One text per call: rayon's pool cannot split it, and would only add a thread hop to
        # each long count and idle threads that spin on the CPUs the event loop needs. Without
        # it the Rust tokenizer runs on the calling worker thread (GIL released all the same).
        # An operator's own TOKENIZERS_PARALLELISM is kept.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.path = path
        #: the model renders chat with Harmony, not its HF chat template (gpt-oss)
        self.harmony = harmony
        #: ``tokenizers`` (read from tokenizer.json) or ``transformers`` (built by AutoTokenizer)
        self.loaded_by = files.loaded_by
        backend = files.backend
        # vLLM's tokenizer call sets truncation and padding per call, off unless asked; a
        # tokenizer.json may switch them on.
        backend.no_truncation()
        backend.no_padding()
        self._special_tokens = dict(files.special_tokens)
        self._backend = backend
        self._templates = {
            tools: files.get_chat_template(with_tools=tools) for tools in (False, True)
        }
        self._added = {flag: _added_around(backend, flag) for flag in (False, True)}

    @classmethod
    def load(cls, path: str | Path) -> ModelTokenizer:
        """Load the tokenizer in ``path`` (a model or tokenizer directory). Slow: a second or
        so for a 150k-token vocabulary."""
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory} is not a directory")
        if _is_mistral_repo(directory):
            # vLLM uses mistral-common for these, not the HF tokenizer.
            raise ValueError(f"{directory} is a Mistral-format repository")
        files = load_files(directory)
        return cls(files, path=directory, harmony=_model_type(directory) in _HARMONY_MODEL_TYPES)

    @classmethod
    def from_transformers(cls, hf_tokenizer: Any, *, path: Path) -> ModelTokenizer:
        """Wrap a loaded transformers fast tokenizer (tests build tokenizers this way)."""
        return cls(from_transformers(hf_tokenizer), path=path)

    def encode_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text``, untruncated, as vLLM's tokenizer call makes them.

        A text longer than :data:`GIL_FREE_CHARS` is tokenized with the GIL released, so that
        the event loop keeps running while a worker thread counts it (docs/counting-load.md).
        """
        # the Rust tokenizer itself: what transformers' __call__ runs for a fast tokenizer,
        # without its per-call Python (measured at ~40% of a short prompt's count)
        backend = self._backend
        if len(text) > GIL_FREE_CHARS:
            # encode() holds the GIL for the whole tokenization (a 128k-token prompt: every
            # thread, the event loop included, stopped for 150-700 ms); encode_batch() lets
            # it go while Rust works. Same ids: both run the same encode per input.
            encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = backend.encode(text, add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def count_text(self, text: str, *, add_special_tokens: bool) -> int:
        return len(self.encode_text(text, add_special_tokens=add_special_tokens))

    def text_tokens(self, text: str, *, add_special_tokens: bool) -> PromptTokens:
        """``text`` tokenized, with how many ids the tokenizer added around it (truncation
        keeps those)."""
        ids = self.encode_text(text, add_special_tokens=add_special_tokens)
        return PromptTokens(ids, self._added[add_special_tokens])

    def chat_template(self, *, with_tools: bool) -> str | None:
        """The template vLLM picks (a ``tool_use`` variant when tools are given), or None."""
        return self._templates[with_tools]

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]
    ) -> str | list[int]:
        """The chat prompt vLLM renders: text, or token ids when the kwargs ask it to tokenize.

        Raises :class:`NeedsUpstream` for content it cannot expand, anything else on a
        template error.
        """
        call_kwargs = dict(kwargs)
        tools = call_kwargs.pop("tools", None)
        tokenize = bool(call_kwargs.pop("tokenize", False))
        call_kwargs.pop("return_dict", None)
        template = self.chat_template(with_tools=tools is not None)
        if template is None:
            raise NeedsUpstream("no chat template in the tokenizer")
        chat = conversation(messages, detect_content_format(template))
        if any(m["role"] == "developer" for m in chat) and not supports_developer_role(template):
            chat = fold_developer(chat)
        if tokenize and any(call_kwargs.get(key) for key in TOKENIZE_OPTIONS):
            raise NeedsUpstream("chat template kwargs that tokenize otherwise")
        rendered = render(template, chat, self._special_tokens, tools=tools, **call_kwargs)
        if tokenize:
            # apply_chat_template(tokenize=True): the rendered text, no special tokens added
            return self.encode_text(rendered, add_special_tokens=False)
        return rendered


def _added_around(backend: Tokenizer, add_special_tokens: bool) -> tuple[int, int] | None:
    """How many ids the tokenizer's post-processor adds before and after a text (BOS, EOS):
    the same for every text, so read once from a sample; None if it cannot be told."""
    if not add_special_tokens:
        return (0, 0)
    try:
        sample = backend.encode("a b", add_special_tokens=True)
        bare = backend.encode("", add_special_tokens=True)
        sequence_ids = list(sample.sequence_ids)
    except Exception:
        return None
    head = next((i for i, s in enumerate(sequence_ids) if s is not None), None)
    if head is None:
        return None
    tail = next(i for i, s in enumerate(reversed(sequence_ids)) if s is not None)
    if head + tail != len(bare.ids) or any(
        s is None for s in sequence_ids[head : len(sequence_ids) - tail]
    ):
        return None  # not a plain "added + text + added" layout
    return (head, tail)


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


def count_locally(tokenizer: ModelTokenizer, plan: CompletionPlan | ChatPlan) -> list[PromptTokens]:
    """The exact local tokens of each prompt, untruncated (blocking; may run on a worker
    thread): their lengths are the counts, and their ids are what vLLM caches."""
    if isinstance(plan, CompletionPlan):
        return [
            PromptTokens(p)
            if isinstance(p, list)
            else tokenizer.text_tokens(p, add_special_tokens=plan.add_special_tokens)
            for p in plan.prompts
        ]
    if plan.upstream_only:
        raise NeedsUpstream(plan.upstream_only)
    kwargs = plan.local_kwargs()
    if kwargs.get("chat_template") is not None:
        raise NeedsUpstream("a request-supplied chat template")
    rendered = tokenizer.render_chat(plan.messages, kwargs)
    if isinstance(rendered, list):
        return [PromptTokens(rendered)]  # ids from the template: vLLM slices them as given
    return [tokenizer.text_tokens(rendered, add_special_tokens=plan.add_special_tokens)]
