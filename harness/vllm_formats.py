"""vLLM 0.32's wire formats and request rules, as the fake vLLM answers them: pure functions.

The shapes are copied from what a real vLLM 0.32 (CPU build) answered, in
``tests/fixtures/vllm-0.32.0-cpu/``; the rules (the default and the cap of ``max_tokens``) from
vLLM's source, named at each function. One definition for both servers of the fake
(:mod:`harness.fake_vllm` for the tests, :mod:`harness.fake_vllm_fast` for the benchmarks).

>>> answer = completion_answer(False, "cmpl-1", "tiny", " w0 w1", 1, {"completion_tokens": 2})
>>> answer["object"], answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]
('text_completion', ' w0 w1', None)
>>> count_prompt({"prompt": "the quick brown fox"})  # 4 words and the BOS
5
>>> max_tokens_for(1024, prompt_tokens=1000, max_tokens=None, default=None, cap=None)
24
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm-0.32.0-cpu"
METRICS_TEXT = (FIXTURES / "metrics-fresh.txt").read_text()

#: A model config vLLM could serve: 2 layers, 2 KV heads, head_dim 64, bf16 (1 KiB per token).
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 256,
    "max_position_embeddings": 1024,
    "torch_dtype": "bfloat16",
}
CREATED = 1795939723  # vLLM stamps "created"; fixed here so that answers are reproducible
FINGERPRINT = "vllm-0.32.0-3470f119"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: vLLM 0.32's ``CompletionRequest.max_tokens`` default, also for an explicit null.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def write_model_dir(path: Path, *, max_new_tokens: int | None = None) -> Path:
    """A model directory holding only ``config.json`` (no tokenizer files), and with
    ``max_new_tokens`` a ``generation_config.json`` that sets it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    if max_new_tokens is not None:
        generation = {"bos_token_id": 0, "eos_token_id": 1, "max_new_tokens": max_new_tokens}
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def generation_default(model_root: Path | None) -> int | None:
    """``max_new_tokens`` of the model's ``generation_config.json``: what vLLM's default
    ``--generation-config auto`` takes as the default ``max_tokens``."""
    if model_root is None:
        return None
    try:
        value = json.loads((model_root / "generation_config.json").read_text()).get(
            "max_new_tokens"
        )
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _words(text: str) -> int:
    return len(text.split())


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def count_prompt(body: dict[str, Any]) -> int:
    """The fake tokenizer: words + 1 BOS for a prompt; 3 per message plus its words, + 2 for
    the generation prompt, for messages. Token-id prompts count as given."""
    if "messages" in body:
        return 2 + sum(3 + _words(_message_text(m.get("content"))) for m in body["messages"])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        return sum(count_prompt({**body, "prompt": p}) for p in prompt)
    bos = 1 if body.get("add_special_tokens", True) else 0
    return _words(str(prompt)) + bos


def dumps(obj: Any) -> bytes:
    """JSON as vLLM answers it: pydantic's compact JSON, non-ASCII left as is."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def vllm_error(message: str, status: int = 400, type_: str = "BadRequestError") -> bytes:
    return dumps({"error": {"message": message, "type": type_, "param": None, "code": status}})


def max_tokens_for(
    max_model_len: int,
    *,
    prompt_tokens: int,
    max_tokens: int | None,
    default: int | None,
    cap: int | None,
) -> int:
    """vLLM's ``get_max_tokens`` (entrypoints/serve/utils/api_utils.py): the least of the rest
    of the context, the request's max_tokens (else the generation config's ``default``) and the
    override ``cap``."""
    fallback = max_tokens if max_tokens is not None else default
    limits = (max_model_len - prompt_tokens, fallback, cap)
    return min(v for v in limits if v is not None)


def token_text(step: int) -> str:
    """The text the fake generates at decode step ``step``."""
    return f" w{step}"


def models_list(served_name: str, model_root: Path | None, max_model_len: int) -> dict[str, Any]:
    """``GET /v1/models``: one model, ``root`` when a model directory is known."""
    entry: dict[str, Any] = {
        "id": served_name,
        "object": "model",
        "created": CREATED,
        "owned_by": "vllm",
    }
    if model_root is not None:
        entry["root"] = str(model_root)
    entry |= {
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": "modelperm-b0903443d43eb746",
                "object": "model_permission",
                "created": CREATED,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return {"object": "list", "data": [entry]}


def tokenize_answer(count: int, max_model_len: int) -> dict[str, Any]:
    """``POST /tokenize``'s answer for a prompt of ``count`` tokens."""
    return {
        "count": count,
        "max_model_len": max_model_len,
        "tokens": list(range(count)),
        "token_strs": None,
    }


def completion_answer(
    chat: bool, rid: str, model: str, text: str, n: int, usage: dict[str, int]
) -> dict[str, Any]:
    """A non-streamed answer: ``n`` choices of ``text``, each cut at its length."""
    choices: list[dict[str, Any]]
    if chat:
        choices = [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
            }
            for i in range(n)
        ]
        answer: dict[str, Any] = {"id": rid, "object": "chat.completion"}
    else:
        choices = [
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
            for i in range(n)
        ]
        answer = {"id": rid, "object": "text_completion"}
    answer |= {
        "created": CREATED,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": {**usage, "prompt_tokens_details": None},
        "kv_transfer_params": None,
    }
    return answer


def stream_head(chat: bool, rid: str, model: str) -> dict[str, Any]:
    """The fields every event of a streamed answer starts with."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": CREATED, "model": model}


def stream_opening(head: dict[str, Any], index: int) -> dict[str, Any]:
    """The event vLLM opens each choice of a chat stream with: the role, before any token."""
    delta = {"role": "assistant", "content": ""}
    opening = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    return {**head, "choices": [opening], "prompt_token_ids": None, "prompt_text": None}


def stream_token(
    head: dict[str, Any], chat: bool, index: int, text: str, *, last: bool
) -> dict[str, Any]:
    """The event of one decode step of choice ``index``; the ``last`` one says why it ended."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    choice |= {"logprobs": None, "finish_reason": "length" if last else None}
    if last or not chat:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    return {**head, "choices": [choice]}


def stream_usage(head: dict[str, Any], usage: dict[str, int]) -> dict[str, Any]:
    """The event after the last token when the request asked ``stream_options.include_usage``."""
    return {**head, "choices": [], "usage": usage, "system_fingerprint": FINGERPRINT}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
