"""Which content format vLLM gives a chat template: its walk over the template's jinja syntax tree.

vLLM passes a message's ``content`` to the template either as a list of parts (``"openai"``,
when the template loops over it) or as one string (``"string"``, the text parts joined by
newlines). It decides by parsing the template and looking for such a loop
(``_detect_content_format`` in ``vllm/renderers/hf.py``, vLLM 0.32.0); this module repeats that
walk, so that the rendered prompt, and its token count, come out the same.

>>> detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}")
'string'
>>> detect_content_format(
...     "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
...     "{% endfor %}"
... )
'openai'
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]


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


class GenerationTag(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}`` blocks so that templates using them parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


_PARSE_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[GenerationTag, jinja2.ext.loopcontrols],
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
