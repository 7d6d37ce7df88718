"""The self-check of local prompt counts against vLLM's own: which counts, and who hears.

Local counts rest on mirroring vLLM's rendering; a server flag this process cannot see
(``--chat-template``, ``--chat-template-content-format``, ``--default-chat-template-kwargs``,
another tokenizer) or a template branch only some requests take makes them drift. So the
counter compares a sample of its local counts with vLLM's (its render endpoint where vLLM serves
render, else ``/tokenize``: :mod:`sidecar.counting.upstream`), per :class:`PromptShape`
(endpoint x tools x content kind): the first local count of each shape, then one in every
``every``. A shape whose count ever disagrees is counted by vLLM from then on.

Each outcome goes to a :class:`CountingObserver`, so the counter knows nothing of metrics;
the app wires one that feeds ``kv_sidecar_prompt_count_checks_total{shape,result}``.

>>> schedule, shape = SelfCheckSchedule(every=3), PromptShape.CHAT_TEXT
>>> def count_one() -> bool:
...     if not schedule.due(shape):
...         return False
...     schedule.done(shape, checked=True)  # the check ran (in the background, really)
...     return True
>>> [count_one() for _ in range(7)]
[True, False, False, True, False, False, True]
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import Protocol

from sidecar.counting.plan import ChatPlan, CompletionPlan
from sidecar.counting.request import CountedEndpoint


class PromptShape(enum.StrEnum):
    """A request's shape for counting: endpoint, whether it has tools, and its content kind.

    The value is the ``shape`` metric label: a closed set of ten.
    """

    COMPLETIONS_TEXT = "completions_text"
    COMPLETIONS_TOKEN_IDS = "completions_token_ids"
    CHAT_TEXT = "chat_text"
    CHAT_TEXT_TOOLS = "chat_text_tools"
    CHAT_MULTIMODAL = "chat_multimodal"
    CHAT_MULTIMODAL_TOOLS = "chat_multimodal_tools"
    RESPONSES_TEXT = "responses_text"
    RESPONSES_TEXT_TOOLS = "responses_text_tools"
    RESPONSES_MULTIMODAL = "responses_multimodal"
    RESPONSES_MULTIMODAL_TOOLS = "responses_multimodal_tools"


#: The shapes that can be self-checked: those counted by the local tokenizer. Token ids need no
#: tokenizer and multimodal content is always counted by vLLM, so neither is ever compared.
SELF_CHECKED_SHAPES: tuple[PromptShape, ...] = (
    PromptShape.COMPLETIONS_TEXT,
    PromptShape.CHAT_TEXT,
    PromptShape.CHAT_TEXT_TOOLS,
    PromptShape.RESPONSES_TEXT,
    PromptShape.RESPONSES_TEXT_TOOLS,
)


def prompt_shape(endpoint: CountedEndpoint, plan: CompletionPlan | ChatPlan) -> PromptShape:
    """The shape of a planned request.

    >>> from sidecar.counting.plan import plan_count
    >>> body = {"messages": [{"role": "user", "content": "hi"}], "tools": []}
    >>> prompt_shape("chat", plan_count("chat", body))
    <PromptShape.CHAT_TEXT: 'chat_text'>
    """
    if isinstance(plan, CompletionPlan):
        if plan.token_ids_only:
            return PromptShape.COMPLETIONS_TOKEN_IDS
        return PromptShape.COMPLETIONS_TEXT
    kind = "multimodal" if plan.multimodal else "text"
    tools = "_tools" if plan.tools else ""
    return PromptShape(f"{'responses' if endpoint == 'responses' else 'chat'}_{kind}{tools}")


class CountingObserver(Protocol):
    """Hears the outcome of each self-check (the app feeds it to the exporter)."""

    def self_checked(self, shape: PromptShape, matched: bool) -> None:
        """A local count of ``shape`` was compared with vLLM's: equal, or not."""


class SelfCheckSchedule:
    """Which local counts to check: the first of each shape, then one in every ``every``.

    At most one check per shape is in flight, so a burst never adds a vLLM call per request;
    a check that could not be made (vLLM unavailable) is owed to the next count of its shape.
    """

    def __init__(self, every: int) -> None:
        if every < 2:
            raise ValueError(f"self-check rate must be 1 in 2 or fewer, got 1 in {every}")
        self.every = every
        self._seen: Counter[PromptShape] = Counter()
        self._owed: set[PromptShape] = set()
        self._in_flight: set[PromptShape] = set()

    def due(self, shape: PromptShape) -> bool:
        """Count one local count of ``shape``; True when it is to be checked (now in flight)."""
        seen = self._seen[shape]
        self._seen[shape] = seen + 1
        if seen % self.every == 0:
            self._owed.add(shape)
        if shape not in self._owed or shape in self._in_flight:
            return False
        self._owed.discard(shape)
        self._in_flight.add(shape)
        return True

    def done(self, shape: PromptShape, *, checked: bool) -> None:
        """The check of ``shape`` ended; ``checked=False``: it could not be made, retry soon."""
        self._in_flight.discard(shape)
        if not checked:
            self._owed.add(shape)
