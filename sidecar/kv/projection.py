"""KV projection: the tokens, blocks and bytes a request can reach, clamped as vLLM clamps.

Pure functions. The effective ``max_tokens`` follows vLLM's ``get_max_tokens``
(``entrypoints/serve/utils/api_utils.py``): the smallest of the rest of the context, the request's
own value (else the generation config's default), and the server-wide cap (vLLM's
``override_max_tokens``). A request for more output than ``max_model_len`` or a prompt longer
than it gets vLLM's own 400 message, without a round trip.

>>> from sidecar.kv.geometry import UniformBlocks
>>> p = project_counts((449,), requested_max_tokens=600, n=1, max_model_len=1024,
...                    blocks=UniformBlocks(128))
>>> p.max_tokens, p.peak_blocks
((575,), 8)
>>> project_counts((100,), requested_max_tokens=None, n=1, max_model_len=1024,
...                blocks=UniformBlocks(128), default_max_tokens=256).max_tokens
(256,)
>>> project_counts((100,), requested_max_tokens=600, n=1, max_model_len=1024,
...                blocks=UniformBlocks(128), max_tokens_cap=64).max_tokens
(64,)
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.errors import BadRequest
from sidecar.kv.blocks import BlockMath

__all__ = ["BlockMath", "Projection", "project_counts"]


@dataclass(frozen=True, slots=True)
class Projection:
    """One request's KV need. ``n`` sequences per prompt, each up to prompt + max_tokens."""

    prompt_tokens: tuple[int, ...]
    max_tokens: tuple[int, ...]  # effective, per prompt
    n: int
    prompt_blocks: int  # all sequences right after prefill
    peak_blocks: int  # all sequences at max_tokens
    exact: bool = True  # False: the prompt counts are upper-bound estimates
    #: output tokens each sequence generates at least (the request's ``min_tokens``: vLLM
    #: ignores the end-of-sequence token until then), at most its max_tokens
    min_tokens: int = 0
    #: the most blocks one sequence reaches at its max_tokens: vLLM schedules each prompt of a
    #: list and each of ``n`` samples as a request of its own, so this, not ``peak_blocks``, is
    #: what must fit vLLM's pool for the request to run at all (0: not computed)
    sequence_peak_blocks: int = 0

    @property
    def sequences(self) -> int:
        return len(self.prompt_tokens) * self.n

    @property
    def prompt_total(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def peak_tokens(self) -> int:
        return self.n * sum(p + m for p, m in zip(self.prompt_tokens, self.max_tokens, strict=True))

    def blocks_at(self, generated_per_sequence: int, blocks: BlockMath) -> int:
        """Blocks held when each sequence has generated ``generated_per_sequence`` tokens."""
        started = generated_per_sequence > 0  # before its first token it is prefilling
        if len(self.prompt_tokens) == 1:  # the common case, once per token of every stream
            prompt = self.prompt_tokens[0]
            grown = min(generated_per_sequence, self.max_tokens[0])
            return self.n * blocks.blocks_held(prompt + grown, prompt, started=started)
        return self.n * sum(
            blocks.blocks_held(p + min(generated_per_sequence, m), p, started=started)
            for p, m in zip(self.prompt_tokens, self.max_tokens, strict=True)
        )


def project_counts(
    prompt_tokens: tuple[int, ...],
    *,
    requested_max_tokens: int | None,
    n: int,
    max_model_len: int,
    blocks: BlockMath,
    max_tokens_param: str = "max_tokens",
    exact: bool = True,
    default_max_tokens: int | None = None,
    max_tokens_cap: int | None = None,
    resolved_max_tokens: tuple[int, ...] | None = None,
    min_tokens: int = 0,
) -> Projection:
    """Project a request from its prompt token counts, or raise vLLM's 400 as BadRequest.

    ``prompt_tokens`` are the counts vLLM keeps, already truncated: the prompt counter applies
    ``truncate_prompt_tokens`` (``sidecar.counting.plan.Truncation``, the only place it is
    interpreted). With ``exact=False`` the counts are upper bounds: they are capped at the context
    instead of refused, since only vLLM can tell whether the prompt really is too long.

    ``requested_max_tokens`` is what vLLM's request object holds once validated (the client's
    value, or the endpoint's own default such as 16 for ``/v1/completions``); None: the request
    leaves it to the server. Then, as in vLLM's ``get_max_tokens``, each sequence may generate
    ``min(max_model_len - prompt, requested_max_tokens, max_tokens_cap)``, where
    ``default_max_tokens`` (the generation config's ``max_new_tokens``) stands in for a None
    ``requested_max_tokens`` and None terms are left out. ``max_tokens_cap`` is vLLM's
    ``override_max_tokens``: it caps every request, even one that names its own ``max_tokens``.
    Only ``requested_max_tokens`` is checked against ``max_model_len`` (vLLM's
    ``TokenizeParams`` checks the request's own value, never the defaults).

    ``resolved_max_tokens``, one per prompt, is what vLLM itself resolved (its render endpoint
    answers it): it stands in for that rule, so that a generation config or an override the
    sidecar was not told of is still counted as vLLM counts it.

    >>> from sidecar.kv.geometry import UniformBlocks
    >>> blocks = UniformBlocks(16)
    >>> project_counts((100,), requested_max_tokens=None, n=1, max_model_len=1024,
    ...                blocks=blocks, resolved_max_tokens=(256,)).max_tokens
    (256,)
    """
    if requested_max_tokens is not None and requested_max_tokens > max_model_len:
        # vLLM: renderers/params.py TokenizeParams.__post_init__
        raise BadRequest(
            f"{max_tokens_param}={requested_max_tokens} cannot be greater than "
            f"max_model_len={max_model_len}. Please request fewer output tokens.",
            param=max_tokens_param,
            code="max_tokens_too_large",
        )
    fallback = requested_max_tokens if requested_max_tokens is not None else default_max_tokens
    counts: list[int] = []
    effective: list[int] = []
    for count in prompt_tokens:
        if not exact:
            count = min(count, max_model_len - 1)
        if count > max_model_len:
            # vLLM: renderers/params.py _token_len_check
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt contains {count} input tokens, which exceeds this limit even without "
                f"any output tokens. Please reduce the length of the input prompt.",
                param="input_tokens",
                code="context_length_exceeded",
            )
        # vLLM: entrypoints/serve/utils/api_utils.get_max_tokens
        limits: tuple[int | None, ...] = (max_model_len - count, fallback, max_tokens_cap)
        if resolved_max_tokens is not None and len(resolved_max_tokens) == len(prompt_tokens):
            limits = (max_model_len - count, resolved_max_tokens[len(effective)])
        effective.append(min(v for v in limits if v is not None))
        counts.append(count)
    prompt_blocks = n * sum(blocks.blocks_held(c, c, started=False) for c in counts)
    peaks = [
        blocks.blocks_held(c + m, c, started=False) for c, m in zip(counts, effective, strict=True)
    ]
    return Projection(
        tuple(counts),
        tuple(effective),
        n,
        prompt_blocks,
        n * sum(peaks),
        exact,
        max(0, min_tokens),
        max(peaks, default=0),
    )
