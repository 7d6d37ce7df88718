"""A chat template rendered with jinja2 as transformers' ``apply_chat_template`` renders it.

The mirror of ``transformers/utils/chat_template_utils.py`` (``_compile_jinja_template``,
``render_jinja_template``) and of ``PreTrainedTokenizerBase.apply_chat_template`` for one
conversation with ``tokenize=False``, in transformers 5.16-5.19, the range vLLM 0.32 requires
(``vllm/renderers/hf.py``'s ``safe_apply_chat_template`` calls it):

* an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension and ``{% generation %}`` blocks (rendered as their body);
* ``tojson`` as ``json.dumps`` (no HTML escaping, ``ensure_ascii=False``, ``indent``,
  ``separators`` and ``sort_keys`` accepted), and the ``raise_exception`` and ``strftime_now``
  globals;
* the template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the named
  special tokens (``bos_token``, ...) and every other keyword argument (``chat_template_kwargs``),
  the keyword arguments winning over the special tokens;
* ``continue_final_message``: the final message is rendered with a tag after it and the
  rendering cut at the tag, so the model continues that message.

>>> render("{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}",
...        [{"role": "user", "content": "é<b>"}], {"bos_token": "<s>"})
'<s>"é<b>"'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from copy import deepcopy
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

from sidecar.counting.content_format import GenerationTag

#: ``apply_chat_template``'s own parameters that are not template variables; with
#: ``tokenize=False`` (how vLLM calls it) they do nothing.
TOKENIZE_OPTIONS = frozenset(
    {
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def compile_template(chat_template: str) -> jinja2.Template:
    """The compiled template (cached, as transformers caches it)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(chat_template)


def render(
    chat_template: str,
    conversation: Sequence[Mapping[str, Any]],
    special_tokens: Mapping[str, str],
    /,
    *,
    tools: Sequence[Any] | None = None,
    documents: Sequence[Any] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """``apply_chat_template(conversation, tools=..., tokenize=False, ...)`` for one
    conversation; raises what transformers raises (``ValueError``, ``TypeError``, jinja2's
    ``TemplateError``). Every keyword argument but ``apply_chat_template``'s own is a template
    variable, ``special_tokens`` too: the first three are positional."""
    if "conversation" in kwargs:  # apply_chat_template's first parameter, given twice
        raise TypeError("apply_chat_template() got multiple values for argument 'conversation'")
    if len(conversation) == 0:
        raise ValueError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    for key in TOKENIZE_OPTIONS:
        kwargs.pop(key, None)
    template_kwargs = {**special_tokens, **kwargs}
    compiled = compile_template(chat_template)
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("Tools should either be a JSON schema, or a callable function.")
    if documents is not None and not all(isinstance(doc, dict) for doc in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat: Any = conversation
    final_message: Any = None
    if continue_final_message:
        chat = deepcopy(list(conversation))
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_message = chat[-1].get(field)
        if final_message is None:
            raise ValueError(f'the final message has no "{field}" to continue')
        if field not in chat_template:
            raise ValueError(
                f'continue_final_message is set to "{field}", which the template lacks'
            )
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("no text to continue in the final message")
        else:
            chat[-1][field] = chat[-1][field] + _CONTINUE_TAG
    rendered = compiled.render(
        messages=chat,
        tools=None if tools is None else list(tools),
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    if continue_final_message:
        if final_message.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError("the final message does not appear in the rendered chat")
        tag_at = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[tag_at : tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:tag_at]
        else:
            rendered = rendered[:tag_at].rstrip()
    return rendered
