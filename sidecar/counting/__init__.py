"""Prompt token counting: request planning and validation, vLLM's rendering rules, the tokenizer,
the estimate, and the counter that puts them together.

The modules, each one job: :mod:`~sidecar.counting.request` (which paths generate, parsing and
validating their bodies), :mod:`~sidecar.counting.plan` (what to count for a body, and its
truncation), :mod:`~sidecar.counting.render` (the mirror of vLLM 0.32's chat and Responses
rendering), :mod:`~sidecar.counting.content_format` (the chat template's content format),
:mod:`~sidecar.counting.tokenizer` (the model's tokenizer, local counts),
:mod:`~sidecar.counting.estimate` (the upper-bound estimate),
:mod:`~sidecar.counting.self_check` (local counts sampled against vLLM's),
:mod:`~sidecar.counting.upstream` (vLLM's render endpoints and /tokenize) and
:mod:`~sidecar.counting.counter` (:class:`PromptCounter`).
"""

from sidecar.counting.counter import CountMethod, PromptCounter, TokenCount
from sidecar.counting.request import (
    GENERATION_PATHS,
    CountedEndpoint,
    Endpoint,
    GenerationRequest,
    counting_view,
    parse_generation,
)
from sidecar.counting.self_check import (
    SELF_CHECKED_SHAPES,
    CountingObserver,
    PromptShape,
)
from sidecar.counting.tokenizer import ModelTokenizer

__all__ = [
    "GENERATION_PATHS",
    "SELF_CHECKED_SHAPES",
    "CountMethod",
    "CountedEndpoint",
    "CountingObserver",
    "Endpoint",
    "GenerationRequest",
    "ModelTokenizer",
    "PromptCounter",
    "PromptShape",
    "TokenCount",
    "counting_view",
    "parse_generation",
]
